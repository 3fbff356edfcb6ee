package pump

import (
	"github.com/Azure/go-amqp"

	"github.com/amqpsub/amqpsub/internal/driver"
)

// take puts msg into a free entry, making one when every entry is in use:
// past the credit (a broker that overshoots) or while dropped entries of a
// lost link still wait in a lane.
func (p *Pump) take(msg *amqp.Message, src driver.Source, link uint64) driver.Ticket {
	var d *driver.Delivery
	if n := len(p.free); n > 0 {
		d = p.free[n-1]
		p.free[n-1] = nil
		p.free = p.free[:n-1]
	} else {
		d = driver.NewDelivery(p.links)
		p.bookMu.Lock()
		p.book = append(p.book, d)
		p.bookMu.Unlock()
	}
	return d.Fill(msg, src, link, Size(msg))
}

// release returns an entry to the free list.
func (p *Pump) release(d *driver.Delivery) {
	if p.cfg.Leases != nil {
		p.cfg.Leases.Remove(d)
	}
	d.Clear()
	p.free = append(p.free, d)
}

// dropStale stops counting as held every buffered delivery of a lost link:
// its settlement could not reach the broker, which redelivers it, so the
// next link gets all the credit its limit allows at once instead of as the
// lanes reach these deliveries. all says that no lease of the lost link
// can be kept any more, those of deliveries in handlers included;
// otherwise (LeasesOutliveLinks, DropBufferedOn) only the dropped ones
// leave the Leases.
func (p *Pump) dropStale(all bool) {
	cur := p.links.Current()
	n, bytes := 0, int64(0)
	for _, d := range p.book { // the pump is the book's only writer
		if d.DropStale(cur) {
			n++
			bytes += d.Size()
		}
	}
	if n > 0 {
		p.stats.settled[driver.Drop].Add(uint64(n))
		if p.cfg.Meter != nil {
			p.cfg.Meter.Dropped(n)
		}
		p.freed(n, bytes)
	}
	if p.cfg.Leases != nil {
		// No lease of a lost link can be kept (the broker ended them with
		// the link): the Leases forget them all, those still in handlers
		// or settling too, rather than spend a refused renewal on each.
		for _, d := range p.book {
			if st := d.State(); st == driver.Dropped || st == driver.Reclaiming || (all && d.Link() != cur && st != driver.Free) {
				p.cfg.Leases.Remove(d)
			}
		}
	}
}

// LoseLease tells the pump that the lease of t's delivery is lost (the
// broker no longer holds it for this consumer, and redelivers it). It may
// be called from any goroutine.
//
// A delivery no handler has taken yet is dropped (it stops counting as
// held at once, and the consumer that finds it passes it to Settle, which
// only frees it); a delivery in a handler is marked, so that its
// settlement is not sent and counted as skipped. A delivery already
// settling or settled is left alone.
//
// It reports whether it acted: false when the ticket's delivery was
// settling or settled, or its entry already holds another.
func (p *Pump) LoseLease(t driver.Ticket) bool {
	switch from, size := t.LoseLease(); from {
	case driver.Buffered:
		p.settle.push(settlement{t: t, size: size, op: opLeaseLost})
		return true
	case driver.Handling:
		return true
	}
	return false
}

// Each calls fn for every delivery held in the process, until fn returns
// false. It may run from any goroutine; a delivery may change state or be
// settled while fn looks at it.
func (p *Pump) Each(fn func(d *driver.Delivery) bool) {
	p.bookMu.RLock()
	defer p.bookMu.RUnlock()
	for _, d := range p.book {
		if s := d.State(); s != driver.Free && s != driver.Dropped && s != driver.Reclaiming && !fn(d) {
			return
		}
	}
}
