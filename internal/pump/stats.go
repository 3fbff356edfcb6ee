package pump

import (
	"sync/atomic"
	"time"

	"github.com/Azure/go-amqp"

	"github.com/amqpsub/amqpsub/internal/driver"
)

type counters struct {
	received        atomic.Uint64
	granted         atomic.Uint64
	settled         [driver.Drop + 1]atomic.Uint64
	settleErrors    atomic.Uint64
	stale           atomic.Uint64
	unsent          atomic.Uint64
	doubleSettle    atomic.Uint64
	lockLostDropped atomic.Uint64
	lockLostSkipped atomic.Uint64
	lockLostAnswers atomic.Uint64
	settleTimeouts  atomic.Uint64
	links           atomic.Uint64
	linksLost       atomic.Uint64
	held            atomic.Int64
	maxHeld         atomic.Int64
	bytesHeld       atomic.Int64
	maxBytesHeld    atomic.Int64
	overshoot       atomic.Int64
	windowed        atomic.Bool
	creditNow       atomic.Int64
	roundTrip       atomic.Int64 // ns
}

// Stats are a pump's counters. Counts are totals since [New].
type Stats struct {
	Received uint64 // deliveries received
	Granted  uint64 // credit granted to the broker
	// Settlements the broker took, by outcome.
	Accepted, Released, Modified, Rejected uint64
	// Dropped counts deliveries freed without a settlement because their
	// link was lost before a handler took them; the broker redelivers them.
	Dropped uint64
	// SettleErrors counts settlements the broker did not take.
	SettleErrors uint64
	// Stale counts settlements skipped because their link was lost.
	Stale uint64
	// Unsent counts settlements decided but never sent because Run ended
	// first: its ctx ended and FlushBy's time ran out.
	Unsent uint64
	// DoubleSettles counts Settle calls refused because the delivery was
	// already settled.
	DoubleSettles uint64
	// Lost leases (LoseLease): deliveries dropped before a handler took
	// them, and settlements skipped because the handler had the delivery;
	// settlements the broker answered with a lost lease
	// (driver.Leases.LostAnswer); and settlements
	// that a settler saw go unanswered within SettleTimeout.
	LockLostDropped, LockLostSkipped, LockLostAnswers, SettleTimeouts uint64
	Links                                                             uint64 // links attached
	LinksLost                                                         uint64 // links lost
	Held                                                              int    // deliveries held in the process now
	MaxHeld                                                           int    // the most deliveries held at once
	Overshoot                                                         int64  // deliveries the broker sent past the credit
	Windowed                                                          bool   // credit is granted in windows (after an overshoot)
	// BytesHeld is the [Size] of the deliveries held now, MaxBytesHeld the
	// most at once.
	BytesHeld, MaxBytesHeld int64
	// Credit is the most deliveries the pump lets the process hold now
	// (held and outstanding): [Config.Credit], or less with
	// [Config.AdaptiveFloor] (the adaptive limit as of the last grant) or
	// a byte budget. RoundTrip is the round trip the adaptive limit
	// measured (0 without one, or before a first delivery).
	Credit    int
	RoundTrip time.Duration
	// A census of the book, taken entry by entry while the pump goes on:
	// Buffered + Handling + Settling is Held give or take the deliveries that
	// moved meanwhile.
	Buffered, Handling, Settling int
}

// Stats returns the pump's counters and a census of its book. It may be
// called from any goroutine.
func (p *Pump) Stats() Stats {
	s := Stats{
		Received:        p.stats.received.Load(),
		Granted:         p.stats.granted.Load(),
		Accepted:        p.stats.settled[driver.Accept].Load(),
		Released:        p.stats.settled[driver.Release].Load(),
		Modified:        p.stats.settled[driver.Modify].Load(),
		Rejected:        p.stats.settled[driver.Reject].Load(),
		Dropped:         p.stats.settled[driver.Drop].Load(),
		SettleErrors:    p.stats.settleErrors.Load(),
		Stale:           p.stats.stale.Load(),
		Unsent:          p.stats.unsent.Load(),
		DoubleSettles:   p.stats.doubleSettle.Load(),
		LockLostDropped: p.stats.lockLostDropped.Load(),
		LockLostSkipped: p.stats.lockLostSkipped.Load(),
		LockLostAnswers: p.stats.lockLostAnswers.Load(),
		SettleTimeouts:  p.stats.settleTimeouts.Load(),
		Links:           p.stats.links.Load(),
		LinksLost:       p.stats.linksLost.Load(),
		Held:            int(p.stats.held.Load()),
		MaxHeld:         int(p.stats.maxHeld.Load()),
		Overshoot:       p.stats.overshoot.Load(),
		Windowed:        p.stats.windowed.Load(),
		BytesHeld:       p.stats.bytesHeld.Load(),
		MaxBytesHeld:    p.stats.maxBytesHeld.Load(),
		Credit:          int(p.stats.creditNow.Load()),
		RoundTrip:       time.Duration(p.stats.roundTrip.Load()),
	}
	p.Each(func(d *driver.Delivery) bool {
		switch d.State() {
		case driver.Buffered:
			s.Buffered++
		case driver.Handling:
			s.Handling++
		case driver.Settling:
			s.Settling++
		}
		return true
	})
	return s
}

// EventKind says what an [Event] reports.
type EventKind uint8

const (
	// SettleFailed means the broker did not take a settlement (Err says why);
	// it redelivers the delivery.
	SettleFailed EventKind = iota
	// LinkLost means the link failed (Err); the pump attaches another.
	LinkLost
	// Overshoot means the broker sent past its credit for the first time on a
	// link; credit is granted in windows from now on.
	Overshoot
)

// Event is something that happened on the pump's goroutine that the user
// may want to hear of ([Config.OnEvent]).
type Event struct {
	Kind    EventKind
	Err     error
	Message *amqp.Message // the delivery's message, for SettleFailed
	Outcome driver.Kind   // for SettleFailed
}
