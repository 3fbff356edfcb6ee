package driver

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"

	"github.com/Azure/go-amqp"
)

// Kind is what a settlement tells the broker.
type Kind uint8

const (
	// Accept settles the delivery as accepted.
	Accept Kind = iota
	// Release returns the delivery to the queue as released, not as a
	// failed attempt; a broker may still count it toward a delivery limit.
	Release
	// Modify returns the delivery to the queue as modified (see [Outcome]).
	Modify
	// Reject settles the delivery as rejected: dead-lettered by most brokers.
	Reject
	// Drop frees the delivery's place without telling the broker, for
	// deliveries of a lost link, which the broker redelivers anyway.
	Drop
)

var kindNames = [...]string{"accept", "release", "modify", "reject", "drop"}

func (k Kind) String() string {
	if int(k) < len(kindNames) {
		return kindNames[k]
	}
	return fmt.Sprintf("Kind(%d)", k)
}

// Outcome is a settlement.
type Outcome struct {
	Kind Kind
	// Error is sent with [Reject]; nil sends none.
	Error *amqp.Error
	// DeliveryFailed, UndeliverableHere and Annotations go with [Modify];
	// the broker merges Annotations into the message's annotations (nil:
	// none).
	DeliveryFailed    bool
	UndeliverableHere bool
	Annotations       amqp.Annotations
}

// ErrNotSent is what the engine's meter and a [Ticket]'s OnSettled
// function hear of a settlement that was not sent: the delivery's link was
// lost, or its lease ([Delivery.LeaseLost]), while a handler
// had it, or the engine stopped before it could be sent. The broker
// delivers it again.
var ErrNotSent = errors.New("driver: settlement not sent: the delivery's link or lease was lost; the broker delivers it again")

// SentAs returns what a [Source]'s settlement call returns when it sent
// the broker outcome k in place of the one asked for, err being the
// broker's answer (nil: taken). The engine then counts the settlement, and
// reports it to its meter and the delivery's OnSettled function, as k.
// Only Accept, Release, Modify and Reject are outcomes; another k is
// ignored.
func SentAs(k Kind, err error) error { return &sentAs{kind: k, err: err} }

type sentAs struct {
	kind Kind
	err  error
}

func (e *sentAs) Error() string {
	if e.err == nil {
		return "driver: settled as " + e.kind.String()
	}
	return "driver: settling as " + e.kind.String() + ": " + e.err.Error()
}

func (e *sentAs) Unwrap() error { return e.err }

// SentOutcome reads a [Source]'s answer to a settlement of kind k: the
// outcome that went out (k, unless the answer is one of [SentAs]) and the
// broker's answer. For the engine.
func SentOutcome(k Kind, err error) (Kind, error) {
	var sa *sentAs
	if err != nil && errors.As(err, &sa) {
		if sa.kind <= Reject {
			k = sa.kind
		}
		return k, sa.err
	}
	return k, err
}

type restingKey struct{}

// Resting tells the engine that the settlement a [Source] is sending in
// ctx (the context of its Accept, Release, Reject or Modify call) is not
// out until resume is called: its first answer said to try again later,
// and the Source waits before sending it again. Meanwhile the delivery's
// [Ticket.Sending] is false, so that its [Leases] renew its lease while
// it waits. Outside a settlement the engine's settlers send, it does
// nothing. resume must be called before the Source sends again, and once.
func Resting(ctx context.Context) (resume func()) {
	sending, ok := ctx.Value(restingKey{}).(*atomic.Bool)
	if !ok {
		return func() {}
	}
	sending.Store(false)
	return func() { sending.Store(true) }
}
