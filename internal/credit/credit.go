// Package credit keeps the link-credit accounting of one receiver.
//
// amqpsub attaches its receivers with go-amqp's manual credit (Credit: -1) and
// decides itself when to grant more. An [Account] is a passive state machine:
// the pump tells it what happened (a delivery arrived, deliveries settled, a
// new link was attached) and asks it how much credit to grant now. It keeps
// every counter as int64, so no counter wraps, and it survives a broker that
// sends past the credit it was given (some do).
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
// while transfers are in flight, which is when an overshooting broker
// miscounts.
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
//
// # An adaptive limit
//
// With Adapt, the limit follows demand instead of standing at what New was
// given, which becomes its ceiling. The Account measures two things: the
// drain rate, deliveries settled per second (an exponentially decaying
// count, time constant [DrainWindow]), and the round trip, the time from a
// grant made when the link had no credit left to the first delivery it
// brings. The limit is then
//
//	floor + ⌈Headroom × rate × max(round trip, MinRoundTrip)⌉, within [floor, ceiling]
//
// floor being what the caller's lanes start at once (one delivery per
// lane, a batch for batches), plus what Park says must wait behind an
// earlier delivery of its own group or a stalled call. What the lanes drain in Headroom round trips is in flight, and
// what they hold is the floor: a replica takes what it will start soon, and leaves the rest
// of the queue to the others. Fast handlers raise the rate, and, while the
// credit limits it, the rate raises the limit again (the in-flight term
// grows by Headroom for each round trip it covers), until the round trip
// is covered or the ceiling reached. Slow handlers leave it near the
// floor. An idle link keeps the floor.
//
// # What a round trip sample is worth
//
// A grant made while the queue is empty is answered when a producer
// sends, not when the broker can: its sample is the producer's pause. So
// a sample is only an upper bound of the round trip, and the estimate
// trusts low samples more than high ones:
//
//   - the first grant of a link is not timed: a link is attached to a queue
//     that may well be empty, and its sample would have no average to be
//     checked against;
//   - a sample counts for at most [RoundTripCap], which with Headroom
//     covers round trips of up to 400 ms: a sample is compared with a rate
//     measured over 100 ms, and a trickle's gap taken for a round trip
//     (every grant is timed in windowed mode) would multiply a single
//     settlement into the ceiling;
//   - after the first, a sample below the estimate is the estimate, and
//     one above it counts for at most four times the estimate and moves it
//     by an eighth of the gap;
//   - an estimate above [MinRoundTrip] lasts [RoundTripTTL] from its last
//     sample. Then the Account probes: it grants nothing more until the
//     link's credit has run out (but for the flow frame owed after the
//     last settlement), and times the grant that follows. Under a trickle
//     the credit never runs out, so without the probe an estimate made in
//     a pause would hold the credit high for as long as the trickle
//     lasts; with it, the trickle's own gap becomes the estimate, which
//     holds about Headroom deliveries in flight. A probe costs the lanes
//     at most a round trip of work each RoundTripTTL.
//
// The limit is never lowered on the wire: a lower limit only withholds the
// next grants until what is held and outstanding has run down below it.
// No drain, no flow frame with less credit: the broker keeps what it was
// given and spends it.
package credit

import (
	"fmt"
	"math"
	"time"
)

// The adaptive limit's constants (see the package comment).
const (
	// DrainWindow is the time constant of the drain rate: the rate is
	// what was settled over about the last DrainWindow.
	DrainWindow = 100 * time.Millisecond
	// MinRoundTrip is the least round trip the limit is computed with. A
	// round trip timed on a quiet link is a lower bound of what a credit
	// takes to come back under load: the broker's dispatch, go-amqp's
	// receiver and the Go scheduler all work in bursts at this scale, and
	// fast handlers run dry in the gaps: with the round trip as timed on a
	// quiet local broker (about 0.5 ms), no-op handlers in one lane drain
	// less than under a fixed credit of 256.
	MinRoundTrip = 2 * time.Millisecond
	// RoundTripCap bounds every round-trip sample (see the package
	// comment): a timed grant may have found the queue empty.
	RoundTripCap = 100 * time.Millisecond
	// RoundTripTTL is how long a round-trip estimate above MinRoundTrip
	// lasts without a new sample before it falls back to MinRoundTrip.
	RoundTripTTL = time.Second
	// FlowOwedAfter is how long, with Adapt, the flow frame owed after the
	// last settlement first waits for no delivery to arrive (see Grant);
	// the wait doubles, up to FlowOwedMax, each time a delivery follows
	// one paid past the limit, until a grant within the limit.
	FlowOwedAfter = 250 * time.Millisecond
	FlowOwedMax   = 4 * time.Second
	// Headroom is how many round trips' worth of the drain rate the
	// limit holds in flight, above its floor.
	Headroom = 4
)

// Mode says when an [Account] grants credit.
type Mode int

const (
	// Continuous tops credit up in chunks as deliveries settle, while earlier
	// credit is still outstanding. It suits brokers that keep within the credit
	// they were given.
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
	// flowOwed: the last held delivery was settled, and no grant followed.
	flowOwed bool

	adapt *adaptive // nil: the limit is fixed
}

// adaptive is the state of an adaptive limit (Adapt).
type adaptive struct {
	floor int64
	now   func() time.Time
	// at, when not zero, is the time the calls take as now (At).
	at time.Time

	// The drain rate: a count decaying with DrainWindow, as of drainAt.
	drained float64
	drainAt time.Time

	// Grants on this link not yet covered by a delivery: end is the
	// link's granted count once the grant was made.
	grants []grant
	rtt    time.Duration // the round trip's estimate; 0 before any sample
	rttAt  time.Time     // when rtt was last sampled
	// lastRecv is when the last delivery arrived (FlowOwedAfter).
	lastRecv time.Time
	// owedWait is the quiet the flow owed waits for now; owedPaid: one
	// went out past the limit, and no delivery has arrived since.
	owedWait time.Duration
	owedPaid bool
	// probing: rtt went unconfirmed for RoundTripTTL; grants wait until
	// the link's credit has run out, so that the next one is timed.
	probing bool

	target int64 // the limit as of the last grant
	parked int64 // held deliveries waiting behind their group or a stalled call (Park)
}

type grant struct {
	end int64
	at  time.Time
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

// Adapt makes the limit adaptive (see the package comment): it follows the
// drain rate and the round trip, between floor and the limit New was
// given, which becomes the ceiling. now is the clock. Call it before the
// first Grant. It panics if floor < 1 or now is nil, which callers
// validate first; a floor above the ceiling is the ceiling.
func (a *Account) Adapt(floor int, now func() time.Time) {
	if floor < 1 || now == nil {
		panic("credit: Adapt with floor < 1 or no clock")
	}
	f := min(int64(floor), a.limit)
	a.adapt = &adaptive{floor: f, now: now, target: f, owedWait: FlowOwedAfter}
}

// At sets the time an adaptive Account's calls take as now, until the next
// At; the zero time makes them read the clock again, as they do before any
// At. Its caller reads the clock once and has every call of one moment
// (the pump: a turn of its loop) share it, since a clock read costs about
// as much as the rest of a delivery's accounting.
func (a *Account) At(now time.Time) {
	if a.adapt != nil {
		a.adapt.at = now
	}
}

// Now is the time an adaptive Account's calls take as now: At's, or else
// the clock's (time.Now for an Account that does not adapt).
func (a *Account) Now() time.Time {
	if a.adapt == nil {
		return time.Now()
	}
	return a.adapt.clock()
}

// clock is At's time, or else the clock's.
func (ad *adaptive) clock() time.Time {
	if !ad.at.IsZero() {
		return ad.at
	}
	return ad.now()
}

// Park tells an adaptive Account how many of the deliveries held wait
// behind an earlier delivery of their group or a stalled call (a hot or
// stuck group's, say), as much of them as the caller wants held: they are
// held on top of the adaptive limit, up to the ceiling, so that they do
// not take the credit the free lanes need. Call it before Grant; it does
// nothing without Adapt.
//
// n is taken as at most what is held: a lane may count a delivery until
// its whole call returns (a batch whose first deliveries were settled
// while the rest are retried), when the process no longer holds it.
func (a *Account) Park(n int) {
	if a.adapt != nil {
		a.adapt.parked = min(int64(max(0, n)), a.held)
	}
}

// Attach starts the accounting of a new link. Deliveries still held from an
// earlier link keep counting towards the limit until they are settled, so the
// bound holds across reconnects.
func (a *Account) Attach() {
	a.granted, a.received, a.seen = 0, 0, false
	if ad := a.adapt; ad != nil {
		ad.grants = ad.grants[:0]
	}
}

// Received records one delivery from the current link. It reports true the
// first time on this link that the broker sent past the credit it was given.
func (a *Account) Received() (firstOvershoot bool) {
	a.received++
	a.held++
	if ad := a.adapt; ad != nil {
		ad.lastRecv = ad.clock()
		if ad.owedPaid {
			// The flow paid past the limit was followed by a delivery: a
			// trickle (or a queue it resumed). The next waits longer, so that
			// a trickle's excess runs down.
			ad.owedPaid = false
			ad.owedWait = min(2*ad.owedWait, FlowOwedMax)
		}
		ad.covered(a.received)
	}
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
	if a.held == 0 && n > 0 {
		a.flowOwed = true
	}
	if ad := a.adapt; ad != nil && n > 0 {
		now := ad.clock()
		ad.drained = ad.decayed(now) + float64(n)
		ad.drainAt = now
	}
}

// decayed returns the drain count decayed to now.
func (ad *adaptive) decayed(now time.Time) float64 {
	dt := now.Sub(ad.drainAt)
	if ad.drained == 0 || dt <= 0 {
		return ad.drained
	}
	return ad.drained * math.Exp(-float64(dt)/float64(DrainWindow))
}

// covered takes the round trip of the k-th delivery of the link: from
// the grant that covered it, when it is the first of that grant.
func (ad *adaptive) covered(k int64) {
	for len(ad.grants) > 0 && ad.grants[0].end < k {
		ad.grants = ad.grants[1:]
	}
	// The grants before the one that covers k are popped: k is the first
	// delivery of grants[0] when none of it was sampled yet.
	if len(ad.grants) == 0 || ad.grants[0].at.IsZero() {
		return // past the credit, or not the grant's first
	}
	g := &ad.grants[0]
	now := ad.clock()
	rtt := max(now.Sub(g.at), time.Microsecond)
	g.at = time.Time{} // sampled
	ad.rttAt, ad.probing = now, false
	switch {
	case ad.rtt == 0:
		ad.rtt = min(rtt, RoundTripCap)
	case rtt < ad.rtt:
		// Every sample is an upper bound of the round trip: a low one is
		// believed at once.
		ad.rtt = rtt
	default:
		// A high one may be a producer's pause: it counts for at most four
		// times the estimate, which a run of such samples still raises,
		// 37% at a time.
		ad.rtt += (min(rtt, 4*ad.rtt, RoundTripCap) - ad.rtt) / 8
	}
}

// targetAt returns the adaptive limit at now, within floor and ceiling.
func (ad *adaptive) targetAt(now time.Time, ceiling int64) int64 {
	if ad.rtt > MinRoundTrip && now.Sub(ad.rttAt) > RoundTripTTL {
		ad.probing = true // unconfirmed for too long: see the package comment
	}
	drained := ad.decayed(now)
	base := min(ceiling, ad.floor+ad.parked)
	if drained < 0.5 {
		return base // idle: less than half a delivery over the window
	}
	rate := drained / DrainWindow.Seconds()
	inFlight := math.Ceil(Headroom * rate * max(ad.rtt, MinRoundTrip).Seconds())
	if inFlight >= float64(ceiling) {
		return ceiling
	}
	return min(ceiling, base+int64(inFlight))
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

// limitNow is the most deliveries to hold now: the limit (adaptive, with
// Adapt), or fewer under a byte budget.
func (a *Account) limitNow() int64 {
	limit := a.limit
	if ad := a.adapt; ad != nil {
		limit = ad.target
	}
	if a.budget == 0 {
		return limit
	}
	if a.sizeEst == 0 {
		return 1 // no size seen yet
	}
	return min(limit, max(1, a.budget/a.sizeEst))
}

// Grant returns the credit to issue now and records it as issued; 0 means
// issue nothing. The result never exceeds what keeps held+outstanding within
// the limit, plus the overshoot to win back (see the package comment).
func (a *Account) Grant() uint32 {
	outstanding := a.granted - a.received
	if ad := a.adapt; ad != nil {
		ad.target = ad.targetAt(ad.clock(), a.limit)
	}
	if a.mode == Windowed && outstanding > 0 {
		return 0
	}
	owed := a.owedPayable(outstanding)
	if ad := a.adapt; ad != nil && owed {
		owed = ad.clock().Sub(ad.lastRecv) >= ad.owedWait
	}
	if ad := a.adapt; ad != nil && ad.probing && outstanding > 0 {
		// Until the credit runs out, for a timed grant; but the flow owed.
		if !owed {
			return 0
		}
		ad.owedPaid = true
		return a.issue(1, outstanding)
	}
	limit, chunk := a.limit, a.chunk
	// moving: the held deliveries whose settlement will come soon. Those
	// parked (Park) may wait for as long as their group or a stalled call
	// does: neither the chunk nor the wait for settlements counts them.
	moving := a.held
	if ad := a.adapt; ad != nil {
		limit = ad.target
		moving -= min(ad.parked, a.held)
		chunk = min(chunk, max(1, (limit-ad.parked)/8))
	}
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
	if want <= 0 && owed {
		want = 1
		if ad := a.adapt; ad != nil {
			ad.owedPaid = true
		}
	} else if ad := a.adapt; ad != nil && want > 0 {
		ad.owedWait = FlowOwedAfter // within the limit again
	}
	// Below a chunk, wait for more settlements, unless nothing is held (or
	// only parked deliveries): then no settlement is
	// coming soon to trigger the next grant, and a broker that re-checks its
	// consumers only on a flow frame (a queue that pauses dispatch while
	// it rebalances its groups) would wait forever.
	if want < chunk && (moving > 0 || want <= 0) {
		return 0
	}
	return a.issue(want, outstanding)
}

// issue records a grant of want (> 0) made with outstanding credit left,
// and returns it.
func (a *Account) issue(want, outstanding int64) uint32 {
	// want ≤ limit + overshoot of this link; both fit a uint32 for any limit
	// the options accept, but clamp anyway rather than wrap.
	want = min(want, 1<<31)
	a.granted += want
	a.flowOwed = false
	if ad := a.adapt; ad != nil {
		// Only a grant to a link that had spent its credit times the round
		// trip: after one made while credit was outstanding, the broker
		// first sends what the earlier credit covers. Not the link's first
		// grant (see the package comment).
		g := grant{end: a.granted}
		if outstanding <= 0 && a.granted > want {
			g.at = ad.clock()
		}
		ad.grants = append(ad.grants, g)
	}
	return uint32(want) //nolint:gosec // G115: 0 < want ≤ 2³¹, clamped above
}

// owedPayable reports whether the flow frame owed after the last
// settlement may go out now, but for the quiet it waits for with Adapt.
//
// The last settlement is followed by a flow frame even when the adaptive
// limit has come down below what is outstanding: a queue that paused
// dispatch (to rebalance its groups) resumes only on one, and a pause is
// when the rate, and so the limit, falls. One credit past the limit,
// within the ceiling, never under a byte budget nor with a window out,
// and with Adapt only once no delivery has arrived for a while
// (FlowOwedAfter, doubling up to FlowOwedMax while deliveries keep
// following such flows): a queue that is paused sends nothing, while
// under a trickle (every delivery handled before the next arrives, so
// each empties the process) a flow after every delivery would keep the
// credit outstanding where it is instead of letting it run down.
func (a *Account) owedPayable(outstanding int64) bool {
	return a.flowOwed && a.held == 0 && a.budget == 0 && a.limit-outstanding >= 1 &&
		(a.mode != Windowed || outstanding <= 0)
}

// FlowOwed reports whether a flow frame is owed after the last
// settlement, has not gone out, and Grant may send it: with Adapt it
// waits for a quiet link, so the caller calls Grant again until it has
// gone out or is no longer owed.
func (a *Account) FlowOwed() bool { return a.owedPayable(a.granted - a.received) }

// Limit returns the most deliveries the Account lets the process hold
// now: the limit New was given, or with Adapt the adaptive limit as of the
// last Grant; fewer under a byte budget.
func (a *Account) Limit() int { return int(a.limitNow()) }

// Held returns the deliveries held in the process.
func (a *Account) Held() int { return int(a.held) }

// BytesHeld returns the bytes of the deliveries held (ReceivedBytes less
// SettledBytes), and the most held at once.
func (a *Account) BytesHeld() (now, most int64) { return a.bytesHeld, a.maxBytesHeld }

// Overshoot returns the deliveries received past the credit, on all links.
func (a *Account) Overshoot() int64 { return a.overshoot }

// Snapshot is a copy of an [Account]'s counters.
type Snapshot struct {
	Limit       int           // configured credit (with Adapt, the ceiling)
	LimitNow    int           // the limit now: Limit, or the adaptive limit, or fewer under a byte budget
	RoundTrip   time.Duration // with Adapt, the round trip measured; 0 before any
	Mode        Mode          // current mode; Windowed after an overshoot
	Held        int           // deliveries held in the process now
	MaxHeld     int           // the most held at once
	Outstanding int64         // credit the broker still has on this link; negative after an overshoot
	Overshoot   int64         // deliveries received past the credit, in all
	Overshoots  int64         // links on which the broker overshot
	// With a byte budget: the bytes held now and at most, and the budget.
	BytesHeld, MaxBytesHeld, ByteBudget int64
}

// Snapshot returns the [Account]'s counters.
func (a *Account) Snapshot() Snapshot {
	return Snapshot{
		Limit:        int(a.limit),
		LimitNow:     int(a.limitNow()),
		Mode:         a.mode,
		Held:         int(a.held),
		MaxHeld:      int(a.maxHeld),
		Outstanding:  a.granted - a.received,
		Overshoot:    a.overshoot,
		Overshoots:   a.overshoots,
		BytesHeld:    a.bytesHeld,
		MaxBytesHeld: a.maxBytesHeld,
		ByteBudget:   a.budget,
		RoundTrip:    a.roundTrip(),
	}
}

// RoundTrip returns the round trip an adaptive limit measured: 0 without
// Adapt, or before a first sample.
func (a *Account) RoundTrip() time.Duration { return a.roundTrip() }

func (a *Account) roundTrip() time.Duration {
	if a.adapt == nil {
		return 0
	}
	return a.adapt.rtt
}
