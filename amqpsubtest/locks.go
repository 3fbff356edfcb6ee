package amqpsubtest

import (
	"cmp"
	"context"
	"encoding/binary"
	"fmt"
	"slices"
	"time"

	"github.com/Azure/go-amqp"

	"github.com/amqpsub/amqpsub/amqpsub"
	"github.com/amqpsub/amqpsub/internal/driver/servicebus"
)

// Service Bus peek-lock, as the queue plays it under
// WithProfile(amqpsub.AzureServiceBus). Nothing here runs on its own:
// locks expire when someone looks (a Receive, a settlement, a renewal, a
// snapshot), and a Receive that waits sets a timer, on its caller's
// goroutine, for the next expiry.

// LockDuration sets the lock duration of a Service Bus queue: how long a
// delivery stays locked to its receiver unless the lock is renewed. Service
// Bus takes 5 s to 5 min; the queue takes any d > 0, and panics otherwise,
// or when the queue does not play Service Bus (give
// WithProfile([amqpsub.AzureServiceBus]) too). Default: 60 s, Service Bus's
// default.
func LockDuration(d time.Duration) Option {
	return optionFunc(func(q *Queue) {
		if d <= 0 {
			panic(fmt.Sprintf("amqpsubtest: LockDuration(%v): must be > 0", d))
		}
		q.lockDuration, q.lockDurationSet = d, true
	})
}

// lock is the Service Bus lock of a record's delivery in flight.
type lock struct {
	token amqp.UUID
	until time.Time
	l     *link
	m     *amqp.Message // the delivered copy, as l.unsettled knows it
}

// late is a delivery whose lock expired, for its settlement to be refused.
type late struct {
	r *record
	i int // in r.deliveries
}

// lockLostError is how Service Bus answers a settlement whose lock has
// expired (a rejected disposition; go-amqp returns its error).
func lockLostError() *amqp.Error {
	return &amqp.Error{Condition: servicebus.CondLockLost,
		Description: "amqpsubtest: the lock supplied is invalid: it expired, or the message was settled"}
}

// maxDeliveryCountExceeded is the dead-letter reason Service Bus gives a
// message it dead-letters for its delivery count.
func maxDeliveryCountExceeded(n uint32) *amqp.Error {
	return &amqp.Error{Condition: amqpsub.ErrCondDeadLetter, Description: "MaxDeliveryCountExceeded",
		Info: map[string]any{
			"DeadLetterReason":           "MaxDeliveryCountExceeded",
			"DeadLetterErrorDescription": fmt.Sprintf("Message could not be consumed after %d delivery attempts.", n),
		}}
}

// now is the time as a Service Bus timestamp holds it: UTC, to the
// millisecond.
func now() time.Time { return time.Now().UTC().Truncate(time.Millisecond) }

// tagOf is the delivery tag of lock token u: Service Bus writes it in
// .NET's Guid layout, the first three fields little-endian (the inverse of
// servicebus.LockToken, which swaps the same bytes back).
func tagOf(u amqp.UUID) []byte {
	t := u
	t[0], t[1], t[2], t[3] = u[3], u[2], u[1], u[0]
	t[4], t[5] = u[5], u[4]
	t[6], t[7] = u[7], u[6]
	return t[:]
}

// lockFor locks r's delivery m on l, and writes what Service Bus sends
// with it into m (a copy of the published message). q.mu is held.
func (q *Queue) lockFor(l *link, r *record, m *amqp.Message) {
	q.lastToken++
	var u amqp.UUID
	binary.BigEndian.PutUint64(u[8:], q.lastToken)
	u[6], u[8] = 0x40, u[8]|0x80 // a version 4 UUID, as the service's are
	until := now().Add(q.lockDuration)
	r.lock = &lock{token: u, until: until, l: l, m: m}
	q.locks[u] = r
	r.last().LockedUntil = until
	m.DeliveryTag = tagOf(u)
	ann := make(amqp.Annotations, len(r.msg.Annotations)+3)
	for k, v := range r.msg.Annotations {
		ann[k] = v
	}
	// go-amqp decodes annotation keys as strings.
	ann["x-opt-locked-until"] = until
	ann["x-opt-sequence-number"] = r.seq
	ann["x-opt-enqueued-time"] = r.enqueued
	m.Annotations = ann
}

// unlock drops r's lock: settled, or its link ended. q.mu is held.
func (q *Queue) unlock(r *record) {
	if r.lock != nil {
		delete(q.locks, r.lock.token)
		r.lock = nil
	}
}

// expireLocks ends every lock past its expiry: the message goes back,
// counted, or is dead-lettered at MaxDeliveryAttempts, as Service Bus does;
// a later settlement of the delivery is refused. q.mu is held.
func (q *Queue) expireLocks() {
	if len(q.locks) == 0 {
		return
	}
	t := time.Now()
	var expired []*record
	for _, r := range q.locks {
		if !r.lock.until.After(t) {
			expired = append(expired, r)
		}
	}
	if len(expired) == 0 {
		return
	}
	// In publish order, so that dead letters come in an order a test can
	// rely on.
	slices.SortFunc(expired, func(a, b *record) int { return cmp.Compare(a.index, b.index) })
	for _, r := range expired {
		lk := r.lock
		q.unlock(r)
		delete(lk.l.unsettled, lk.m)
		lk.l.expired[lk.m] = late{r: r, i: len(r.deliveries) - 1}
		r.last().Outcome = LockExpired
		q.fail(r)
	}
	q.changed()
}

// nextExpiry returns when the next lock expires; zero when none is held.
// q.mu is held.
func (q *Queue) nextExpiry() time.Time {
	var next time.Time
	for _, r := range q.locks {
		if next.IsZero() || r.lock.until.Before(next) {
			next = r.lock.until
		}
	}
	return next
}

// serviceBusLink is a link of a queue that plays Service Bus: what the
// subscriber's pump and lease book get. Besides a link's calls it renews
// locks, in place of the $management node beside a Service Bus link (the
// lease book's renewer calls it: see package internal/testhook).
type serviceBusLink struct{ *link }

// RenewLocks renews message locks (servicebus.Renewer): see renewLocks.
func (l serviceBusLink) RenewLocks(ctx context.Context, tokens []amqp.UUID) ([]time.Time, error) {
	return l.renewLocks(ctx, tokens)
}

// renewLocks renews the locks of tokens for the lock duration from now, as
// com.microsoft:renew-lock on a Service Bus entity's $management node
// does, and returns their new expiries. When a lock is expired, settled or
// unknown it renews none and returns an error wrapping servicebus.ErrLockLost,
// as servicebus.Management.RenewLocks does for the service's status 410. A ctx that has
// ended renews none; so does a link that ended (its error).
func (l *link) renewLocks(ctx context.Context, tokens []amqp.UUID) ([]time.Time, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	q := l.q
	q.mu.Lock()
	defer q.mu.Unlock()
	if l.err != nil {
		return nil, l.err
	}
	q.expireLocks()
	rs := make([]*record, len(tokens))
	for i, tok := range tokens {
		if rs[i] = q.locks[tok]; rs[i] == nil {
			return nil, fmt.Errorf("amqpsubtest: com.microsoft:renew-lock: status 410: lock token %s is expired, settled or unknown: %w",
				tok, servicebus.ErrLockLost)
		}
	}
	until := now().Add(q.lockDuration)
	exp := make([]time.Time, len(tokens))
	for i, r := range rs {
		r.lock.until = until
		d := r.last()
		d.LockedUntil = until
		d.Renewals++
		exp[i] = until
	}
	return exp, nil
}
