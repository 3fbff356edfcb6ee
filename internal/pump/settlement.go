package pump

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/Azure/go-amqp"
	"go.uber.org/zap"

	"github.com/amqpsub/amqpsub/internal/driver"
)

// op is what the pump does with a queued settlement besides sending it.
type op uint8

const (
	// opSend sends the settlement's outcome (or, for Drop, only frees the
	// entry).
	opSend op = iota
	// opReclaim frees the entry of a Dropped delivery, which no longer
	// counts as held.
	opReclaim
	// opLeaseLost stops counting as held a delivery LoseLease dropped.
	opLeaseLost
)

type settlement struct {
	t driver.Ticket
	// key orders the settlement behind the earlier ones of the same key
	// (ordered): they go out one after another on one settler.
	key     uint64
	ordered bool
	// The entry may be reclaimed and reused before the pump applies an
	// opLeaseLost: t tells.
	op   op
	size int64 // the delivery's Size, for an opLeaseLost
	o    driver.Outcome
	// done: a settler has sent o and err is the broker's answer (Settlers).
	done bool
	err  error
}

// Settle hands the pump a delivery's settlement and reports true; it
// reports false, and does nothing, when the delivery was already settled: a
// delivery settles once.
//
// It never blocks and does not wait for the broker: the pump applies
// queued settlements in a burst whenever it wakes, also while a delivery
// waits for room in Out. A dropped delivery (see [State]) is only freed,
// whatever the outcome. Settlements that arrive after Run has returned are
// not applied; the broker redelivers those deliveries once the link is
// closed.
func (p *Pump) Settle(t driver.Ticket, o driver.Outcome) bool {
	return p.settleAs(t, settlement{t: t, op: opSend, o: o})
}

// SettleInOrder is Settle for a settlement that must reach the broker
// after every earlier one of the same key, which the caller gives in the
// order it decided them. A key is a group's (its group-id's hash, say), so
// that a group's later settlement never reaches the broker before an
// earlier one.
//
// With Settlers, the settlements of one key go out one after another, each
// once the broker answered the one before, while those of other keys go
// out beside them. Without Settlers every settlement is sent in order on
// the pump's goroutine, and SettleInOrder is Settle.
func (p *Pump) SettleInOrder(t driver.Ticket, o driver.Outcome, key uint64) bool {
	return p.settleAs(t, settlement{t: t, op: opSend, o: o, key: key, ordered: true})
}

func (p *Pump) settleAs(t driver.Ticket, st settlement) bool {
	switch t.HandBack() {
	case driver.Buffered, driver.Handling:
		p.settle.push(st)
		return true
	case driver.Dropped:
		p.settle.push(settlement{t: t, op: opReclaim})
		return true
	}
	p.stats.doubleSettle.Add(1)
	return false
}

// applyQueued applies every queued settlement.
func (p *Pump) applyQueued(ctx context.Context) {
	batch, _ := p.settle.take()
	for _, s := range batch {
		p.apply(ctx, s)
	}
	p.settle.recycle(batch)
}

// apply sends a settlement to the broker (or hands it to a settler) and
// frees the delivery's entry.
func (p *Pump) apply(ctx context.Context, s settlement) {
	d := s.t.Entry()
	switch {
	case s.op == opReclaim:
		p.release(d)
		return
	case s.op == opLeaseLost:
		// Dropped by LoseLease: no longer held; the consumer frees it. The
		// consumer may have reclaimed the entry already, and the pump
		// given it to the next delivery (release told the lease book
		// then): the count still goes, but not that delivery's lease.
		p.stats.lockLostDropped.Add(1)
		if p.cfg.Meter != nil {
			p.cfg.Meter.Dropped(1)
		}
		if p.cfg.Leases != nil && !s.t.Reused() {
			p.cfg.Leases.Remove(d)
		}
		p.freed(1, s.size)
		return
	case s.done:
		p.inFlight--
		switch {
		case errors.Is(s.err, errUnsent):
			p.unsent(d, s.o.Kind)
		case errors.Is(s.err, errStale):
			p.log.Debug("settlement of a delivery whose link was lost while it waited for a settler skipped; the broker redelivers it",
				zap.Stringer("outcome", s.o.Kind))
			p.stats.stale.Add(1)
			p.notSent(d, s.o.Kind)
		default:
			p.settled(d, s.o.Kind, s.err)
		}
	case s.o.Kind == driver.Drop:
		p.stats.settled[driver.Drop].Add(1)
		if p.cfg.Meter != nil {
			p.cfg.Meter.Dropped(1)
		}
	case p.links.Stale(d.Link()):
		p.log.Debug("settlement of a delivery from a lost link skipped; the broker redelivers it",
			zap.Stringer("outcome", s.o.Kind))
		p.stats.stale.Add(1)
		p.notSent(d, s.o.Kind)
	case d.LeaseLost():
		p.log.Debug("settlement of a delivery whose lock was lost skipped; the broker redelivers it",
			zap.Stringer("outcome", s.o.Kind))
		p.stats.lockLostSkipped.Add(1)
		p.notSent(d, s.o.Kind)
	case p.ended:
		// Run is returning and its settlers are gone: decided, never sent.
		p.unsent(d, s.o.Kind)
	case len(p.shards) > 0:
		// A settler sends it and reports back (done); the entry stays held
		// until then.
		p.dispatch(s)
		return
	default:
		k, err := settleOn(ctx, d.Source(), d.Message(), s.o)
		p.settled(d, k, err)
	}
	size := d.Size()
	p.release(d)
	p.freed(1, size)
}

// dispatch hands s to a settler: the one its key names, behind the
// settlements of the same key; or, unordered, whichever settler is free
// first (the shared queue), so that none waits behind a settlement the
// broker is slow to answer while another settler is idle. Neither blocks:
// when the shared queue is full, an unordered settlement goes to the
// settler with the least queued.
func (p *Pump) dispatch(s settlement) {
	p.inFlight++
	if !s.ordered {
		select {
		case p.anyq <- s:
			return
		default:
		}
	}
	n := len(p.shards)
	var i int
	if s.ordered {
		i = shardOf(s.key, n)
	} else {
		best := int32(-1)
		for k := range n {
			j := (p.next + k) % n
			if q := p.shards[j].load.Load(); best < 0 || q < best {
				i, best = j, q
			}
		}
		p.next = (i + 1) % n
	}
	p.shards[i].load.Add(1)
	p.shards[i].q.push(s)
}

// shardOf is the shard of key among n (n ≥ 1).
func shardOf(key uint64, n int) int {
	return int(key % uint64(n)) //nolint:gosec // G115: the remainder is below n, an int
}

// shard is one settler's queue of ordered settlements, and how many it has
// queued or is sending (load).
type shard struct {
	q    *burst[settlement]
	load atomic.Int32
}

// errStale is a settler's report of a settlement it did not send because
// its delivery's link was lost meanwhile (without LeasesOutliveLinks).
var errStale = errors.New("pump: settlement not sent: its link was lost")

// errUnsent is a settler's report of a settlement it did not send: Run
// was ending, and its time to send what was decided ran out (FlushBy).
var errUnsent = errors.New("pump: settlement not sent: Run ended first")

// unsent counts a settlement decided but never sent, because Run ended
// first; the broker delivers the message again.
func (p *Pump) unsent(d *driver.Delivery, kind driver.Kind) {
	p.stats.unsent.Add(1)
	p.log.Debug("settlement not sent: the stop's time ran out; the broker redelivers the delivery",
		zap.Stringer("outcome", kind))
	p.notSent(d, kind)
}

// notSent reports a settlement that was skipped.
func (p *Pump) notSent(d *driver.Delivery, kind driver.Kind) {
	if p.cfg.Meter != nil {
		p.cfg.Meter.Settled(kind, driver.ErrNotSent)
	}
	d.Notify(kind, driver.ErrNotSent)
}

// settled counts the broker's answer to a settlement.
func (p *Pump) settled(d *driver.Delivery, kind driver.Kind, err error) {
	if p.cfg.Meter != nil {
		p.cfg.Meter.Settled(kind, err)
	}
	d.Notify(kind, err)
	if err == nil {
		p.stats.settled[kind].Add(1)
		return
	}
	// Each is logged at debug: they happen once per delivery. They are
	// counted (Stats), and OnEvent hears of each (SettleFailed).
	switch {
	case p.cfg.Leases != nil && p.cfg.Leases.LostAnswer(err):
		p.log.Debug("settlement answered with lock-lost; the broker redelivers the delivery",
			zap.Stringer("outcome", kind), zap.Error(err))
		p.stats.lockLostAnswers.Add(1)
	case errors.Is(err, context.DeadlineExceeded):
		p.log.Debug("settlement not answered in time; the broker redelivers the delivery once its lock expires",
			zap.Stringer("outcome", kind), zap.Duration("timeout", p.settleTimeout()))
		p.stats.settleTimeouts.Add(1)
	default:
		p.log.Debug("settlement failed; the broker redelivers the delivery",
			zap.Stringer("outcome", kind), zap.Error(err))
		p.stats.settleErrors.Add(1)
	}
	p.event(Event{Kind: SettleFailed, Message: d.Message(), Outcome: kind, Err: err})
}

func (p *Pump) settleTimeout() time.Duration {
	if p.cfg.SettleTimeout > 0 {
		return p.cfg.SettleTimeout
	}
	return 30 * time.Second
}

// settler sends, in order, the settlements queued on its shard, and the
// unordered ones it takes from the shared queue, each within the settle
// timeout, and reports each back to the pump. Once quit is closed it sends
// what is still queued and returns; a settlement it takes once ctx has
// ended is reported unsent, not sent.
func (p *Pump) settler(ctx context.Context, sh *shard, quit <-chan struct{}) {
	for {
		select {
		case <-sh.q.wake:
			p.sendAll(ctx, sh)
		case s := <-p.anyq:
			p.send(ctx, s)
		case <-quit:
			// Nothing more is queued after quit (Run's goroutine, the only
			// one that queues, has stopped): send the rest.
			for more := true; more; {
				select {
				case s := <-p.anyq:
					p.send(ctx, s)
				default:
					more = false
				}
			}
			p.sendAll(ctx, sh)
			return
		}
	}
}

// sendAll sends everything queued on sh, in order.
func (p *Pump) sendAll(ctx context.Context, sh *shard) {
	items, _ := sh.q.take()
	for _, s := range items {
		p.send(ctx, s)
		sh.load.Add(-1)
	}
	sh.q.recycle(items)
}

// send sends one settlement and reports it back to the pump.
func (p *Pump) send(ctx context.Context, s settlement) {
	var err error
	switch {
	case ctx.Err() != nil:
		err = errUnsent
	case p.links.Stale(s.t.Entry().Link()):
		err = errStale // it could only fail on its lost link
	default:
		d := s.t.Entry()
		sctx, cancel := context.WithTimeout(d.Sending(ctx), p.settleTimeout())
		s.o.Kind, err = settleOn(sctx, d.Source(), d.Message(), s.o)
		cancel()
		switch {
		case err != nil && ctx.Err() != nil:
			err = errUnsent // cut off by the end of Run, not answered
		case err != nil && errors.Is(err, context.DeadlineExceeded):
			err = fmt.Errorf("pump: settlement not answered within %v: %w", p.settleTimeout(), context.DeadlineExceeded)
		}
	}
	s.done, s.err = true, err
	p.settle.push(s)
}

// settleOn sends o for msg on src and returns the outcome that went out
// (o's, unless src says otherwise with SentAs) and the broker's answer.
func settleOn(ctx context.Context, src driver.Source, msg *amqp.Message, o driver.Outcome) (driver.Kind, error) {
	return driver.SentOutcome(o.Kind, sendOutcome(ctx, src, msg, o))
}

func sendOutcome(ctx context.Context, src driver.Source, msg *amqp.Message, o driver.Outcome) error {
	switch o.Kind {
	case driver.Accept:
		return src.AcceptMessage(ctx, msg)
	case driver.Release:
		return src.ReleaseMessage(ctx, msg)
	case driver.Modify:
		return src.ModifyMessage(ctx, msg, &amqp.ModifyMessageOptions{
			DeliveryFailed:    o.DeliveryFailed,
			UndeliverableHere: o.UndeliverableHere,
			Annotations:       o.Annotations,
		})
	case driver.Reject:
		return src.RejectMessage(ctx, msg, o.Error)
	}
	return fmt.Errorf("pump: unknown outcome %d", o.Kind)
}

// dropUnheld counts a message of a lost link the pump never entered in
// its book, and lets it go: received, and dropped.
func (p *Pump) dropUnheld() {
	p.stats.received.Add(1)
	p.stats.settled[driver.Drop].Add(1)
	if p.cfg.Meter != nil {
		p.cfg.Meter.Received()
		p.cfg.Meter.Dropped(1)
	}
}

// releaseUnheld gives back a message the pump never entered in its book.
func (p *Pump) releaseUnheld(ctx context.Context, src driver.Source, msg *amqp.Message) {
	// Received, never held: counted as received and released all the same,
	// so that the counters add up to what the broker saw.
	p.stats.received.Add(1)
	k, err := driver.SentOutcome(driver.Release, src.ReleaseMessage(ctx, msg))
	if p.cfg.Meter != nil {
		p.cfg.Meter.Received()
		p.cfg.Meter.Settled(k, err)
	}
	if err != nil {
		p.log.Debug("release at link end failed; the broker redelivers the delivery", zap.Error(err))
		p.stats.settleErrors.Add(1)
		return
	}
	p.stats.settled[k].Add(1)
}

// dropBacklog frees the entries of deliveries still waiting in the pump
// after their link was lost or while stopping without a link.
func (p *Pump) dropBacklog() {
	for _, t := range p.backlog {
		p.Settle(t, driver.Outcome{Kind: driver.Drop})
	}
	clear(p.backlog)
	p.backlog = p.backlog[:0]
	p.applyQueued(context.Background())
}
