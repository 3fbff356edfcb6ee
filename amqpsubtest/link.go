package amqpsubtest

import (
	"context"
	"errors"
	"maps"
	"math"
	"time"

	"github.com/Azure/go-amqp"

	"github.com/amqpsub/amqpsub/internal/driver"

	"github.com/amqpsub/amqpsub/internal/pump"
)

// link is one attach of a subscriber to a Queue: the driver.Source it
// receives from. Its state is guarded by the queue's mutex.
type link struct {
	q         *Queue
	id        int
	credit    uint64
	wake      chan struct{}
	unsettled map[*amqp.Message]*record // delivered copy → its message
	refused   map[*record]bool          // modified{undeliverable-here} on this link
	expired   map[*amqp.Message]late    // delivered, lock expired, not settled (Service Bus)
	err       error                     // why it ended; nil while attached
}

// errClosed is what a link returns once its subscriber stopped receiving
// from it, as go-amqp does for a closed receiver.
var errClosed = &amqp.LinkError{}

// errUnknown is returned for a settlement of a message the link did not
// deliver, or settled before.
var errUnknown = errors.New("amqpsubtest: settlement of a delivery that is not unsettled on this link")

// errDefer refuses a Service Bus defer, which the queue does not play.
var errDefer = &amqp.Error{Condition: amqp.ErrCondNotImplemented,
	Description: "amqpsubtest: modified{undeliverable-here} is a Service Bus defer, which the queue does not play"}

// Receive returns the next message the queue has for the link, within the
// credit. A subscriber's pump calls it from one goroutine and cancels ctx
// only when it is done with the link (it stopped, or the link failed): so
// ctx ending ends the link, and its unsettled deliveries go back to the
// queue, as when a broker sees a receiver close.
//
// While Service Bus locks are held, a Receive that waits wakes at the next
// expiry, on a timer it makes on its caller's goroutine (a synctest bubble's
// when the subscriber runs in one), so that an expired message comes back
// without anyone settling or renewing.
func (l *link) Receive(ctx context.Context, _ *amqp.ReceiveOptions) (*amqp.Message, error) {
	q := l.q
	for {
		q.mu.Lock()
		q.expireLocks()
		if l.err != nil {
			err := l.err
			q.mu.Unlock()
			return nil, err
		}
		if ctx.Err() == nil && l.credit > 0 {
			if r := q.next(l); r != nil {
				m := l.deliver(r)
				q.mu.Unlock()
				return m, nil
			}
		}
		next := q.nextExpiry()
		q.mu.Unlock()
		var timer *time.Timer
		var expiry <-chan time.Time
		if !next.IsZero() {
			timer = time.NewTimer(time.Until(next))
			expiry = timer.C
		}
		select {
		case <-l.wake:
		case <-expiry:
		case <-ctx.Done():
			if errors.Is(context.Cause(ctx), pump.ErrDrainAnswered) {
				return nil, ctx.Err()
			}
			q.mu.Lock()
			q.end(l, errClosed)
			q.mu.Unlock()
			return nil, ctx.Err()
		}
		if timer != nil {
			timer.Stop()
		}
	}
}

// deliver sends r on l: a copy of the message with the header the broker
// sends. q.mu is held.
func (l *link) deliver(r *record) *amqp.Message {
	q := l.q
	l.credit--
	h := amqp.MessageHeader{}
	if r.msg.Header != nil {
		h = *r.msg.Header
	}
	h.DeliveryCount = 0
	if q.rules.counts {
		h.DeliveryCount = r.count
	}
	if q.rules.firstAcquirer {
		h.FirstAcquirer = len(r.deliveries) == 0
	}
	m := *r.msg
	m.Header = &h
	if len(r.ann) > 0 {
		// A quorum queue's message keeps the annotations it was modified with.
		ann := maps.Clone(r.msg.Annotations)
		if ann == nil {
			ann = amqp.Annotations{}
		}
		maps.Copy(ann, r.ann)
		m.Annotations = ann
	}
	r.state = InFlight
	r.deliveries = append(r.deliveries, Delivery{Count: h.DeliveryCount, Link: l.id})
	l.unsettled[&m] = r
	if q.rules.peekLock {
		q.lockFor(l, r, &m)
	}
	if g := r.groupID(); q.rules.groups && g != "" {
		q.owners[g] = l
		if seq, ok := r.groupSequence(); ok && seq == math.MaxUint32 {
			// Group-sequence -1 closes the group when it is dispatched.
			delete(q.owners, g)
		}
	}
	return &m
}

// errDraining is the error of go-amqp's creditor.IssueCredit
// (creditor.go) while a DrainCredit is pending on the link, word for word.
var errDraining = errors.New("link is currently draining, no credits can be added")

// IssueCredit adds n to the link's credit, as go-amqp's
// Receiver.IssueCredit does (receiver.go), which hands it to
// creditor.IssueCredit (creditor.go): besides on a receiver with
// automatic credit, which a pump never has, that fails only while a drain
// is pending (errDraining, see [Queue.FailIssueCredit]), and neither looks
// at the link itself. Once the link is lost it returns nil and no credit
// flows: the receiver's mux has ended, and its deferred creditor.EndDrain
// cleared any pending drain. The loss shows at the next Receive.
func (l *link) IssueCredit(n uint32) error {
	q := l.q
	q.mu.Lock()
	defer q.mu.Unlock()
	if l.err != nil {
		return nil
	}
	if q.failCredit > 0 {
		q.failCredit--
		return errDraining
	}
	l.credit += uint64(n)
	select {
	case l.wake <- struct{}{}:
	default:
	}
	return nil
}

func (l *link) AcceptMessage(_ context.Context, m *amqp.Message) error {
	return l.settle(m, Accepted, nil, nil)
}

func (l *link) ReleaseMessage(_ context.Context, m *amqp.Message) error {
	return l.settle(m, Released, nil, nil)
}

func (l *link) RejectMessage(_ context.Context, m *amqp.Message, e *amqp.Error) error {
	return l.settle(m, Rejected, e, nil)
}

func (l *link) ModifyMessage(_ context.Context, m *amqp.Message, o *amqp.ModifyMessageOptions) error {
	if o == nil {
		o = &amqp.ModifyMessageOptions{}
	}
	mo := &modified{notHere: o.UndeliverableHere, ann: o.Annotations}
	if o.DeliveryFailed {
		return l.settle(m, Failed, nil, mo)
	}
	return l.settle(m, Modified, nil, mo)
}

// modified is what a modified outcome says besides delivery-failed.
type modified struct {
	notHere bool             // undeliverable-here
	ann     amqp.Annotations // message-annotations
}

// Close ends the link as a broker sees its receiver detach: what it has
// not settled goes back, as when Receive's ctx ends. amqpsub closes a
// source its kind refused at attach.
func (l *link) Close(context.Context) error {
	q := l.q
	q.mu.Lock()
	defer q.mu.Unlock()
	q.end(l, errClosed)
	return nil
}

// settle applies an outcome to the delivery m; mo is a modified outcome's
// (nil for the others). Its undeliverable-here keeps the message from l for
// as long as l is attached, as Artemis does; its annotations are ignored.
//
// Under RabbitMQ 4, modified{undeliverable-here} dead-letters the message;
// an annotation key that does not start with x- ends the session before
// anything is applied; a quorum queue counts every return (released,
// modified), keeps a modified outcome's annotations on the message, and
// dead-letters past the delivery limit (see Queue.giveBack).
//
// Under Service Bus, a settlement after the lock expired is refused with
// com.microsoft:message-lock-lost; every modified outcome is an abandon,
// counted, but for undeliverable-here (a defer), which is refused. Once l
// has ended, its deliveries still locked are settled as the service
// settles them by lock token (com.microsoft:update-disposition): a release
// then goes back as an abandon, counted, and its answer says so
// (driver.SentAs(driver.Modify, …)), as amqpsub's settlement by lock token
// does; those no longer locked are refused as lock-lost.
func (l *link) settle(m *amqp.Message, o Outcome, e *amqp.Error, mo *modified) (err error) {
	notHere := mo != nil && mo.notHere
	q := l.q
	q.mu.Lock()
	defer q.mu.Unlock()
	q.expireLocks()
	if l.err != nil && !q.rules.peekLock {
		return l.err
	}
	r, ok := l.unsettled[m]
	if l.err != nil && o == Released {
		// By lock token, once the link is gone, there is no release: the
		// message goes back as abandoned, counted, and a refusal answers
		// an abandon too.
		defer func() { err = driver.SentAs(driver.Modify, err) }()
		if ok {
			o = Modified
		}
	}
	if !ok {
		if x, expired := l.expired[m]; expired {
			delete(l.expired, m)
			x.r.deliveries[x.i].Late = o
			return lockLostError()
		}
		return errUnknown
	}
	if q.rules.peekLock {
		if notHere {
			return errDefer
		}
		q.unlock(r)
	}
	if mo != nil && q.rules.rabbit4 {
		if k, bad := notXKey(mo.ann); bad {
			err := sessionEnded(k)
			q.end(l, err)
			return err
		}
	}
	delete(l.unsettled, m)
	if notHere && !q.rules.rabbit4 {
		l.refused[r] = true
	}
	d := r.last()
	d.Outcome, d.Error = o, e
	if mo != nil {
		d.UndeliverableHere = mo.notHere
		d.Annotations = maps.Clone(mo.ann)
		if q.rules.quorum && len(mo.ann) > 0 {
			if r.ann == nil {
				r.ann = amqp.Annotations{}
			}
			maps.Copy(r.ann, mo.ann)
		}
	}
	switch {
	case o == Accepted:
		r.state = Consumed
		q.accepted = append(q.accepted, r)
		q.final++
	case o == Rejected:
		r.noError = q.rules.rabbit4
		q.deadLetter(r)
	case notHere && q.rules.rabbit4:
		// Dead-lettered as a rejection is (reason rejected).
		q.deadLetter(r)
	case q.rules.quorum: // Released, Modified, Failed
		q.giveBack(r, o == Failed)
	case o == Failed, o == Modified && q.rules.peekLock:
		// A failed attempt: Artemis counts modified{delivery-failed},
		// Service Bus every abandon.
		q.fail(r)
	default: // Released, Modified
		q.requeue(r)
	}
	if (o == Modified || o == Failed) && q.rules.modifyEndsSession {
		err := &amqp.SessionError{RemoteErr: &amqp.Error{Condition: amqp.ErrCondInvalidField,
			Description: "amqpsubtest: RabbitMQ 3.10 ends the session on a modified outcome"}}
		q.end(l, err)
		return err
	}
	q.changed()
	return nil
}

// DrainCredit takes back the link's credit, at once, as Artemis and
// Service Bus answer a drain: the pump drains at a stop, so that the
// deliveries it releases are not sent back to the same link while credit is
// left.
func (l *link) DrainCredit(context.Context, *amqp.DrainCreditOptions) error {
	q := l.q
	q.mu.Lock()
	defer q.mu.Unlock()
	if l.err != nil {
		return l.err
	}
	l.credit = 0
	return nil
}
