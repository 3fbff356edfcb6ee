package servicebus

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"time"

	"github.com/Azure/go-amqp"
	"go.uber.org/zap"

	"github.com/amqpsub/amqpsub/internal/amqpint"
	"github.com/amqpsub/amqpsub/internal/backoff"
	"github.com/amqpsub/amqpsub/internal/driver"
	"github.com/amqpsub/amqpsub/internal/loglimit"
)

// The session filter, as the service reads it.
const (
	sessionFilter = "com.microsoft:session-filter"
	// sessionFilterCode is the descriptor of the session filter, as
	// azservicebus sends it through go-amqp (session_receiver.go, newLink:
	// 0x00000137000000C). .NET sends the filter bare, with no descriptor
	// (AmqpConnectionScope.cs); no source was found for 0x000001370000000C.
	sessionFilterCode uint64 = 0x137000000C
)

// SessionReceiverOptions adds to ro what asks the service for a session:
// the session filter (id, or "" for the next available one) and how long
// the service may wait for one to become free.
func SessionReceiverOptions(ro *amqp.ReceiverOptions, id string, wait time.Duration) {
	var v any
	if id != "" {
		v = id
	}
	ro.Filters = append(ro.Filters, amqp.NewLinkFilter(sessionFilter, sessionFilterCode, v))
	ro.Properties = map[string]any{"com.microsoft:timeout": millis32(wait)}
}

// IsNoSession reports the attach errors of a session receiver that mean
// "wait": no session free before the service's timeout, or the session
// asked for held by another receiver.
func IsNoSession(err error) bool {
	return IsCond(err, CondTimeout) || IsCond(err, CondSessionCannotBeLocked)
}

// Session is the source of a session link: its receiver, which it ends
// with [driver.ErrSourceDone] when the session has been idle (no message,
// nothing held) for the idle timeout, and the renewal of the session's
// lock, which a goroutine keeps up while the link lives.
type Session struct {
	*amqp.Receiver
	id   string
	idle time.Duration
	slot int
	mgmt *Management
	book *Leases
	// held counts the deliveries of the session's pipe held now.
	held    func() int
	log     *zap.Logger
	limited *loglimit.Logger

	cancel context.CancelFunc // ends the renewal
	done   chan struct{}      // closed when the renewal has returned
}

// SessionConfig is what a session link is accepted with.
type SessionConfig struct {
	Idle    time.Duration // the SessionIdleTimeout
	Slot    int           // the consumer's slot, for the log
	Leases  *Leases       // the book of the slot's deliveries
	Held    func() int    // how many deliveries the slot holds
	Log     *zap.Logger
	Limited *loglimit.Logger // for the lines that can repeat
}

// AcceptSession takes the session rcv was granted, whose $management node
// is mgmt, and starts renewing its lock; Stop ends that.
func AcceptSession(rcv *amqp.Receiver, mgmt *Management, c SessionConfig) (*Session, error) {
	id, _ := rcv.LinkSourceFilterValue(sessionFilter).(string)
	if id == "" {
		return nil, errors.New("amqpsub: the service granted no session id in its attach")
	}
	until, sent := ticksTime(rcv.Properties()["com.microsoft:locked-until-utc"])
	if !sent {
		until = time.Now() // renew at once
	}
	ctx, cancel := context.WithCancel(context.Background())
	src := &Session{Receiver: rcv, id: id, idle: c.Idle, slot: c.Slot, mgmt: mgmt, book: c.Leases, held: c.Held,
		log: c.Log, limited: c.Limited, cancel: cancel, done: make(chan struct{})}
	go src.renew(ctx, until)
	c.Log.Info("session accepted", zap.String("session_id", id), zap.Int("slot", c.Slot),
		zap.Time("locked_until", until), zap.Bool("locked_until_sent", sent))
	return src, nil
}

// ID is the session's id.
func (src *Session) ID() string { return src.id }

// Slot is the consumer's slot that holds the session.
func (src *Session) Slot() int { return src.slot }

// ticksTime converts .NET ticks (100 ns since 0001-01-01 UTC), as Service
// Bus sends com.microsoft:locked-until-utc, to a time.
func ticksTime(v any) (time.Time, bool) {
	ticks, ok := amqpint.Int(v)
	if !ok {
		return time.Time{}, false
	}
	const unixEpochTicks = 621355968000000000
	return time.UnixMilli((ticks - unixEpochTicks) / 10000), true
}

// Receive returns the session's next message, or an error wrapping
// [driver.ErrSourceDone] once the session has been idle for SessionIdleTimeout
// with nothing of it held. When the link is lost, the session's lock went
// with it (a session is locked to its link): every delivery of the session
// is given up at once, before Receive returns the link's error, and the
// context of each handler still running is cancelled with [ErrLockLost].
func (src *Session) Receive(ctx context.Context, opts *amqp.ReceiveOptions) (*amqp.Message, error) {
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
			src.book.LoseAll("the session link was lost")
			return nil, err
		case src.held() == 0:
			return nil, fmt.Errorf("%w: session %q idle for %v", driver.ErrSourceDone, src.id, src.idle)
		}
	}
}

// renew keeps the session's lock up (keepSessionLock) until ctx ends. A
// lock that is lost, or can no longer be renewed, gives up every delivery
// of the session (dropped, or its handler's context cancelled) and closes
// the link, so that the next session is accepted.
func (src *Session) renew(ctx context.Context, until time.Time) {
	defer close(src.done)
	err := keepSessionLock(ctx, until, func(ctx context.Context) (time.Time, error) {
		resp, err := src.mgmt.Request(ctx, "com.microsoft:renew-session-lock", map[string]any{"session-id": src.id})
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
		src.limited.Warn("renewing the session lock failed; trying again", zap.String("session_id", src.id),
			zap.Time("locked_until", until), zap.Error(err))
	})
	if err == nil {
		return // stopped
	}
	src.log.Warn("session lock lost; giving up its deliveries", zap.String("session_id", src.id), zap.Error(err))
	src.book.LoseAll("the session lock was lost")
	// Bounded, and cut short by stop: go-amqp goes on closing the link.
	cctx, cancel := context.WithTimeout(ctx, time.Second)
	defer cancel()
	_ = src.Close(cctx)
}

// A named session that another receiver holds
// (com.microsoft:session-cannot-be-locked) is asked for again after a wait
// that doubles from sessionLockedFloor up to sessionLockedMax, between half
// and all of it (see SessionLockedWait).
const (
	sessionLockedFloor = time.Second
	sessionLockedMax   = 30 * time.Second
)

// SessionLockedWait is the wait before the k-th (from 0) new request for a
// named session that another receiver held: "equal jitter" under
// Ceiling(k, 1 s, 30 s). azservicebus does not retry this condition at all
// (internal/errors.go maps it to RecoveryKindFatal: AcceptSessionForQueue
// returns it to its caller); a consumer of named sessions is that caller,
// and waits for the session to be let go rather than end Run.
func SessionLockedWait(k int) time.Duration {
	c := backoff.Ceiling(k, sessionLockedFloor, sessionLockedMax)
	return c/2 + rand.N(c/2+1) //nolint:gosec // G404: jitter spreads retries; nothing secret depends on it
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
// lock is lost (it returns why).
//
// A renewal goes out at the rule of message locks: once remaining −
// min(remaining/2, 10 s) of the remaining time has passed. A failed request
// is reported to retrying and tried again after half the time left
// (between 250 ms and 2 s), for as long as the lock lasts: the lock is lost
// when it expired, or at once when the service says it is (status 410) or
// the $management link is gone for good.
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
		if errors.Is(err, ErrLockLost) || errors.Is(err, ErrNodeGone) {
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

// Stop ends the renewal and waits for it: at once, since a request in
// progress is cancelled.
func (src *Session) Stop() {
	src.cancel()
	<-src.done
}

// State returns the state stored with the session (nil when none is set),
// from the service, within ctx.
func (src *Session) State(ctx context.Context) ([]byte, error) {
	resp, err := src.mgmt.Request(ctx, "com.microsoft:get-session-state", map[string]any{"session-id": src.id})
	if err != nil {
		return nil, err
	}
	body, _ := resp.Value.(map[string]any)
	state, _ := body["session-state"].([]byte)
	return state, nil
}

// SetState stores state with the session (nil clears it), within ctx.
func (src *Session) SetState(ctx context.Context, state []byte) error {
	var v any
	if state != nil {
		v = state
	}
	_, err := src.mgmt.Request(ctx, "com.microsoft:set-session-state", map[string]any{"session-id": src.id, "session-state": v})
	return err
}
