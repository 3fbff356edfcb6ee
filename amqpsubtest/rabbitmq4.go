package amqpsubtest

import (
	"cmp"
	"fmt"
	"maps"
	"slices"
	"strings"

	"github.com/Azure/go-amqp"
)

// RabbitMQ 4, as the queue plays it under WithProfile(amqpsub.RabbitMQ4):
// a quorum queue (the default) or a classic one. See the package
// documentation.

// QueueType is the type of a RabbitMQ 4 queue: [Quorum] or [Classic].
type QueueType uint8

const (
	// Quorum is a quorum queue, RabbitMQ 4's recommended type: every
	// return of a message counts toward its [DeliveryLimit].
	Quorum QueueType = iota
	// Classic is a classic queue: it counts nothing and has no delivery
	// limit.
	Classic
)

// String returns the type as RabbitMQ's management node names it: "quorum"
// or "classic".
func (t QueueType) String() string {
	switch t {
	case Quorum:
		return "quorum"
	case Classic:
		return "classic"
	}
	return fmt.Sprintf("QueueType(%d)", uint8(t))
}

// WithQueueType sets the type of the RabbitMQ 4 queue the queue plays:
// [Quorum] or [Classic]. A subscriber with the RabbitMQ4 profile learns it
// at each attach, as it reads it from a broker's management node, and acts
// on it as there: MaxDeliveryCount on a classic queue makes Run fail with
// amqpsub.ErrInvalidOption; a graceful stop on a quorum queue finishes what
// is buffered before it releases the rest; a Reject on a quorum queue
// carries its reason in annotations the dead letter keeps.
//
// It needs WithProfile([amqpsub.RabbitMQ4]): [NewQueue] panics without it,
// and on a type that is neither. Default: Quorum.
func WithQueueType(t QueueType) Option {
	return optionFunc(func(q *Queue) {
		if t != Quorum && t != Classic {
			panic(fmt.Sprintf("amqpsubtest: WithQueueType(%v): not Quorum or Classic", t))
		}
		q.queueType, q.queueTypeSet = t, true
	})
}

// DeliveryLimit sets the delivery limit of a quorum queue (its
// x-delivery-limit argument): how many times a message may come back to
// the queue. Every return counts: a release (amqpsub's Release, and what
// a stop gives back), a modified outcome with or without delivery-failed
// (amqpsub's Retry), and a delivery left unsettled by a link that ended.
// The return that takes the count past n dead-letters the message, with
// reason delivery_limit ([Record.Reason]): a message is delivered at most
// n+1 times. n < 0 is no limit, as RabbitMQ takes a negative
// x-delivery-limit. The count starts at 0, whatever the published header's
// delivery-count says.
//
// It needs WithProfile([amqpsub.RabbitMQ4]) on a [Quorum] queue: [NewQueue]
// panics otherwise (a classic queue has no delivery limit). Default: 20,
// RabbitMQ 4's default.
func DeliveryLimit(n int) Option {
	return optionFunc(func(q *Queue) { q.deliveryLimit, q.deliveryLimitSet = n, true })
}

// checkRabbitMQ4 applies and checks the RabbitMQ 4 options once every
// option is applied. It panics on one that does not fit the profile.
func (q *Queue) checkRabbitMQ4() {
	if !q.rules.rabbit4 {
		switch {
		case q.queueTypeSet:
			panic("amqpsubtest: WithQueueType needs WithProfile(amqpsub.RabbitMQ4): other brokers have no queue types")
		case q.deliveryLimitSet:
			panic("amqpsubtest: DeliveryLimit needs WithProfile(amqpsub.RabbitMQ4); elsewhere MaxDeliveryAttempts is the broker's limit")
		}
		return
	}
	if q.maxAttemptsSet {
		panic("amqpsubtest: MaxDeliveryAttempts under RabbitMQ4: a quorum queue's limit is DeliveryLimit, which counts every return; a classic queue has none")
	}
	if q.queueType == Classic {
		if q.deliveryLimitSet {
			panic("amqpsubtest: DeliveryLimit on a classic queue: RabbitMQ counts nothing there, and has no delivery limit")
		}
		q.rules = classicRules
	}
}

// rabbit4Link is a link of a queue that plays RabbitMQ 4: besides a link's
// calls it says the queue's type, in place of the management node a
// subscriber asks at each attach (amqpsub reads it: see
// internal/testhook).
type rabbit4Link struct{ *link }

// RabbitMQQueue returns the queue's type, "quorum" or "classic", and its
// x-delivery-limit argument: DeliveryLimit's n when it was given, 0 (no
// argument, the default of 20 applies) otherwise.
func (l rabbit4Link) RabbitMQQueue() (typ string, deliveryLimit int64) {
	q := l.q
	if q.deliveryLimitSet {
		deliveryLimit = int64(q.deliveryLimit)
	}
	return q.queueType.String(), deliveryLimit
}

// deliveryLimitReason is the reason a quorum queue dead-letters a message
// past its delivery limit with (x-first-death-reason).
const deliveryLimitReason = "delivery_limit"

// giveBack takes r back into a quorum queue: a return, counted toward the
// delivery limit; failed (modified{delivery-failed}, or a session that
// ended with r unsettled) raises the header's delivery-count too. Past the
// limit r is dead-lettered; otherwise it goes after the returns waiting,
// ahead of the messages never delivered. q.mu is held.
func (q *Queue) giveBack(r *record, failed bool) {
	r.returns++
	if failed {
		r.count++
	}
	if q.deliveryLimit >= 0 && int64(r.returns) > int64(q.deliveryLimit) {
		r.dead = &amqp.Error{Description: deliveryLimitReason}
		q.deadLetter(r)
		return
	}
	r.state = Queued
	q.queued = slices.Insert(q.queued, q.returned, r)
	q.returned++
}

// endQuorum gives back what an ended link of a quorum queue left
// unsettled, in publish order, as RabbitMQ returns a removed consumer's
// messages: each a return, counted; session says that the link's session
// or connection ended (rather than the link detached), which raises the
// header's delivery-count too, as RabbitMQ does for a consumer whose
// process went down. q.mu is held.
func (q *Queue) endQuorum(l *link, session bool) {
	rs := slices.Collect(maps.Values(l.unsettled))
	slices.SortFunc(rs, func(a, b *record) int { return cmp.Compare(a.index, b.index) })
	for _, r := range rs {
		r.last().Outcome = Unsettled
		q.giveBack(r, session)
	}
	clear(l.unsettled)
}

// notXKey returns the first message-annotation key of a modified outcome
// that RabbitMQ 4 does not take: one that is not a symbol starting with
// "x-" (the others are reserved by the AMQP specification, 3.2.10).
func notXKey(ann amqp.Annotations) (any, bool) {
	for k := range ann {
		var s string
		switch k := k.(type) {
		case string:
			s = k
		case amqp.Symbol:
			s = string(k)
		default:
			return k, true
		}
		if !strings.HasPrefix(s, "x-") {
			return k, true
		}
	}
	return nil, false
}

// sessionEnded is how RabbitMQ 4 ends a session whose modified outcome
// carries annotation key k, not an x- one.
func sessionEnded(k any) *amqp.SessionError {
	return &amqp.SessionError{RemoteErr: &amqp.Error{Condition: amqp.ErrCondInternalError,
		Description: fmt.Sprintf("amqpsubtest: RabbitMQ 4 ends the session on a modified outcome with message-annotation key %#v, which does not start with x- (function_clause)", k)}}
}

// annotation returns ann's string annotation key, whether the key is a Go
// string (as amqpsub sends it, and go-amqp decodes it) or an amqp.Symbol;
// "" when it has none.
func annotation(ann amqp.Annotations, key string) string {
	if s, ok := ann[key].(string); ok {
		return s
	}
	s, _ := ann[amqp.Symbol(key)].(string)
	return s
}
