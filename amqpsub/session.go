package amqpsub

import (
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"time"

	"github.com/Azure/go-amqp"
	"go.uber.org/zap"

	"github.com/amqpsub/amqpsub/internal/backoff"
	"github.com/amqpsub/amqpsub/lease"
	"github.com/amqpsub/amqpsub/pump"
)

// Service Bus conditions of session receivers.
const (
	errCondTimeout               amqp.ErrCond = "com.microsoft:timeout"
	errCondSessionCannotBeLocked amqp.ErrCond = "com.microsoft:session-cannot-be-locked"
	sessionFilter                             = "com.microsoft:session-filter"
	// sessionFilterCode is the descriptor of the session filter, as
	// azservicebus sends it through go-amqp (session_receiver.go, newLink:
	// 0x00000137000000C). The 0x000001370000000C of Microsoft's AMQP
	// documents is sent by no official client.
	sessionFilterCode uint64 = 0x137000000C
)

// ErrNoSession is returned by Delivery.SessionState and SetSessionState
// for a delivery that did not come through a session consumer (Sessions,
// SessionIDs), or whose session the consumer no longer holds.
var ErrNoSession = errors.New("amqpsub: the delivery's session is not held")

// sessionReceiverOptions adds to ro what asks the service for a session:
// the session filter (id, or nil for the next available one) and how long
// the service may wait for one to become free.
func sessionReceiverOptions(ro *amqp.ReceiverOptions, id string, wait time.Duration) {
	var v any
	if id != "" {
		v = id
	}
	ro.Filters = append(ro.Filters, amqp.NewLinkFilter(sessionFilter, sessionFilterCode, v))
	ro.Properties = map[string]any{"com.microsoft:timeout": millis32(wait)}
}

// sessionSource is the source of a session link: its receiver, which it
// ends with pump.ErrSourceDone when the session has been idle (no message,
// nothing held) for SessionIdleTimeout, and the renewal of the session's
// lock, which a goroutine keeps up while the link lives.
type sessionSource struct {
	*amqp.Receiver
	id   string
	idle time.Duration
	p    *pipe
	l    *link

	cancel context.CancelFunc // ends the renewal
	done   chan struct{}      // closed when the renewal has returned
}

// startSession takes the session l's receiver was granted, and starts
// renewing its lock.
func (s *Subscriber) startSession(p *pipe, l *link) (*sessionSource, error) {
	id, _ := l.rcv.LinkSourceFilterValue(sessionFilter).(string)
	if id == "" {
		return nil, errors.New("amqpsub: the service granted no session id in its attach")
	}
	until, sent := ticksTime(l.rcv.Properties()["com.microsoft:locked-until-utc"])
	if !sent {
		until = time.Now() // renew at once
	}
	ctx, cancel := context.WithCancel(context.Background())
	src := &sessionSource{Receiver: l.rcv, id: id, idle: s.cfg.sessionIdle, p: p, l: l,
		cancel: cancel, done: make(chan struct{})}
	go src.renew(ctx, s, until)
	s.log.Info("session accepted", zap.String("session_id", id), zap.Int("slot", p.index),
		zap.Time("locked_until", until), zap.Bool("locked_until_sent", sent))
	return src, nil
}

// ticksTime converts .NET ticks (100 ns since 0001-01-01 UTC), as Service
// Bus sends com.microsoft:locked-until-utc, to a time.
func ticksTime(v any) (time.Time, bool) {
	var ticks int64
	switch v := v.(type) {
	case int64:
		ticks = v
	case uint64:
		if v > math.MaxInt64 {
			return time.Time{}, false
		}
		ticks = int64(v)
	default:
		return time.Time{}, false
	}
	const unixEpochTicks = 621355968000000000
	return time.UnixMilli((ticks - unixEpochTicks) / 10000), true
}

// Receive returns the session's next message, or an error wrapping
// pump.ErrSourceDone once the session has been idle for SessionIdleTimeout
// with nothing of it held. When the link is lost, the session's lock went
// with it (a session is locked to its link): every delivery of the session
// is given up at once, before Receive returns the link's error, and the
// context of each handler still running is cancelled with ErrLockLost.
func (src *sessionSource) Receive(ctx context.Context, opts *amqp.ReceiveOptions) (*amqp.Message, error) {
	for {
		rctx, cancel := context.WithTimeout(ctx, src.idle)
		m, err := src.Receiver.Receive(rctx, opts)
		cancel()
		switch {
		case err == nil:
			return m, nil
		case ctx.Err() != nil:
			return nil, err // the pump ended the receive
		case !errors.Is(err, context.DeadlineExceeded):
			src.p.book.LoseAll("the session link was lost")
			return nil, err
		case src.p.pump.Held() == 0:
			return nil, fmt.Errorf("%w: session %q idle for %v", pump.ErrSourceDone, src.id, src.idle)
		}
	}
}

// renew keeps the session's lock up (keepSessionLock) until ctx ends. A
// lock that is lost, or can no longer be renewed, gives up every delivery
// of the session (dropped, or its handler's context cancelled) and closes
// the link, so that the next session is accepted.
func (src *sessionSource) renew(ctx context.Context, s *Subscriber, until time.Time) {
	defer close(src.done)
	err := keepSessionLock(ctx, until, func(ctx context.Context) (time.Time, error) {
		resp, err := src.l.mgmt.request(ctx, "com.microsoft:renew-session-lock", map[string]any{"session-id": src.id})
		if err != nil {
			return time.Time{}, err
		}
		body, _ := resp.Value.(map[string]any)
		if exp, ok := body["expiration"].(time.Time); ok {
			return exp, nil
		}
		return time.Time{}, errors.New("amqpsub: renew-session-lock: no expiration in the answer")
	}, func(err error, until time.Time) {
		// Limited: it is tried again every 250 ms to 2 s while it fails.
		s.limited.Warn("renewing the session lock failed; trying again", zap.String("session_id", src.id),
			zap.Time("locked_until", until), zap.Error(err))
	})
	if err == nil {
		return // stopped
	}
	s.log.Warn("session lock lost; giving up its deliveries", zap.String("session_id", src.id), zap.Error(err))
	src.p.book.LoseAll("the session lock was lost")
	// Bounded, and cut short by stop: go-amqp goes on closing the link.
	cctx, cancel := context.WithTimeout(ctx, time.Second)
	defer cancel()
	_ = src.Close(cctx)
}

// A named session that another receiver holds
// (com.microsoft:session-cannot-be-locked) is asked for again after a wait
// that doubles from sessionLockedFloor up to sessionLockedMax, between half
// and all of it (see sessionLockedWait).
const (
	sessionLockedFloor = time.Second
	sessionLockedMax   = 30 * time.Second
)

// sessionLockedWait is the wait before the k-th (from 0) new request for a
// named session that another receiver held: "equal jitter" under
// Ceiling(k, 1 s, 30 s). azservicebus does not retry this condition at all
// (internal/errors.go maps it to RecoveryKindFatal: AcceptSessionForQueue
// returns it to its caller); a consumer of named sessions is that caller,
// and waits for the session to be let go rather than end Run.
func sessionLockedWait(k int) time.Duration {
	c := backoff.Ceiling(k, sessionLockedFloor, sessionLockedMax)
	return c/2 + rand.N(c/2+1) //nolint:gosec // G404: jitter spreads retries; nothing secret depends on it
}

// sessionBusyPoll is how often a slot that waits for a session's old
// handlers looks again.
const sessionBusyPoll = 20 * time.Millisecond

// handlersOf counts the handlers of session id running in this process, in
// any slot.
func (s *Subscriber) handlersOf(id string) int {
	n := 0
	for _, p := range s.pipes {
		p.pump.Each(func(d *pump.Delivery) bool {
			if m := d.Message(); m != nil && d.State() == pump.Handling && groupID(m) == id {
				n++
			}
			return true
		})
	}
	return n
}

// awaitSession returns once no handler of src's session runs in this
// process, before the session's link is handed to the pump: a session whose
// link was lost while a handler of it ran goes back to the service, which
// gives it to the first receiver that asks (another slot, or this one
// again), and its messages, the one in that handler first, would otherwise
// run beside it. Those handlers' contexts were cancelled with the loss (see
// Receive); one that does not return keeps the session's messages waiting
// here, its lock renewed, until it does. ctx ends the wait with its error.
func (s *Subscriber) awaitSession(ctx context.Context, src *sessionSource) error {
	n := s.handlersOf(src.id)
	if n == 0 {
		return nil
	}
	s.log.Info("the session's handlers from its lost link still run here; waiting for them before taking its messages",
		zap.String("session_id", src.id), zap.Int("slot", src.p.index), zap.Int("handlers", n))
	t := time.NewTicker(sessionBusyPoll)
	defer t.Stop()
	for s.handlersOf(src.id) > 0 {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-t.C:
		}
	}
	return nil
}

// Session lock renewal after a failed request.
const (
	sessionRetryFloor = 250 * time.Millisecond
	sessionRetryMax   = 2 * time.Second
	// sessionRenewTimeout bounds each request (and so does the lock's
	// expiry).
	sessionRenewTimeout = 10 * time.Second
)

// keepSessionLock renews a session lock that expires at until, with renew
// (which returns the new expiry), until ctx ends (it returns nil) or the
// lock is lost (it returns why). A renewal goes out at the rule of message
// locks: once remaining − min(remaining/2, 10 s) of the remaining time has
// passed. A failed request is reported to retrying and tried again after
// half the time left (between 250 ms and 2 s), for as long as the lock
// lasts: the lock is lost when it expired, or at once when the service says
// it is (status 410) or the $management link is gone for good.
func keepSessionLock(ctx context.Context, until time.Time, renew func(context.Context) (time.Time, error),
	retrying func(err error, until time.Time)) error {
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	next := renewalDue(time.Now(), until)
	var failed error // the last request's error, while they fail
	for {
		timer.Reset(time.Until(next))
		select {
		case <-ctx.Done():
			return nil
		case <-timer.C:
		}
		now := time.Now()
		if failed != nil && !now.Before(until) {
			return fmt.Errorf("amqpsub: the session lock expired at %v, unrenewed: %w", until, failed)
		}
		// An answer after the lock expired is of no use (an expiry in the
		// past is the session's unknown lock time: then 10 s).
		timeout := sessionRenewTimeout
		if left := until.Sub(now); left > 0 {
			timeout = min(timeout, left)
		}
		rctx, cancel := context.WithTimeout(ctx, timeout)
		exp, err := renew(rctx)
		cancel()
		if ctx.Err() != nil {
			return nil
		}
		now = time.Now()
		if err == nil {
			until, failed = exp, nil
			next = renewalDue(now, until)
			continue
		}
		if errors.Is(err, lease.ErrLockLost) || errors.Is(err, errNodeGone) {
			return err
		}
		if !now.Before(until) {
			return fmt.Errorf("amqpsub: the session lock expired at %v, unrenewed: %w", until, err)
		}
		failed = err
		retrying(err, until)
		next = now.Add(min(sessionRetryMax, max(sessionRetryFloor, until.Sub(now)/2)))
	}
}

// renewalDue is when a lock that expires at until is renewed: after
// remaining − min(remaining/2, 10 s), .NET's rule.
func renewalDue(now, until time.Time) time.Time {
	remaining := until.Sub(now)
	return now.Add(max(0, remaining-min(remaining/2, 10*time.Second)))
}

// stop ends the renewal and waits for it: at once, since a request in
// progress is cancelled.
func (src *sessionSource) stop() {
	src.cancel()
	<-src.done
}

// SessionID returns the Service Bus session the delivery belongs to, when
// it came through a session consumer (Sessions, SessionIDs); "" otherwise.
func (d *Delivery) SessionID() string {
	if d.l == nil || d.l.session == nil {
		return ""
	}
	return d.l.session.id
}

// SessionState returns the state stored with the delivery's session (nil
// when none is set), from the service. It returns an error wrapping
// ErrNoSession when the delivery did not come through a session consumer,
// or its session is no longer held. ctx bounds the request.
func (d *Delivery) SessionState(ctx context.Context) ([]byte, error) {
	src, err := d.heldSession()
	if err != nil {
		return nil, err
	}
	resp, err := src.l.mgmt.request(ctx, "com.microsoft:get-session-state", map[string]any{"session-id": src.id})
	if err != nil {
		return nil, sessionErr(err)
	}
	body, _ := resp.Value.(map[string]any)
	state, _ := body["session-state"].([]byte)
	return state, nil
}

// SetSessionState stores state with the delivery's session (nil clears
// it). Errors as SessionState.
func (d *Delivery) SetSessionState(ctx context.Context, state []byte) error {
	src, err := d.heldSession()
	if err != nil {
		return err
	}
	var v any
	if state != nil {
		v = state
	}
	_, err = src.l.mgmt.request(ctx, "com.microsoft:set-session-state", map[string]any{"session-id": src.id, "session-state": v})
	return sessionErr(err)
}

func (d *Delivery) heldSession() (*sessionSource, error) {
	if d.l == nil || d.l.session == nil {
		return nil, ErrNoSession
	}
	if d.t.Stale() {
		return nil, fmt.Errorf("%w: session %q: its link is gone", ErrNoSession, d.l.session.id)
	}
	return d.l.session, nil
}

func sessionErr(err error) error {
	if errors.Is(err, lease.ErrLockLost) {
		return fmt.Errorf("%w: %w", ErrNoSession, err)
	}
	return err
}
