package amqpsubtest

import (
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"sync"
	"time"

	"github.com/Azure/go-amqp"

	"github.com/amqpsub/amqpsub/amqpsub"
	"github.com/amqpsub/amqpsub/internal/driver"
	"github.com/amqpsub/amqpsub/internal/testhook"
)

// Queue is an in-memory queue that plays the broker for Subscribers. Make
// one with [NewQueue], give its Connector to [amqpsub.New] or NewBatch, and
// Publish messages to it. It is safe for concurrent use.
type Queue struct {
	rules           rules
	maxAttempts     uint32 // 0: never dead-letter by count
	maxAttemptsSet  bool
	lockDuration    time.Duration
	lockDurationSet bool
	// RabbitMQ 4 (rabbitmq4.go).
	queueType        QueueType
	queueTypeSet     bool
	deliveryLimit    int // < 0: none
	deliveryLimitSet bool

	mu       sync.Mutex
	records  []*record // publish order
	queued   []*record // waiting, in publish order (a quorum queue's returns first)
	returned int       // quorum: how many of queued, at its head, are returns
	accepted []*record // acceptance order
	dead     []*record // dead-letter order
	final    int       // accepted or dead-lettered
	links    []*link   // attached and not ended
	lastLink int
	owners   map[string]*link // group-id → the link its messages go to
	refuse   error            // RefuseAttach's
	waiters  []chan struct{}  // closed at the next change
	// FailIssueCredit's: how many IssueCredit calls are still to fail.
	failCredit int
	// Service Bus: the records whose delivery is locked now, by lock token.
	locks     map[amqp.UUID]*record
	lastToken uint64
}

// An Option configures a [Queue].
type Option interface{ apply(*Queue) }

type optionFunc func(*Queue)

func (f optionFunc) apply(q *Queue) { f(q) }

// WithProfile makes the queue behave as the broker of profile p does (see
// the package documentation): [amqpsub.Artemis] and [amqpsub.Generic] get
// Artemis's rules, [amqpsub.RabbitMQ3] gets RabbitMQ 3.10's,
// [amqpsub.RabbitMQ4] gets RabbitMQ 4.0's on a quorum queue or a classic
// one ([WithQueueType], [DeliveryLimit]), and [amqpsub.AzureServiceBus]
// gets Service Bus peek-lock on a queue without sessions (message locks,
// [LockDuration]). [NewQueue] panics on a profile it has no rules for.
//
// Give the subscriber the same profile; a Service Bus queue's Connector
// gives it AzureServiceBus itself, as [amqpsub.ServiceBus]'s does.
//
// Default: amqpsub.Artemis.
func WithProfile(p amqpsub.Profile) Option {
	return optionFunc(func(q *Queue) {
		r, ok := rulesFor(p)
		if !ok {
			panic(fmt.Sprintf("amqpsubtest: no broker rules for profile %q", p))
		}
		q.rules = r
	})
}

// MaxDeliveryAttempts sets how many deliveries of a message may fail
// (settled modified{delivery-failed}) before it is dead-lettered instead of
// queued again: Artemis's max-delivery-attempts. n = 0 never dead-letters
// for failures (Artemis's -1). It has no effect under the RabbitMQ3 profile,
// where failures are not counted; under RabbitMQ4 [NewQueue] panics on it
// (a quorum queue's limit is [DeliveryLimit], which counts every return).
// The repository's test brokers (integration/artemis, artemistest) use 5.
//
// Under AzureServiceBus it is the entity's MaxDeliveryCount: an
// abandon (any modified outcome) and an expired lock each count, and the
// message is dead-lettered with reason MaxDeliveryCountExceeded. Default:
// 10, the default of Artemis and of Service Bus.
func MaxDeliveryAttempts(n uint32) Option {
	return optionFunc(func(q *Queue) { q.maxAttempts, q.maxAttemptsSet = n, true })
}

// NewQueue returns an empty queue with the given options. It panics on an
// invalid option: see each option.
func NewQueue(opts ...Option) *Queue {
	q := &Queue{rules: artemisRules, maxAttempts: 10, lockDuration: time.Minute, deliveryLimit: 20,
		owners: map[string]*link{}, locks: map[amqp.UUID]*record{}}
	for _, o := range opts {
		o.apply(q)
	}
	q.checkRabbitMQ4()
	if q.lockDurationSet && !q.rules.peekLock {
		panic("amqpsubtest: LockDuration needs WithProfile(amqpsub.AzureServiceBus): other brokers have no message locks")
	}
	return q
}

// Connector returns a Connector whose every attach opens a new link on q:
// give it to [amqpsub.New] or NewBatch in place of [amqpsub.Dial]. The queue
// name given to New is not checked. Several subscribers may consume q at
// once, as replicas do: each attach is a link of its own.
//
// On a queue that plays Service Bus it stands in for [amqpsub.ServiceBus]'s
// connector: the subscriber takes the AzureServiceBus profile without
// [WithProfile], and New refuses another profile, and Sessions or SessionIDs
// (the queue has no sessions).
func (q *Queue) Connector() amqpsub.Connector {
	if testhook.Connector == nil {
		panic("amqpsubtest: package amqpsub did not set its test hook")
	}
	return testhook.Connector("amqpsubtest", q.attach, q.rules.peekLock).(amqpsub.Connector)
}

// Message returns a message whose body is one data section holding body,
// with AMQP group-id group unless group is "".
func Message(group, body string) *amqp.Message {
	m := amqp.NewMessage([]byte(body))
	if group != "" {
		m.Properties = &amqp.MessageProperties{GroupID: &group}
	}
	return m
}

// Publish appends msgs to the queue, in order. The queue never modifies
// them: each delivery is a copy with a header of its own. A message's
// delivery count starts from its header's delivery-count (0 without a
// header). Under AzureServiceBus each is enqueued now (x-opt-enqueued-time)
// with the next sequence number, from 1 (x-opt-sequence-number). Publish
// panics on a nil message.
func (q *Queue) Publish(msgs ...*amqp.Message) {
	if slices.Contains(msgs, nil) {
		panic("amqpsubtest: Publish(nil)")
	}
	q.mu.Lock()
	defer q.mu.Unlock()
	t := now()
	for _, m := range msgs {
		r := &record{index: len(q.records), msg: m, seq: int64(len(q.records)) + 1, enqueued: t}
		if m.Header != nil {
			r.count = m.Header.DeliveryCount
		}
		q.records = append(q.records, r)
		q.queued = append(q.queued, r)
	}
	q.changed()
}

// LoseLinks ends every link attached now, as a broker does when it detaches
// a link or loses the connection: their Receive and settlements fail with
// err, and their unsettled deliveries go back to the queue with their
// delivery count unchanged (Artemis closes an AMQP consumer as not failed),
// recorded as [Unsettled]. Under Service Bus they stay locked instead, and
// their settlements are taken (see the package documentation). A RabbitMQ 4
// quorum queue counts them as returns, and raises their header's
// delivery-count, as RabbitMQ does when a consumer's session or connection
// goes.
//
// A subscriber sees a lost link and attaches again, through its Connector,
// to a new link. A nil err means an *amqp.LinkError with condition
// amqp:link:detach-forced.
func (q *Queue) LoseLinks(err error) {
	if err == nil {
		err = &amqp.LinkError{RemoteErr: &amqp.Error{Condition: amqp.ErrCondDetachForced,
			Description: "amqpsubtest: link lost"}}
	}
	q.mu.Lock()
	defer q.mu.Unlock()
	for _, l := range slices.Clone(q.links) {
		q.end(l, err)
	}
}

// RefuseAttach makes every attach from now on fail with err, as a broker
// refusing the connection or the link does, until RefuseAttach(nil). An
// error at the first attach ends Run; later ones are retried with backoff
// unless the subscriber's FatalErrors calls them fatal (an *amqp.Error with
// condition amqp:unauthorized-access, say). Default: nil, attaches succeed.
func (q *Queue) RefuseAttach(err error) {
	q.mu.Lock()
	q.refuse = err
	q.mu.Unlock()
}

// FailIssueCredit makes the next n calls of IssueCredit, on whichever
// attached links make them, fail as go-amqp's Receiver.IssueCredit does
// while a drain is pending on the link: with the error "link is currently
// draining, no credits can be added", and no credit added. The link stays
// attached, as in go-amqp; what a subscriber does then is its own choice.
// A call on a lost link returns nil without using up n. n ≤ 0 ends the
// fault. Default: 0, every IssueCredit succeeds.
//
// The queue answers every drain at once, so no drain of its own is ever
// pending: this is how a test reaches a subscriber's handling of that
// error.
func (q *Queue) FailIssueCredit(n int) {
	q.mu.Lock()
	q.failCredit = max(0, n)
	q.mu.Unlock()
}

// Credit returns the credit the queue holds for its subscribers now: the
// sum, over the links attached now, of the credit each was given and has
// not yet used on a delivery. A drain takes a link's credit back, and a
// link that ends takes its own with it.
func (q *Queue) Credit() int {
	q.mu.Lock()
	defer q.mu.Unlock()
	var n uint64
	for _, l := range q.links {
		n += l.credit
	}
	return int(min(n, math.MaxInt32)) // go-amqp's credit is a uint32
}

// Wait waits until every message published so far is settled for good:
// accepted or dead-lettered. It returns nil then, or, if ctx ends first, an
// error wrapping ctx.Err() that says what is left.
func (q *Queue) Wait(ctx context.Context) error { return q.wait(ctx, nil) }

var errRunEnded = errors.New("the subscriber's Run returned")

// wait is Wait that also gives up, with errRunEnded, when ended is closed.
func (q *Queue) wait(ctx context.Context, ended <-chan struct{}) error {
	for {
		q.mu.Lock()
		q.expireLocks()
		if q.drained() {
			q.mu.Unlock()
			return nil
		}
		// A channel of the caller's, so that a synctest bubble sees the
		// caller durably blocked on it.
		ch := make(chan struct{})
		q.waiters = append(q.waiters, ch)
		q.mu.Unlock()
		select {
		case <-ch:
		case <-ended:
			return q.verdict(errRunEnded)
		case <-ctx.Done():
			return q.verdict(ctx.Err())
		}
	}
}

// verdict is wait's result when it stopped waiting for why.
func (q *Queue) verdict(why error) error {
	q.mu.Lock()
	defer q.mu.Unlock()
	switch {
	case q.drained():
		return nil
	case why == errRunEnded:
		return fmt.Errorf("amqpsubtest: %w before %s", why, q.left())
	}
	return fmt.Errorf("amqpsubtest: %s: %w", q.left(), why)
}

// drained says whether every message is accepted or dead-lettered. q.mu is
// held.
func (q *Queue) drained() bool { return q.final == len(q.records) }

// left says what is not settled for good. q.mu is held.
func (q *Queue) left() string {
	inFlight := len(q.records) - q.final - len(q.queued)
	return fmt.Sprintf("%d of %d messages were accepted or dead-lettered (%d queued, %d in flight)",
		q.final, len(q.records), len(q.queued), inFlight)
}

// Drain runs sub until every message published is accepted or
// dead-lettered (see Wait), then stops it gracefully, as a SIGTERM does
// (by cancelling Run's ctx), and returns what Run returned. Drain calls
// sub.Run, and a Subscriber runs once.
//
// If ctx ends first, the stop is the same and the error also says what was
// left; if Run returns first (a fatal error, Shutdown, Close), the error
// says so. Give it a ctx that ends: a queue that never drains (a handler
// that never accepts) keeps Drain waiting until then.
func (q *Queue) Drain(ctx context.Context, sub *amqpsub.Subscriber) error {
	rctx, stop := context.WithCancel(ctx)
	defer stop()
	ran := make(chan error, 1)
	go func() { ran <- sub.Run(rctx) }()
	werr := q.wait(ctx, sub.Done())
	stop()
	return errors.Join(werr, <-ran)
}

// Records returns what the queue knows of every message published, in
// publish order: Records()[i] is the i-th message published.
func (q *Queue) Records() []Record { return q.snapshot(func() []*record { return q.records }) }

// Queued returns the messages waiting in the queue, in the order the queue
// hands them out (publish order).
func (q *Queue) Queued() []Record { return q.snapshot(func() []*record { return q.queued }) }

// Accepted returns the accepted messages, in the order they were accepted.
func (q *Queue) Accepted() []Record { return q.snapshot(func() []*record { return q.accepted }) }

// DeadLetters returns the dead-lettered messages, in the order they were
// dead-lettered.
func (q *Queue) DeadLetters() []Record { return q.snapshot(func() []*record { return q.dead }) }

func (q *Queue) snapshot(list func() []*record) []Record {
	q.mu.Lock()
	defer q.mu.Unlock()
	q.expireLocks()
	rs := list()
	out := make([]Record, len(rs))
	for i, r := range rs {
		out[i] = r.snapshot()
	}
	return out
}

// attach opens a link: the testhook.Attach of q's Connectors.
func (q *Queue) attach(ctx context.Context) (driver.Source, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.refuse != nil {
		return nil, q.refuse
	}
	q.lastLink++
	// The wake channel is made on the attaching goroutine, which is in the
	// subscriber's synctest bubble when it runs in one.
	l := &link{q: q, id: q.lastLink, wake: make(chan struct{}, 1),
		unsettled: map[*amqp.Message]*record{}, refused: map[*record]bool{}, expired: map[*amqp.Message]late{}}
	q.links = append(q.links, l)
	switch {
	case q.rules.peekLock:
		return serviceBusLink{l}, nil
	case q.rules.rabbit4:
		return rabbit4Link{l}, nil
	}
	return l, nil
}

// changed wakes every link and waiter after a change. q.mu is held.
func (q *Queue) changed() {
	for _, l := range q.links {
		select {
		case l.wake <- struct{}{}:
		default:
		}
	}
	for _, ch := range q.waiters {
		close(ch)
	}
	q.waiters = nil
}

// next takes the message l is to receive next out of the queue, or returns
// nil. It passes over the messages l settled as undeliverable-here. With
// message groups, a message whose group goes to another link is left to
// that link; if that link has no credit, l gets nothing either (Artemis
// ends its pass over the queue at a busy group owner). q.mu is held.
func (q *Queue) next(l *link) *record {
	for i, r := range q.queued {
		if l.refused[r] {
			continue
		}
		if g := r.groupID(); q.rules.groups && g != "" {
			if o := q.owners[g]; o != nil && o != l {
				if o.credit > 0 {
					continue
				}
				return nil
			}
		}
		q.queued = slices.Delete(q.queued, i, i+1)
		if i < q.returned {
			q.returned--
		}
		return r
	}
	return nil
}

// requeue puts r back in the queue at its place in publish order, as
// Artemis (by message id) and RabbitMQ (its original position) do. q.mu is
// held.
func (q *Queue) requeue(r *record) {
	r.state = Queued
	i, _ := slices.BinarySearchFunc(q.queued, r.index, func(x *record, idx int) int { return x.index - idx })
	q.queued = slices.Insert(q.queued, i, r)
}

// fail counts a failed delivery of r (modified{delivery-failed}; under
// Service Bus, an abandon or an expired lock) where the broker counts, and
// dead-letters r at MaxDeliveryAttempts, or queues it again. q.mu is held.
func (q *Queue) fail(r *record) {
	if q.rules.counts {
		r.count++
		if q.maxAttempts > 0 && r.count >= q.maxAttempts {
			if q.rules.peekLock {
				r.dead = maxDeliveryCountExceeded(q.maxAttempts)
			}
			q.deadLetter(r)
			return
		}
	}
	q.requeue(r)
}

// deadLetter moves r to the dead letters. q.mu is held.
func (q *Queue) deadLetter(r *record) {
	r.state = DeadLettered
	q.dead = append(q.dead, r)
	q.final++
}

// end ends l with err: its unsettled deliveries go back to the queue,
// uncounted, and the groups it had are free. Under Service Bus they stay
// locked instead, until their locks expire or they are settled by lock
// token (see link.settle). A quorum queue counts them as returns; one whose
// session ended (err is not errClosed, a detach) as failed too. q.mu is
// held.
func (q *Queue) end(l *link, err error) {
	if l.err != nil {
		return
	}
	l.err = err
	q.links = slices.DeleteFunc(q.links, func(x *link) bool { return x == l })
	if q.rules.quorum {
		q.endQuorum(l, err != errClosed)
	}
	for m, r := range l.unsettled {
		if q.rules.peekLock {
			continue // the lock outlives the link
		}
		r.last().Outcome = Unsettled
		q.unlock(r)
		q.requeue(r)
		delete(l.unsettled, m)
	}
	clear(l.expired)
	for g, o := range q.owners {
		if o == l {
			delete(q.owners, g)
		}
	}
	// Wake l too: its Receive returns err.
	select {
	case l.wake <- struct{}{}:
	default:
	}
	q.changed()
}
