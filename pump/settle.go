package pump

import (
	"context"
	"fmt"

	"github.com/Azure/go-amqp"
	"go.uber.org/zap"
)

// Kind is what a settlement tells the broker.
type Kind uint8

const (
	// Accept settles the delivery as accepted.
	Accept Kind = iota
	// Release returns the delivery to the queue, not counted as a failure.
	Release
	// Modify returns the delivery to the queue as modified (see Outcome).
	Modify
	// Reject settles the delivery as rejected: dead-lettered by most brokers.
	Reject
	// Drop frees the delivery's place without telling the broker, for
	// deliveries of a lost link, which the broker redelivers anyway.
	Drop

	// reclaim frees the entry of a Dropped delivery, which no longer counts
	// as held.
	reclaim
)

var kindNames = [...]string{"accept", "release", "modify", "reject", "drop", "reclaim"}

func (k Kind) String() string {
	if int(k) < len(kindNames) {
		return kindNames[k]
	}
	return fmt.Sprintf("Kind(%d)", k)
}

// Outcome is a settlement.
type Outcome struct {
	Kind Kind
	// Error is sent with Reject; nil sends none.
	Error *amqp.Error
	// DeliveryFailed and UndeliverableHere go with Modify.
	DeliveryFailed    bool
	UndeliverableHere bool
}

type settlement struct {
	d *Delivery
	o Outcome
}

// Settle hands the pump a delivery's settlement and reports true; it
// reports false, and does nothing, when the delivery was already settled: a
// delivery settles once. It never blocks and does not wait for the broker:
// the pump applies queued settlements in a burst whenever it wakes, also
// while a delivery waits for room in Out. A dropped delivery (see State) is
// only freed, whatever the outcome. Settlements that arrive after Run has
// returned are not applied; the broker redelivers those deliveries once the
// link is closed.
func (p *Pump) Settle(t Ticket, o Outcome) bool {
	for {
		switch s := t.State(); s {
		case Buffered, Handling:
			if t.d.cas(t.gen, s, Settling) {
				p.settle.push(settlement{t.d, o})
				return true
			}
		case Dropped:
			if t.d.cas(t.gen, s, Settling) {
				p.settle.push(settlement{t.d, Outcome{Kind: reclaim}})
				return true
			}
		default:
			p.stats.doubleSettle.Add(1)
			return false
		}
	}
}

// applyQueued applies every queued settlement.
func (p *Pump) applyQueued(ctx context.Context) {
	batch, _ := p.settle.take()
	for _, s := range batch {
		p.apply(ctx, s)
	}
	p.settle.recycle(batch)
}

// apply sends a settlement to the broker and frees the delivery's entry.
func (p *Pump) apply(ctx context.Context, s settlement) {
	d := s.d
	switch {
	case s.o.Kind == reclaim:
		p.release(d)
		return
	case s.o.Kind == Drop:
		p.stats.settled[Drop].Add(1)
	case d.link != p.link.Load():
		p.log.Debug("settlement of a delivery from a lost link skipped; the broker redelivers it",
			zap.Stringer("outcome", s.o.Kind))
		p.stats.stale.Add(1)
	default:
		if err := settleOn(ctx, d.src, d.msg.Load(), s.o); err != nil {
			p.log.Debug("settlement failed; the broker redelivers the delivery",
				zap.Stringer("outcome", s.o.Kind), zap.Error(err))
			p.stats.settleErrors.Add(1)
			p.event(Event{Kind: SettleFailed, Message: d.msg.Load(), Outcome: s.o.Kind, Err: err})
		} else {
			p.stats.settled[s.o.Kind].Add(1)
		}
	}
	p.release(d)
	p.acct.Settled(1)
	p.noteHeld()
}

func settleOn(ctx context.Context, src Source, msg *amqp.Message, o Outcome) error {
	switch o.Kind {
	case Accept:
		return src.AcceptMessage(ctx, msg)
	case Release:
		return src.ReleaseMessage(ctx, msg)
	case Modify:
		return src.ModifyMessage(ctx, msg, &amqp.ModifyMessageOptions{
			DeliveryFailed:    o.DeliveryFailed,
			UndeliverableHere: o.UndeliverableHere,
		})
	case Reject:
		return src.RejectMessage(ctx, msg, o.Error)
	}
	return fmt.Errorf("pump: unknown outcome %d", o.Kind)
}

// releaseUnheld gives back a message the pump never entered in its book.
func (p *Pump) releaseUnheld(ctx context.Context, src Source, msg *amqp.Message) {
	if err := src.ReleaseMessage(ctx, msg); err != nil {
		p.log.Debug("release at link end failed; the broker redelivers the delivery", zap.Error(err))
	}
}

// dropBacklog frees the entries of deliveries still waiting in the pump
// after their link was lost or while stopping without a link.
func (p *Pump) dropBacklog() {
	for _, t := range p.backlog {
		p.Settle(t, Outcome{Kind: Drop})
	}
	clear(p.backlog)
	p.backlog = p.backlog[:0]
	p.applyQueued(context.Background())
}
