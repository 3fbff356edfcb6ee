package amqpsub

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/Azure/go-amqp"
	"go.uber.org/zap"

	"github.com/amqpsub/amqpsub/lease"
	"github.com/amqpsub/amqpsub/pump"
)

// Service Bus conditions of session receivers.
const (
	errCondTimeout               amqp.ErrCond = "com.microsoft:timeout"
	errCondSessionCannotBeLocked amqp.ErrCond = "com.microsoft:session-cannot-be-locked"
	sessionFilter                             = "com.microsoft:session-filter"
	sessionFilterCode            uint64       = 0x000001370000000C
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
	ro.Properties = map[string]any{"com.microsoft:timeout": uint32(wait / time.Millisecond)}
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

	stopOnce sync.Once
	quit     chan struct{}
	done     chan struct{}
}

// startSession takes the session l's receiver was granted, and starts
// renewing its lock.
func (s *Subscriber) startSession(p *pipe, l *link) (*sessionSource, error) {
	id, _ := l.rcv.LinkSourceFilterValue(sessionFilter).(string)
	if id == "" {
		return nil, errors.New("amqpsub: the service granted no session id in its attach")
	}
	until, ok := ticksTime(l.rcv.Properties()["com.microsoft:locked-until-utc"])
	if !ok {
		s.log.Warn("session granted without com.microsoft:locked-until-utc; renewing its lock from now",
			zap.String("session_id", id))
		until = time.Now()
	}
	src := &sessionSource{Receiver: l.rcv, id: id, idle: s.cfg.sessionIdle, p: p, l: l,
		quit: make(chan struct{}), done: make(chan struct{})}
	go src.renew(s, until)
	s.log.Info("session accepted", zap.String("session_id", id), zap.Time("locked_until", until), zap.Int("slot", p.index))
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
		ticks = int64(v)
	default:
		return time.Time{}, false
	}
	const unixEpochTicks = 621355968000000000
	return time.UnixMilli((ticks - unixEpochTicks) / 10000), true
}

// Receive returns the session's next message, or an error wrapping
// pump.ErrSourceDone once the session has been idle for SessionIdleTimeout
// with nothing of it held.
func (src *sessionSource) Receive(ctx context.Context, opts *amqp.ReceiveOptions) (*amqp.Message, error) {
	for {
		rctx, cancel := context.WithTimeout(ctx, src.idle)
		m, err := src.Receiver.Receive(rctx, opts)
		cancel()
		switch {
		case err == nil:
			return m, nil
		case ctx.Err() != nil || !errors.Is(err, context.DeadlineExceeded):
			return nil, err
		case src.p.pump.Held() == 0:
			return nil, fmt.Errorf("%w: session %q idle for %v", pump.ErrSourceDone, src.id, src.idle)
		}
	}
}

// renew keeps the session's lock up, at the same rule as message locks,
// until stop. A lock the service refuses is lost: every delivery of the
// session is given up (dropped, or its handler's context cancelled) and
// the link is closed, so that the next session is accepted.
func (src *sessionSource) renew(s *Subscriber, until time.Time) {
	defer close(src.done)
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	for {
		now := time.Now()
		remaining := until.Sub(now)
		wait := remaining - min(remaining/2, 10*time.Second)
		timer.Reset(max(0, wait))
		select {
		case <-src.quit:
			return
		case <-timer.C:
		}
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		go func() {
			select {
			case <-src.quit:
				cancel()
			case <-ctx.Done():
			}
		}()
		resp, err := src.l.mgmt.request(ctx, "com.microsoft:renew-session-lock", map[string]any{"session-id": src.id})
		cancel()
		if err == nil {
			body, _ := resp.Value.(map[string]any)
			if exp, ok := body["expiration"].(time.Time); ok {
				until = exp
				continue
			}
			err = errors.New("amqpsub: renew-session-lock: no expiration in the answer")
		}
		select {
		case <-src.quit:
			return
		default:
		}
		if !errors.Is(err, lease.ErrLockLost) && time.Until(until) > 0 {
			s.log.Warn("renewing the session lock failed; trying again", zap.String("session_id", src.id), zap.Error(err))
			until = time.Now().Add(min(time.Until(until), 2*time.Second)) // retry at half of what is left, or sooner
			continue
		}
		s.log.Warn("session lock lost; giving up its deliveries", zap.String("session_id", src.id), zap.Error(err))
		src.p.book.LoseAll("the session lock was lost")
		cctx, ccancel := context.WithTimeout(context.Background(), time.Second)
		_ = src.Receiver.Close(cctx)
		ccancel()
		return
	}
}

// stop ends the renewal and waits for it.
func (src *sessionSource) stop() {
	src.stopOnce.Do(func() { close(src.quit) })
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
