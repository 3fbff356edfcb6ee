package pump

import "sync/atomic"

type counters struct {
	received     atomic.Uint64
	granted      atomic.Uint64
	settled      [Drop + 1]atomic.Uint64
	settleErrors atomic.Uint64
	stale        atomic.Uint64
	links        atomic.Uint64
	linksLost    atomic.Uint64
	held         atomic.Int64
	maxHeld      atomic.Int64
	overshoot    atomic.Int64
	windowed     atomic.Bool
}

// Stats are a pump's counters. Counts are totals since New.
type Stats struct {
	Received     uint64 // deliveries received
	Granted      uint64 // credit granted to the broker
	Accepted     uint64 // settled as accepted
	Released     uint64 // settled as released
	Modified     uint64 // settled as modified
	Rejected     uint64 // settled as rejected
	Dropped      uint64 // freed without a settlement: their link was lost
	SettleErrors uint64 // settlements the broker did not take
	Stale        uint64 // settlements skipped because their link was lost
	Links        uint64 // links attached
	LinksLost    uint64 // links lost
	Held         int    // deliveries held in the process now
	MaxHeld      int    // the most deliveries held at once
	Overshoot    int64  // deliveries the broker sent past the credit
	Windowed     bool   // credit is granted in windows (after an overshoot)
	Buffered     int    // held, waiting for a handler
	Handling     int    // held, in a handler
}

// Stats returns the pump's counters and a census of its book. It may be
// called from any goroutine.
func (p *Pump) Stats() Stats {
	s := Stats{
		Received:     p.stats.received.Load(),
		Granted:      p.stats.granted.Load(),
		Accepted:     p.stats.settled[Accept].Load(),
		Released:     p.stats.settled[Release].Load(),
		Modified:     p.stats.settled[Modify].Load(),
		Rejected:     p.stats.settled[Reject].Load(),
		Dropped:      p.stats.settled[Drop].Load(),
		SettleErrors: p.stats.settleErrors.Load(),
		Stale:        p.stats.stale.Load(),
		Links:        p.stats.links.Load(),
		LinksLost:    p.stats.linksLost.Load(),
		Held:         int(p.stats.held.Load()),
		MaxHeld:      int(p.stats.maxHeld.Load()),
		Overshoot:    p.stats.overshoot.Load(),
		Windowed:     p.stats.windowed.Load(),
	}
	p.Each(func(d *Delivery) bool {
		switch d.State() {
		case Buffered:
			s.Buffered++
		case Handling:
			s.Handling++
		}
		return true
	})
	return s
}
