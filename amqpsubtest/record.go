package amqpsubtest

import (
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/Azure/go-amqp"

	"github.com/amqpsub/amqpsub/amqpsub"
)

// State says where a message is.
type State uint8

const (
	// Queued means waiting in the queue, for its first delivery or for another
	// one.
	Queued State = iota
	// InFlight means delivered on a link and not settled yet.
	InFlight
	// Consumed means accepted. Final.
	Consumed
	// DeadLettered means rejected, or failed [MaxDeliveryAttempts] times
	// (under AzureServiceBus, abandoned or its lock expired). Under
	// RabbitMQ4 also settled modified{undeliverable-here}, or, on a quorum
	// queue, returned past its [DeliveryLimit]. Final.
	DeadLettered
)

var stateNames = [...]string{"queued", "in flight", "consumed", "dead-lettered"}

func (s State) String() string {
	if int(s) < len(stateNames) {
		return stateNames[s]
	}
	return "State(" + strconv.Itoa(int(s)) + ")"
}

// Outcome is how a delivery was settled, as the broker saw it.
type Outcome uint8

const (
	// Pending means not settled yet.
	Pending Outcome = iota
	// Accepted means accepted (a handler's nil).
	Accepted
	// Released means released (Release(), a stop, and Retry under RabbitMQ3):
	// queued again, not counted (but a RabbitMQ 4 quorum queue counts it
	// toward its [DeliveryLimit]).
	Released
	// Modified means modified without delivery-failed: queued again, not
	// counted; amqpsub does not send it to Artemis. With undeliverable-here
	// (for [Failed] too), the message is not delivered on that link again;
	// under RabbitMQ4 it is dead-lettered instead. Under AzureServiceBus it
	// is an abandon (Retry): counted, as Failed is elsewhere. A RabbitMQ 4
	// quorum queue counts it toward its [DeliveryLimit].
	Modified
	// Failed means modified{delivery-failed} (Retry on Artemis): a failed
	// attempt, counted.
	Failed
	// Rejected means rejected (Reject, RejectWith, MaxDeliveryCount):
	// dead-lettered.
	Rejected
	// Unsettled means the link ended before the delivery was settled (a lost
	// link, Close, a grace period run out): queued again, not counted (a
	// RabbitMQ 4 quorum queue counts it toward its [DeliveryLimit]).
	Unsettled
	// LockExpired means the delivery's Service Bus lock expired before it
	// was settled (AzureServiceBus): the handler took longer than the lock
	// and its renewals (amqpsub's MaxLockRenewal), or nobody renewed it.
	// Queued again, counted, or dead-lettered at [MaxDeliveryAttempts]. A
	// settlement that came later was refused: see [Delivery.Late].
	LockExpired
)

var outcomeNames = [...]string{"pending", "accepted", "released", "modified", "modified{delivery-failed}", "rejected", "unsettled", "lock expired"}

func (o Outcome) String() string {
	if int(o) < len(outcomeNames) {
		return outcomeNames[o]
	}
	return "Outcome(" + strconv.Itoa(int(o)) + ")"
}

// Delivery is one delivery of a message.
type Delivery struct {
	// Count is the header delivery-count it carried.
	Count uint32
	// Link is the link it went out on, from 1 in the order of attaches.
	Link int
	// Outcome is how it was settled.
	Outcome Outcome
	// Error is the error a [Rejected] outcome carried; nil otherwise.
	Error *amqp.Error
	// UndeliverableHere and Annotations are what a [Modified] or [Failed]
	// outcome carried besides delivery-failed: undeliverable-here, and
	// the message-annotations, as sent (what the broker keeps of them is
	// in [Record.Annotations]).
	UndeliverableHere bool
	Annotations       amqp.Annotations

	// The rest is for the AzureServiceBus profile only: zero elsewhere.

	// LockedUntil is when its lock expires (expired, when Outcome is
	// [LockExpired]): the x-opt-locked-until it was delivered with, or the
	// expiry the last renewal gave.
	LockedUntil time.Time
	// Renewals counts the renewals of its lock the queue granted.
	Renewals int
	// Late is the outcome of a settlement that came after its lock had
	// expired, which the queue refused with com.microsoft:message-lock-lost
	// and did not apply; [Pending] when none came. amqpsub sends none once
	// it knows the lock is lost.
	Late Outcome
}

// String returns the count and the outcome, such as `1 accepted`,
// `0 rejected "malformed"`, `0 modified{delivery-failed, undeliverable-here}
// "malformed"` (a Reject on a RabbitMQ 4 quorum queue, its reason in the
// annotations) or `0 lock expired (late accepted)`.
func (d Delivery) String() string {
	o := d.Outcome.String()
	if d.UndeliverableHere {
		o = strings.TrimSuffix(o, "}")
		if o == "modified" {
			o += "{undeliverable-here}"
		} else {
			o += ", undeliverable-here}"
		}
	}
	s := strconv.FormatUint(uint64(d.Count), 10) + " " + o
	if d.Error != nil {
		s += " " + strconv.Quote(d.Error.Description)
	}
	if r := annotation(d.Annotations, amqpsub.AnnotationDeadLetterReason); r != "" {
		s += " " + strconv.Quote(r)
	}
	if d.Late != Pending {
		s += " (late " + d.Late.String() + ")"
	}
	return s
}

// Record is what the queue knows of one message: a snapshot, which the
// queue does not change afterwards.
type Record struct {
	// Index is the message's place in publish order, from 0:
	// Queue.Records()[Index].
	Index int
	// Message is the message as published.
	Message *amqp.Message
	// State is where the message is.
	State State
	// Deliveries are its deliveries, in order.
	Deliveries []Delivery
	// Annotations are the message annotations the broker added to the
	// message: under RabbitMQ4, on a quorum queue, those of the modified
	// outcomes it was settled with (such as amqpsub.AnnotationDeadLetterReason
	// of a Reject), which its later deliveries and its dead letter carry.
	// nil elsewhere: Artemis and a classic queue drop them.
	Annotations amqp.Annotations

	// dead is the error the broker itself dead-lettered the message with
	// (Service Bus: MaxDeliveryCountExceeded; a RabbitMQ 4 quorum queue:
	// delivery_limit); nil otherwise.
	dead *amqp.Error
	// noError: the broker kept nothing of the rejected outcome's error
	// (RabbitMQ 4).
	noError bool
}

// GroupID returns the message's AMQP group-id, "" when it has none.
func (r Record) GroupID() string {
	if p := r.Message.Properties; p != nil && p.GroupID != nil {
		return *p.GroupID
	}
	return ""
}

// Reason returns the description of the error the message's last delivery
// was rejected with: the reason given to amqpsub's Reject or RejectWith.
// Under AzureServiceBus, a message the service dead-lettered itself, for
// its delivery count, has the service's DeadLetterReason,
// MaxDeliveryCountExceeded. Under RabbitMQ4 it is what the dead letter
// keeps: on a quorum queue the reason of amqpsub's Reject (annotation
// amqpsub.AnnotationDeadLetterReason), or delivery_limit for a message
// the queue dead-lettered past its [DeliveryLimit]; on a classic queue,
// which keeps no reason, "". It is "" otherwise.
func (r Record) Reason() string {
	if e := r.rejectError(); e != nil {
		return e.Description
	}
	if r.State == DeadLettered {
		return annotation(r.Annotations, amqpsub.AnnotationDeadLetterReason)
	}
	return ""
}

// Description returns the description given to amqpsub's RejectWith (info
// DeadLetterErrorDescription of the rejected outcome's error), or the one
// Service Bus gives a message it dead-lettered itself; "" when there is
// none.
func (r Record) Description() string {
	if e := r.rejectError(); e != nil {
		s, _ := e.Info["DeadLetterErrorDescription"].(string)
		return s
	}
	if r.State == DeadLettered {
		return annotation(r.Annotations, amqpsub.AnnotationDeadLetterDescription)
	}
	return ""
}

func (r Record) rejectError() *amqp.Error {
	if n := len(r.Deliveries); n > 0 && r.Deliveries[n-1].Outcome == Rejected && !r.noError {
		return r.Deliveries[n-1].Error
	}
	return r.dead
}

// String returns the message's index, group, deliveries and state on one
// line, such as `#2 group a: 0 modified{delivery-failed}, 1 accepted →
// consumed`; a message Service Bus dead-lettered itself ends with the
// reason, such as `→ dead-lettered (MaxDeliveryCountExceeded)`.
func (r Record) String() string {
	var b strings.Builder
	fmt.Fprintf(&b, "#%d", r.Index)
	if g := r.GroupID(); g != "" {
		fmt.Fprintf(&b, " group %s", g)
	}
	b.WriteString(":")
	for i, d := range r.Deliveries {
		if i > 0 {
			b.WriteString(",")
		}
		b.WriteString(" " + d.String())
	}
	if len(r.Deliveries) > 0 {
		b.WriteString(" →")
	}
	b.WriteString(" " + r.State.String())
	if r.dead != nil {
		b.WriteString(" (" + r.dead.Description + ")")
	}
	return b.String()
}

// GroupOrder checks that items keep their order within each group: for
// each group, the sequence numbers key gives its items must not fall along
// items. Gaps are allowed, and so is a repeat (a retry in place); a step
// back (a redelivery after a later item) is not. Items of group "" are not
// checked. It returns nil, or an error naming the first item out of order. Give it what a handler
// recorded, or [Queue.Accepted] with the message's place in publish order:
//
//	amqpsubtest.GroupOrder(q.Accepted(), func(r amqpsubtest.Record) (string, int) { return r.GroupID(), r.Index })
func GroupOrder[T any](items []T, key func(T) (group string, seq int)) error {
	last := map[string]int{}
	for i, it := range items {
		g, seq := key(it)
		if g == "" {
			continue
		}
		if prev, ok := last[g]; ok && seq < prev {
			return fmt.Errorf("amqpsubtest: group %q out of order at item %d: %d after %d", g, i, seq, prev)
		}
		last[g] = seq
	}
	return nil
}

// record is the queue's own, changing, Record.
type record struct {
	index      int
	msg        *amqp.Message
	state      State
	count      uint32 // the delivery count the next delivery carries
	deliveries []Delivery
	dead       *amqp.Error // the broker's own dead-lettering (Record.dead)
	noError    bool        // Record.noError

	// RabbitMQ 4 quorum queue only.
	returns uint32           // returns counted toward the delivery limit
	ann     amqp.Annotations // Record.Annotations

	// Service Bus (peek-lock) only.
	seq      int64     // x-opt-sequence-number
	enqueued time.Time // x-opt-enqueued-time
	lock     *lock     // its lock while in flight; nil otherwise
}

func (r *record) snapshot() Record {
	return Record{Index: r.index, Message: r.msg, State: r.state, Deliveries: slices.Clone(r.deliveries),
		Annotations: maps.Clone(r.ann), dead: r.dead, noError: r.noError}
}

func (r *record) last() *Delivery { return &r.deliveries[len(r.deliveries)-1] }

func (r *record) groupID() string {
	if p := r.msg.Properties; p != nil && p.GroupID != nil {
		return *p.GroupID
	}
	return ""
}

func (r *record) groupSequence() (uint32, bool) {
	if p := r.msg.Properties; p != nil && p.GroupSequence != nil {
		return *p.GroupSequence, true
	}
	return 0, false
}
