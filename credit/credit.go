// Package credit keeps the link-credit accounting of one receiver.
//
// amqpsub attaches its receivers with go-amqp's manual credit (Credit: -1) and
// decides itself when to grant more. An [Account] is a passive state machine:
// the pump tells it what happened (a delivery arrived, deliveries settled, a
// new link was attached) and asks it how much credit to grant now. It keeps
// every counter as int64, so no counter wraps, and it survives a broker that
// sends past the credit it was given (RabbitMQ 3.10 does).
//
// # The arithmetic
//
// go-amqp sends, in each flow frame, the credit issued since the last frame
// plus its own running credit, which it decrements for every transfer without
// a check. Summed over the life of a link that running credit is
// granted-arrived, so the frame carries
//
//	link-credit = limit - held - unseen
//
// when the Account grants limit - held - (granted - received): limit is the
// configured credit, held the deliveries the process holds, and unseen the
// transfers that arrived in go-amqp but have not yet been received by the
// pump. On a broker that keeps within its credit, unseen ≤ granted-received
// and the frame is never negative. A broker that overshoots makes
// granted-received negative; the grant then grows by the overshoot, which
// brings go-amqp's counter back from its wrapped value instead of leaving it
// near 2³², where go-amqp's automatic credit stalls forever.
//
// After an overshoot the Account switches to windowed granting: it grants
// only once everything granted so far has arrived, so no flow frame is sent
// while transfers are in flight, which is when RabbitMQ 3.10 miscounts.
//
// # A byte budget
//
// With a byte budget (SetByteBudget) the Account also bounds the bytes of
// the deliveries held. The broker does not say how large a message is
// before it sends it, so the Account grants by an estimate: it keeps held
// plus outstanding within the budget divided by the largest size received
// lately (decaying by 1/16 a delivery), and grants nothing while the bytes
// held are at the budget. Until a first delivery has arrived, and whenever
// nothing is held or outstanding, it grants one, so that a delivery larger
// than the whole budget still flows, alone. What is held passes the budget
// only by deliveries larger than any lately: those already granted when
// such a run began, up to the budget's worth of the earlier size.
package credit

import "fmt"

// Mode says when an [Account] grants credit.
type Mode int

const (
	// Continuous tops credit up in chunks as deliveries settle, while earlier
	// credit is still outstanding. It suits brokers that keep within the credit
	// they were given, such as Artemis.
	Continuous Mode = iota
	// Windowed grants only once every credit granted so far has been used.
	// It costs a round trip per window and suits brokers that overshoot.
	Windowed
)

func (m Mode) String() string {
	switch m {
	case Continuous:
		return "continuous"
	case Windowed:
		return "windowed"
	}
	return fmt.Sprintf("Mode(%d)", int(m))
}

// Account is the credit accounting of one receiver. It is not safe for
// concurrent use: the pump goroutine owns it.
type Account struct {
	limit int64
	chunk int64
	mode  Mode

	// Per link: reset by Attach.
	granted  int64 // credit issued on this link
	received int64 // deliveries received on this link

	held    int64 // deliveries held in the process, every link
	maxHeld int64

	// With a byte budget (0: none).
	budget       int64
	bytesHeld    int64
	maxBytesHeld int64
	sizeEst      int64 // the largest size received lately; 0 before any
	overshoot    int64 // deliveries received past the credit, all links
	overshoots   int64 // links on which an overshoot was seen
	seen         bool  // overshoot seen on this link
}

// New returns an [Account] that keeps at most limit deliveries in the process
// and grants credit in chunks of at least max(1, limit/8): one flow frame per
// eighth of the credit settled, rather than one per delivery. It panics if
// limit < 1, which callers validate first.
func New(limit int, mode Mode) *Account {
	if limit < 1 {
		panic("credit: limit < 1")
	}
	return &Account{limit: int64(limit), chunk: int64(max(1, limit/8)), mode: mode}
}

// Attach starts the accounting of a new link. Deliveries still held from an
// earlier link keep counting towards the limit until they are settled, so the
// bound holds across reconnects.
func (a *Account) Attach() {
	a.granted, a.received, a.seen = 0, 0, false
}

// Received records one delivery from the current link. It reports true the
// first time on this link that the broker sent past the credit it was given.
func (a *Account) Received() (firstOvershoot bool) {
	a.received++
	a.held++
	a.maxHeld = max(a.maxHeld, a.held)
	if a.received > a.granted {
		a.overshoot++
		if !a.seen {
			a.seen = true
			a.overshoots++
			a.mode = Windowed
			return true
		}
	}
	return false
}

// Settled records that n held deliveries left the process: settled, or
// dropped because their link was lost.
func (a *Account) Settled(n int) {
	a.held -= int64(n)
	if a.held < 0 {
		panic("credit: more settled than held")
	}
}

// SetByteBudget bounds the bytes held, besides the deliveries (see the
// package comment); 0 removes the bound. It panics if budget < 0, which
// callers validate first.
func (a *Account) SetByteBudget(budget int64) {
	if budget < 0 {
		panic("credit: byte budget < 0")
	}
	a.budget = budget
}

// ReceivedBytes records the size of a delivery just Received.
func (a *Account) ReceivedBytes(n int64) {
	a.bytesHeld += n
	a.maxBytesHeld = max(a.maxBytesHeld, a.bytesHeld)
	// The largest lately: a larger size counts at once, and the estimate
	// decays by 1/16 a delivery after it (halved in about 11), so that a
	// burst of large messages is assumed to go on for a while.
	a.sizeEst = max(n, a.sizeEst-a.sizeEst/16, 1)
}

// SettledBytes records that held deliveries of n bytes in all left the
// process.
func (a *Account) SettledBytes(n int64) {
	a.bytesHeld -= n
	if a.bytesHeld < 0 {
		panic("credit: more bytes settled than held")
	}
}

// limitNow is the most deliveries to hold now: the limit, or fewer under a
// byte budget.
func (a *Account) limitNow() int64 {
	if a.budget == 0 {
		return a.limit
	}
	if a.sizeEst == 0 {
		return 1 // no size seen yet
	}
	return min(a.limit, max(1, a.budget/a.sizeEst))
}

// Grant returns the credit to issue now and records it as issued; 0 means
// issue nothing. The result never exceeds what keeps held+outstanding within
// the limit, plus the overshoot to win back (see the package comment).
func (a *Account) Grant() uint32 {
	outstanding := a.granted - a.received
	if a.mode == Windowed && outstanding > 0 {
		return 0
	}
	limit, chunk := a.limit, a.chunk
	if a.budget > 0 {
		if a.bytesHeld >= a.budget && a.held > 0 {
			return 0 // at the budget: wait for settlements
		}
		limit = a.limitNow()
		chunk = min(chunk, max(1, limit/8))
	}
	want := limit - a.held - outstanding
	if a.budget > 0 && a.held == 0 && outstanding <= 0 {
		want = max(want, 1) // one always flows, however large
	}
	// Below a chunk, wait for more settlements, unless nothing is held: then
	// no settlement is coming to trigger the next grant, and a broker that
	// re-checks its consumers only on a flow frame (Artemis with
	// group-rebalance-pause-dispatch) would wait forever.
	if want < chunk && (a.held > 0 || want <= 0) {
		return 0
	}
	// want ≤ limit + overshoot of this link; both fit a uint32 for any limit
	// the options accept, but clamp anyway rather than wrap.
	want = min(want, 1<<31)
	a.granted += want
	return uint32(want)
}

// Held returns the deliveries held in the process.
func (a *Account) Held() int { return int(a.held) }

// BytesHeld returns the bytes of the deliveries held (ReceivedBytes less
// SettledBytes), and the most held at once.
func (a *Account) BytesHeld() (now, most int64) { return a.bytesHeld, a.maxBytesHeld }

// Overshoot returns the deliveries received past the credit, on all links.
func (a *Account) Overshoot() int64 { return a.overshoot }

// Snapshot is a copy of an [Account]'s counters.
type Snapshot struct {
	Limit       int   // configured credit
	Mode        Mode  // current mode; Windowed after an overshoot
	Held        int   // deliveries held in the process now
	MaxHeld     int   // the most held at once
	Outstanding int64 // credit the broker still has on this link; negative after an overshoot
	Overshoot   int64 // deliveries received past the credit, in all
	Overshoots  int64 // links on which the broker overshot
	// With a byte budget: the bytes held now and at most, and the budget.
	BytesHeld, MaxBytesHeld, ByteBudget int64
}

// Snapshot returns the [Account]'s counters.
func (a *Account) Snapshot() Snapshot {
	return Snapshot{
		Limit:        int(a.limit),
		Mode:         a.mode,
		Held:         int(a.held),
		MaxHeld:      int(a.maxHeld),
		Outstanding:  a.granted - a.received,
		Overshoot:    a.overshoot,
		Overshoots:   a.overshoots,
		BytesHeld:    a.bytesHeld,
		MaxBytesHeld: a.maxBytesHeld,
		ByteBudget:   a.budget,
	}
}
