package servicebus

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/Azure/go-amqp"
	"go.uber.org/zap"

	"github.com/amqpsub/amqpsub/internal/driver"

	"github.com/amqpsub/amqpsub/internal/wait"
)

// Service Bus keeps a message's lock until it expires, whether or not the
// link it came on is still attached, and settles a message by its lock
// token on the entity's $management node (com.microsoft:update-disposition).
// The official clients settle on the receive link and fall back to that
// request when the link is gone: azservicebus (messageSettler.go,
// shouldSettleOnMgmtLink; internal/mgmt.go, SettleOnMgmtLink), the
// JavaScript SDK (azure-sdk-for-js PR #8340) and the Python SDK for
// messages without sessions (azure-sdk-for-python #31187), and .NET
// (AmqpReceiver.cs, DisposeMessageAsync). A maintainer of the .NET client
// saw the lock renewals of such messages keep succeeding after a reconnect
// (azure-sdk-for-net #37676). So a link the
// service detaches (an idle link after 10 minutes, or
// amqp:link:detach-forced) costs no finished work: the pump keeps what the
// link held (its LeasesOutliveLinks), and Receiver settles it this
// way. Session messages are not settled so: their locks are the session's,
// which ends with the session link.

// Receiver is the receive link of a Service Bus queue or subscription
// without sessions, as the pump sees it: a settlement goes out on the link
// while it is up and, once the link is gone, as update-disposition through
// [Dispositions].
type Receiver struct {
	*amqp.Receiver
	fb byToken
}

// byToken settles a message by its lock token ([Dispositions]).
type byToken interface {
	settle(ctx context.Context, msg *amqp.Message, o driver.Outcome, retries int) error
}

// NewReceiver returns rcv as a [driver.Source] that settles through fb once
// the link is gone.
func NewReceiver(rcv *amqp.Receiver, fb *Dispositions) Receiver {
	return Receiver{Receiver: rcv, fb: fb}
}

// AcceptMessage settles msg on the link, or by lock token once the link is gone
// (see settle).
func (r Receiver) AcceptMessage(ctx context.Context, msg *amqp.Message) error {
	return r.settle(ctx, msg, driver.Outcome{Kind: driver.Accept}, func() error { return r.Receiver.AcceptMessage(ctx, msg) })
}

// ReleaseMessage settles msg on the link, or by lock token once the link is gone
// (see settle).
func (r Receiver) ReleaseMessage(ctx context.Context, msg *amqp.Message) error {
	return r.settle(ctx, msg, driver.Outcome{Kind: driver.Release}, func() error { return r.Receiver.ReleaseMessage(ctx, msg) })
}

// RejectMessage settles msg on the link, or by lock token once the link is gone
// (see settle).
func (r Receiver) RejectMessage(ctx context.Context, msg *amqp.Message, e *amqp.Error) error {
	return r.settle(ctx, msg, driver.Outcome{Kind: driver.Reject, Error: e}, func() error { return r.Receiver.RejectMessage(ctx, msg, e) })
}

// ModifyMessage settles msg on the link, or by lock token once the link is gone
// (see settle).
func (r Receiver) ModifyMessage(ctx context.Context, msg *amqp.Message, o *amqp.ModifyMessageOptions) error {
	out := driver.Outcome{Kind: driver.Modify}
	if o != nil {
		out.DeliveryFailed, out.UndeliverableHere = o.DeliveryFailed, o.UndeliverableHere
	}
	return r.settle(ctx, msg, out, func() error { return r.Receiver.ModifyMessage(ctx, msg, o) })
}

// settle sends a settlement on the link (onLink), and returns its answer;
// when the link is gone, the answer of the same settlement sent by lock
// token.
//
// An answer that the service was busy or timed out
// (com.microsoft:server-busy, com.microsoft:timeout,
// com.microsoft:operation-cancelled: retried by azservicebus,
// internal/errors.go) is sent again by lock token too, after RetryWait (10 s
// at least after server-busy), within ctx: go-amqp takes any disposition
// the peer sends as the delivery's settlement, error or not (receiver.go:
// the answer removes it from the in-flight settlements and marks the
// message settled, and a later settlement of a settled message returns nil
// writing nothing), so the link cannot carry it again, while the service
// still holds the message's lock. The link's attempt counts in the retry
// budget: the request by token gets the dispositionRetries - 1 retries left.
func (r Receiver) settle(ctx context.Context, msg *amqp.Message, o driver.Outcome, onLink func() error) error {
	err := onLink()
	switch {
	case err == nil || ctx.Err() != nil:
		return err
	case linkGone(err):
		return r.fb.settle(ctx, msg, o, dispositionRetries)
	case !transientCond(err):
		return err
	}
	// While it waits nothing is out for the message, so its lock is
	// renewed (driver.Resting); the wait leaves half the time left to the
	// request by token.
	resume := driver.Resting(ctx)
	slept := wait.Sleep(ctx, restWait(ctx, RetryWait(err, 0, settleRetryFloor, settleRetryMax)))
	resume()
	if !slept {
		return err
	}
	return r.fb.settle(ctx, msg, o, dispositionRetries-1)
}

// restWait is d, or half the time left before ctx's deadline if that is
// sooner: a settlement bounded by a SettleTimeout shorter than a
// server-busy wait is still sent again within it.
func restWait(ctx context.Context, d time.Duration) time.Duration {
	if dl, ok := ctx.Deadline(); ok {
		d = min(d, time.Until(dl)/2)
	}
	return max(d, 0)
}

// transientCond reports whether err is an answer of the service that a
// settlement sent again may not get.
func transientCond(err error) bool {
	return IsCond(err, CondServerBusy) || IsCond(err, CondTimeout) || IsCond(err, "com.microsoft:operation-cancelled")
}

// linkGone reports whether err says that a settlement could not go out on
// its link because the link (its session, or its connection) is gone.
// azservicebus falls back on *amqp.LinkError; a lost connection ends the
// link with a *amqp.ConnError here.
func linkGone(err error) bool {
	var le *amqp.LinkError
	var se *amqp.SessionError
	var ce *amqp.ConnError
	return errors.As(err, &le) || errors.As(err, &se) || errors.As(err, &ce)
}

// Dispositions by lock token, for a receive path of a Service Bus
// queue or subscription without sessions.
const (
	// dispositionBatch is the most lock tokens in one update-disposition.
	dispositionBatch = 256
	// dispositionTimeout bounds one request.
	dispositionTimeout = 10 * time.Second
	// dispositionRetries is how often a settlement that failed
	// transiently is sent again (azservicebus's RetryOptions default: 3),
	// always by lock token: the request of a lost link's settlement up to
	// 3 times; a settlement answered busy or timed out on its link once by
	// token (the first of its 3), and that request up to twice more.
	// After a server-busy answer the next waits ServerBusyWait at least.
	dispositionRetries = 3
	// A settlement sent again waits a jittered backoff between these
	// (RetryWait).
	settleRetryFloor = 100 * time.Millisecond
	settleRetryMax   = 2 * time.Second
)

// Dispositions sends the settlements of messages whose link is gone as
// com.microsoft:update-disposition on the $management node of the current
// link (nodes): all that are queued when it looks go in as few requests
// as their outcomes allow (one per outcome and reason, at most
// dispositionBatch tokens each). Run is its goroutine; settle is called by
// the pump's settlers (through [Receiver]).
type Dispositions struct {
	nodes func(ctx context.Context) (*Management, error)
	log   *zap.Logger
	wake  chan struct{}

	mu      sync.Mutex
	queue   []*disposition
	stopped bool

	requests atomic.Uint64 // update-disposition requests sent
	taken    atomic.Uint64 // settlements the service took by lock token
}

// disposition is one settlement waiting to be sent.
type disposition struct {
	// ctx is its caller's: once it has ended the caller has its answer
	// (in doubt), and the settlement is sent no more.
	ctx   context.Context
	token amqp.UUID
	o     driver.Outcome
	// retries is how often its request is sent again after a transient
	// failure (a request carrying several sends again as often as the
	// one of them allowed the most).
	retries int
	done    chan error // buffered: the sender never waits for the caller
}

// NewDispositions returns the [Dispositions] of one receive path; nodes
// gives the $management node of its current link, waiting within ctx for a
// link while none is attached.
func NewDispositions(nodes func(ctx context.Context) (*Management, error), log *zap.Logger) *Dispositions {
	return &Dispositions{nodes: nodes, log: log, wake: make(chan struct{}, 1)}
}

// Requests counts the update-disposition requests sent.
func (f *Dispositions) Requests() uint64 { return f.requests.Load() }

// Taken counts the settlements the service took by lock token.
func (f *Dispositions) Taken() uint64 { return f.taken.Load() }

// errNoLock is returned for a message without a lock token.
var errNoLock = errors.New("amqpsub: the message has no lock token (a 16-byte delivery tag) to settle it by")

// errNotRunning is returned once the dispositions' goroutine has ended.
var errNotRunning = errors.New("amqpsub: the subscriber is no longer running")

// settle sends o for msg by its lock token, sending it again up to retries
// times after a transient failure, and returns the service's answer: nil,
// an *amqp.Error of condition com.microsoft:message-lock-lost
// ([CondLockLost]) when the service says the lock is gone, or
// another error. It returns when ctx ends, with ctx's error; the
// settlement is then in doubt. A release's answer, whatever it is, is
// wrapped by driver.SentAs(driver.Modify, …): it goes as abandoned.
func (f *Dispositions) settle(ctx context.Context, msg *amqp.Message, o driver.Outcome, retries int) error {
	token, ok := LockToken(msg.DeliveryTag)
	if !ok {
		return sentAs(o, errNoLock)
	}
	d := &disposition{ctx: ctx, token: token, o: o, retries: retries, done: make(chan error, 1)}
	f.mu.Lock()
	if f.stopped {
		f.mu.Unlock()
		return sentAs(o, errNotRunning)
	}
	f.queue = append(f.queue, d)
	f.mu.Unlock()
	select {
	case f.wake <- struct{}{}:
	default:
	}
	select {
	case err := <-d.done:
		return sentAs(o, err)
	case <-ctx.Done():
		return sentAs(o, fmt.Errorf("amqpsub: update-disposition not answered: %w", ctx.Err()))
	}
}

// sentAs tells the pump what went out for o: a release goes by lock token
// as abandoned (dispositionOf), which the service counts as a modified
// delivery (delivery count + 1), and so does the pump (driver.SentAs).
func sentAs(o driver.Outcome, err error) error {
	if o.Kind == driver.Release {
		return driver.SentAs(driver.Modify, err)
	}
	return err
}

// Run sends what settle queues until ctx ends; what is queued then fails
// with errNotRunning.
func (f *Dispositions) Run(ctx context.Context) {
	defer func() {
		f.mu.Lock()
		f.stopped = true
		q := f.queue
		f.queue = nil
		f.mu.Unlock()
		for _, d := range q {
			d.done <- errNotRunning
		}
	}()
	for {
		select {
		case <-ctx.Done():
			return
		case <-f.wake:
		}
		for {
			f.mu.Lock()
			q := f.queue
			f.queue = nil
			f.mu.Unlock()
			if len(q) == 0 {
				break
			}
			for _, batch := range batches(q) {
				f.send(ctx, batch)
			}
		}
	}
}

// batches splits q, in order, into runs that one request can carry: the
// same outcome, at most dispositionBatch tokens.
func batches(q []*disposition) [][]*disposition {
	var out [][]*disposition
	for len(q) > 0 {
		n := 1
		for n < len(q) && n < dispositionBatch && sameDisposition(q[0].o, q[n].o) {
			n++
		}
		out = append(out, q[:n])
		q = q[n:]
	}
	return out
}

func sameDisposition(a, b driver.Outcome) bool {
	sa, ra, da := dispositionOf(a)
	sb, rb, db := dispositionOf(b)
	return sa == sb && ra == rb && da == db
}

// dispositionOf maps an outcome to update-disposition's status and, for
// a dead-letter, its reason and description. A release has no status of
// its own there: it goes back as abandoned (counted), as it would when its
// lock expired.
func dispositionOf(o driver.Outcome) (status, reason, description string) {
	switch o.Kind {
	case driver.Accept:
		return "completed", "", ""
	case driver.Reject:
		reason, description = deadLetterReason(o.Error)
		return "suspended", reason, description
	case driver.Modify:
		if o.UndeliverableHere {
			return "defered", "", "" // sic: what azservicebus sends
		}
		return "abandoned", "", ""
	}
	return "abandoned", "", ""
}

// deadLetterReason reads the reason and description of a dead-letter
// outcome's error, as the link disposition carries them.
func deadLetterReason(e *amqp.Error) (reason, description string) {
	if e == nil {
		return "", ""
	}
	reason, _ = e.Info["DeadLetterReason"].(string)
	description, _ = e.Info["DeadLetterErrorDescription"].(string)
	if reason == "" {
		reason = e.Description
	}
	return reason, description
}

// send sends one batch, splitting it token by token when the service says
// a lock of it is lost, so that one lost lock does not fail the others;
// it retries transient failures. It answers every disposition in batch.
func (f *Dispositions) send(ctx context.Context, batch []*disposition) {
	err := f.request(ctx, batch)
	if errors.Is(err, ErrLockLost) && len(batch) > 1 {
		for _, d := range batch {
			f.send(ctx, []*disposition{d})
		}
		return
	}
	if errors.Is(err, ErrLockLost) {
		err = &amqp.Error{Condition: CondLockLost, Description: err.Error()}
	}
	if err == nil {
		f.taken.Add(uint64(len(batch)))
	}
	for _, d := range batch {
		d.done <- err
	}
}

// request sends batch as one update-disposition on the current link's
// $management node, waiting for a link while none is attached (nodes; not
// once the receive path is stopping), and sends it again, as often as a
// disposition of batch allows (disposition.retries), when the service
// answers that it is busy or timed out, or the node went while the request
// was out (a lost connection: the next link's node takes it).
func (f *Dispositions) request(ctx context.Context, batch []*disposition) error {
	status, reason, desc := dispositionOf(batch[0].o)
	var err error
	for attempt := 0; ; attempt++ {
		// What its callers gave up on is not sent: they returned (the
		// settlement in doubt), and a settlement taken after that would
		// contradict what they were told.
		live := batch[:0:0]
		for _, d := range batch {
			if d.ctx.Err() == nil {
				live = append(live, d)
			}
		}
		if len(live) == 0 {
			if err == nil {
				err = context.DeadlineExceeded
			}
			return err
		}
		tokens := make([]amqp.UUID, len(live))
		retries := 0
		var latest time.Time // the last of the callers' deadlines; zero: one has none
		bounded := true
		for i, d := range live {
			tokens[i] = d.token
			retries = max(retries, d.retries)
			if dl, ok := d.ctx.Deadline(); ok && bounded {
				latest = later(latest, dl)
			} else {
				bounded = false
			}
		}
		body := map[string]any{"disposition-status": status, "lock-tokens": tokens}
		if status == "suspended" {
			body["deadletter-reason"] = reason
			body["deadletter-description"] = desc
		}
		var m *Management
		if m, err = f.nodes(ctx); err != nil {
			return err
		}
		deadline := time.Now().Add(dispositionTimeout)
		if bounded && latest.Before(deadline) {
			deadline = latest
		}
		rctx, cancel := context.WithDeadline(ctx, deadline)
		f.requests.Add(1)
		_, err = m.Request(rctx, "com.microsoft:update-disposition", body)
		cancel()
		if err == nil || attempt >= retries || ctx.Err() != nil || !transientStatus(err) && !nodeGone(err) {
			return err
		}
		d := RetryWait(err, attempt, settleRetryFloor, settleRetryMax)
		if bounded {
			d = min(d, max(time.Until(latest)/2, 0))
		}
		f.log.Debug("update-disposition failed; trying again", zap.Int("locks", len(live)),
			zap.Duration("wait", d), zap.Error(err))
		// Nothing is out for them while they wait: their locks are renewed.
		resumes := make([]func(), len(live))
		for i, x := range live {
			resumes[i] = driver.Resting(x.ctx)
		}
		slept := wait.Sleep(ctx, d)
		for _, resume := range resumes {
			resume()
		}
		if !slept {
			return err
		}
	}
}

// later returns the later of a (zero: none yet) and b.
func later(a, b time.Time) time.Time {
	if a.IsZero() || b.After(a) {
		return b
	}
	return a
}

// nodeGone reports whether a request failed because the $management link
// pair or its connection went while it was sent: it is sent again on the
// next link's.
func nodeGone(err error) bool { return errors.Is(err, ErrNodeGone) || linkGone(err) }
