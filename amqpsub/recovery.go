package amqpsub

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/Azure/go-amqp"
	"go.uber.org/zap"

	"github.com/amqpsub/amqpsub/internal/backoff"
	"github.com/amqpsub/amqpsub/internal/wire"
	"github.com/amqpsub/amqpsub/lease"
	"github.com/amqpsub/amqpsub/pump"
)

// IsFatal is the default test of FatalErrors. It takes as fatal what
// reconnecting cannot mend: the broker refusing the credentials (a SASL
// outcome of auth or sys-perm, whatever the mechanism) or access
// (amqp:unauthorized-access), an address that does not exist
// (amqp:not-found), a link the broker will not attach as asked
// (amqp:invalid-field, amqp:not-implemented, and amqp:illegal-state, which
// Artemis sends for capability "queue" on a multicast address), and a
// connection given with Conn that is gone (ErrLinkLost), and a connector
// given something it cannot use (ErrInvalidOption: a Service Bus token
// without an expiry, say). Lost connections,
// links and sessions, timeouts and refused TCP connections are not fatal.
// It judges the errors of attempts to reconnect (any error of the first
// attach ends Run), and with DialFailover each address's error in a pass
// (a fatal one ends the pass and Run, on the first attach too), never what
// ended a link: a link Service Bus detaches with amqp:unauthorized-access
// when its token expired is reconnected (with a new token); a reconnect
// refused so ends Run.
//
// On Service Bus it takes as fatal what azservicebus does
// (internal/errors.go, its recovery kinds): amqp:unauthorized-access, a
// missing entity (amqp:not-found, which is how the service refuses an
// attach to an entity that does not exist; see WaitForQueue to wait for
// one instead), and com.microsoft:entity-disabled (an entity an operator
// disabled stays so until one enables it). com.microsoft:server-busy is
// not fatal: the service is throttling, and the next attempt waits at
// least 10 s (serverBusyWait); com.microsoft:timeout is not fatal either.
func IsFatal(err error) bool {
	var ae *amqp.Error
	if errors.As(err, &ae) {
		switch ae.Condition {
		case amqp.ErrCondUnauthorizedAccess, amqp.ErrCondNotFound,
			amqp.ErrCondInvalidField, amqp.ErrCondNotImplemented, amqp.ErrCondIllegalState,
			errCondEntityDisabled:
			return true
		}
	}
	var se *wire.SASLError
	if errors.As(err, &se) {
		// sys and sys-temp are the peer's own trouble: try again.
		return se.Code == wire.SASLAuth || se.Code == wire.SASLSysPerm
	}
	return errors.Is(err, ErrLinkLost) || errors.Is(err, ErrInvalidOption)
}

// Service Bus's error conditions that IsFatal and the backoff judge.
const (
	errCondEntityDisabled amqp.ErrCond = "com.microsoft:entity-disabled"
	errCondServerBusy     amqp.ErrCond = "com.microsoft:server-busy"
)

// serverBusyWait is the least wait after a server-busy error: the
// ServerBusyBaseSleepTime of Microsoft's .NET clients
// (Azure.Messaging.ServiceBus ServiceBusRetryPolicy). azservicebus has no
// such floor (it retries server-busy with its usual backoff, from 4 s).
const serverBusyWait = lease.ServerBusyWait

// reconnectWait is the wait before attempt k (a reconnect, or a
// settlement sent again) after err: the jittered backoff, and at least
// serverBusyWait when the service said it is throttling (the condition
// com.microsoft:server-busy, or a $management answer that wraps
// lease.ErrServerBusy).
func reconnectWait(err error, k int, floor, ceiling time.Duration) time.Duration {
	wait := backoff.Jittered(k, floor, ceiling)
	if isCond(err, errCondServerBusy) || errors.Is(err, lease.ErrServerBusy) {
		wait = max(wait, serverBusyWait)
	}
	return wait
}

func isNotFound(err error) bool { return isCond(err, amqp.ErrCondNotFound) }

func isCond(err error, cond amqp.ErrCond) bool {
	var ae *amqp.Error
	return errors.As(err, &ae) && ae.Condition == cond
}

// isNoSession reports the attach errors of a Service Bus session receiver
// that mean "wait": no session free before the service's timeout, or the
// session asked for held by another receiver.
func isNoSession(err error) bool {
	return isCond(err, errCondTimeout) || isCond(err, errCondSessionCannotBeLocked)
}

// attacher gives the pump its links: the first one at start, and a new one,
// after backoff, each time a link is lost. The pump calls it from one
// goroutine at a time, and Run reads current once the pump has returned.
type attacher struct {
	s          *Subscriber
	p          *pipe
	current    *link // nil under the test source
	before     bool  // a link was attached before: this is a reconnect
	attachedAt time.Time
	// quick counts the links in a row lost soon after they were attached.
	// A link the broker or go-amqp ends at once, every time, would
	// otherwise be reattached in a tight loop: go-amqp v1.7 closes the link
	// on a message it cannot decode (an AMQP char, say), and the broker
	// sends that message first again.
	quick int
	// from is where the next connect starts in a DialFailover list: the
	// address after the one whose connection ended last, lost or closed
	// after a failed attach (see attach). Only this attacher's goroutine
	// reads or moves it.
	from int
	// served is set once the service has answered an attach of a session
	// consumer that holds no session yet (no session free, or the one
	// named held elsewhere): the queue and the credentials are good, so a
	// later failure, such as a lost connection, is reconnected like the
	// loss of a link, not reported as the first attach's.
	served bool
	// connected is set by attach when its connect succeeded and the
	// session or link then failed: with DialFailover, the first attach
	// goes on to the next address rather than fail.
	connected bool
	// spare is, for a session consumer, the connection (and AMQP session,
	// if any) kept for the next attach: the service refused the last one
	// for want of a session, or this slot moved on from an idle session.
	// attach takes it; the attacher closes it when it returns without.
	spare *link
}

// healthy is how long a link must have lived for its loss to count as
// unrelated to the one before.
const healthy = 10 * time.Second

func (a *attacher) attach(ctx context.Context, lost error) (pump.Source, error) {
	s := a.s
	a.p.lostLink()
	a.p.sourceRenewer.Store(nil)
	first := 0
	moveOn := errors.Is(lost, pump.ErrSourceDone) // a session consumer's next session
	defer a.closeSpare(ctx)
	if a.current != nil {
		a.from = a.current.index
		if !moveOn {
			a.from++ // a lost link: its address is tried last
		}
		a.p.current.Store(nil)
		if moveOn && live(a.current.conn) {
			// The next session is asked for on the same connection.
			cctx, cancel := context.WithTimeout(ctx, s.cfg.closeTimeout)
			s.closeSession(cctx, a.current, lost)
			cancel()
			a.spare = &link{connection: a.current.connection}
		} else {
			s.closeLink(ctx, a.current, lost)
		}
		a.current = nil
	}
	if lost != nil && !moveOn {
		if time.Since(a.attachedAt) < healthy {
			a.quick++
			first = a.quick // start further up the backoff
			wait := reconnectWait(lost, first-1, s.cfg.backoffMin, s.cfg.backoffMax)
			// Debug: the pump logged the loss ("link lost").
			s.log.Debug("link lost soon after it was attached; backing off", zap.Error(lost),
				zap.Int("in_a_row", a.quick), zap.Duration("wait", wait))
			if !sleep(ctx, wait) {
				return nil, ctx.Err()
			}
		} else {
			a.quick = 0
			if isCond(lost, errCondServerBusy) {
				// A healthy link the service ended for throttling:
				// reattaching at once would only be refused again.
				if !sleep(ctx, serverBusyWait) {
					return nil, ctx.Err()
				}
			}
		}
	}
	passes := 0        // first attach with DialFailover: addresses that connected but failed
	var failed []error // their errors, for the one Run returns
	for attempt := first; ; attempt++ {
		a.connected = false
		asked := time.Now()
		src, l, err := s.attachOnce(ctx, a.p)
		if err == nil {
			a.current, a.attachedAt = l, time.Now()
			a.p.attachedLink(l)
			s.attached(a.p, l)
			if l == nil {
				if rn, ok := src.(lease.Renewer); ok {
					// A test source that renews its own locks (see renewer).
					a.p.sourceRenewer.Store(&rn)
				}
			}
			if a.before && !moveOn {
				n := attempt - first + 1
				broker := s.connector.String()
				if l != nil { // nil under a test source
					broker = l.addr
				}
				s.reconnects.Add(1)
				s.log.Info("reconnected", zap.Int("attempt", n), zap.String("broker", broker), zap.Error(lost))
				s.events.send(Event{Kind: EventReconnected, Err: lost, Queue: s.queue, Lane: -1, Attempt: n, Broker: broker})
				if s.cfg.onReconnect != nil {
					s.inOnReconnect.Add(1)
					s.cfg.onReconnect(n, lost)
					s.inOnReconnect.Add(-1)
				}
			}
			a.before = true
			if ctx.Err() != nil {
				// Stopped while OnReconnect ran: nobody will use the new
				// link, and Run no longer closes it.
				a.p.current.Store(nil)
				a.p.sourceRenewer.Store(nil)
				a.current = nil
				if l != nil { // nil under a test source
					s.closeLink(context.WithoutCancel(ctx), l, nil)
				}
				return nil, ctx.Err()
			}
			return src, nil
		}
		noSession := s.cfg.sessions() && isNoSession(err)
		waiting := s.cfg.waitForQueue && isNotFound(err) || noSession
		switch {
		case ctx.Err() != nil:
			return nil, ctx.Err()
		case noSession && isCond(err, errCondTimeout):
			// The service waited for a session to become free and none
			// did: ask again at once (on the same connection).
			a.served = true
			s.log.Debug("no session available; asking again", zap.Error(err))
			attempt = first - 1
			if time.Since(asked) < s.cfg.backoffMin {
				// Answered at once rather than after waiting (the service
				// waits up to the accept timeout): do not ask in a loop.
				if !sleep(ctx, s.cfg.backoffMin) {
					return nil, ctx.Err()
				}
			}
			continue
		case waiting:
			// The service answered: what fails after this is a reconnect.
			a.served = a.served || noSession
			if attempt == first {
				s.log.Info("the queue or session is not available (yet); waiting for it", zap.Error(err))
			}
		case !a.before && !a.served && a.connected && s.failoverLeft(&passes) && !s.cfg.isFatal(err):
			// The first connection, on an address that answered but could
			// not serve the queue: try the others before giving up.
			s.log.Warn("attach failed on an address that answered; trying the next", zap.Error(err))
			failed = append(failed, err)
			attempt = first - 1
			continue
		case !a.before && !a.served:
			// The first connection: report it rather than wait, with what
			// the addresses passed over said.
			return nil, errors.Join(append(failed, err)...)
		case s.cfg.isFatal(err):
			// Run logs it as it stops ("stopping after a fatal error").
			if errors.Is(err, ErrLinkLost) {
				return nil, err
			}
			return nil, fmt.Errorf("%w: reconnecting failed: %w", ErrLinkLost, err)
		}
		wait := reconnectWait(err, attempt, s.cfg.backoffMin, s.cfg.backoffMax)
		if noSession {
			// Another receiver holds the named session: ask again (on
			// the same connection) after a wait that grows to 30 s.
			wait = sessionLockedWait(attempt - first)
		}
		if !waiting {
			s.log.Warn("reconnect failed; trying again", zap.Int("attempt", attempt-first+1), zap.Duration("wait", wait), zap.Error(err))
			s.events.send(Event{Kind: EventReconnectFailed, Err: err, Queue: s.queue, Lane: -1, Attempt: attempt - first + 1})
		}
		if !sleep(ctx, wait) {
			return nil, ctx.Err()
		}
	}
}

// failoverLeft reports, for a DialFailover connector, whether another
// address is left to try on the first attach, counting the one that failed.
func (s *Subscriber) failoverLeft(passes *int) bool {
	f, ok := s.connector.(*failover)
	if !ok {
		return false
	}
	*passes++
	return *passes < len(f.addrs)
}

// sleep waits d or until ctx ends; false means ctx ended.
func sleep(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}

// attachOnce opens a connection, session and receiver, or takes the test
// source.
func (s *Subscriber) attachOnce(ctx context.Context, p *pipe) (pump.Source, *link, error) {
	if s.cfg.testSource != nil {
		src, err := s.cfg.testSource(ctx)
		return src, nil, err
	}
	if c, ok := s.connector.(sourceConnector); ok {
		src, err := c.next(ctx)
		return src, nil, err
	}
	l, err := s.attach(ctx, p)
	if err != nil {
		return nil, nil, err
	}
	if l.session != nil {
		if err := s.awaitSession(ctx, l.session); err != nil {
			s.closeLink(ctx, l, nil)
			return nil, nil, err
		}
		return l.session, l, nil
	}
	if p.fallback != nil {
		return sbReceiver{Receiver: l.rcv, fb: p.fallback}, l, nil
	}
	return l.rcv, l, nil
}

// closeSpare closes the connection kept for the next attach, if the
// attacher returns without having used it.
func (a *attacher) closeSpare(ctx context.Context) {
	if a.spare != nil {
		a.s.closeLink(ctx, a.spare, nil)
		a.spare = nil
	}
}
