package amqpsub

import (
	"context"
	"errors"
	"fmt"
	"time"

	"go.uber.org/zap"

	"github.com/amqpsub/amqpsub/internal/backoff"
	"github.com/amqpsub/amqpsub/internal/driver"
	"github.com/amqpsub/amqpsub/internal/wait"
)

// reconnectWait is the wait before reconnect attempt k after err: the
// jittered backoff, and at least the driver's Wait after err (on Service Bus,
// 10 s after the service said it is throttling: the ServerBusyBaseSleepTime
// of Microsoft's .NET clients; azservicebus has no such floor).
func (a *attacher) reconnectWait(err error, k int) time.Duration {
	return max(backoff.Jittered(k, a.s.cfg.backoffMin, a.s.cfg.backoffMax), a.s.cfg.profile.drv.Wait(err))
}

func (a *attacher) attach(ctx context.Context, lost error) (driver.Source, error) {
	s := a.s
	a.p.lostLink()
	a.p.kind.SourceAttached(nil)
	first := 0
	moveOn := errors.Is(lost, driver.ErrSourceDone) // a session consumer's next session
	defer a.closeSpare(ctx)
	defer a.endRetired(ctx, lost)
	if a.current != nil {
		a.from = a.current.index
		switch {
		case moveOn && live(a.current.conn):
			// The next session is asked for on the same connection.
			a.p.current.Store(nil)
			cctx, cancel := context.WithTimeout(ctx, s.cfg.closeTimeout)
			s.closeSession(cctx, a.current, lost)
			cancel()
			a.spare = &link{connection: a.current.connection, kind: a.p.kind}
		case !moveOn && lost != nil && live(a.current.conn) && a.p.kind.ReattachOn(ctx, a.current.reclaim, lost, false):
			// The link is attached again on its connection. Where a lost
			// link's deliveries stay settleable (LeasesOutliveLinks), the
			// lost one stays the pipe's current link until the next is
			// up: what its kind added beside it (Service Bus's
			// $management node, on its AMQP session) serves them
			// meanwhile. Otherwise (a Service Bus session, whose locks
			// went with its link) its AMQP session goes now.
			if a.p.keeps {
				a.retired = a.current
			} else {
				a.p.current.Store(nil)
				cctx, cancel := context.WithTimeout(ctx, s.cfg.closeTimeout)
				s.closeSession(cctx, a.current, lost)
				cancel()
			}
			a.spare = &link{connection: a.current.connection, kind: a.p.kind}
		default:
			if !moveOn {
				a.from++ // a lost link: its address is tried last
			}
			a.p.current.Store(nil)
			s.closeLink(ctx, a.current, lost)
		}
		a.current = nil
	}
	if lost != nil && !moveOn {
		if time.Since(a.attachedAt) < healthy {
			a.quick++
			first = a.quick // start further up the backoff
			d := a.reconnectWait(lost, first-1)
			// Debug: the pump logged the loss ("link lost").
			s.log.Debug("link lost soon after it was attached; backing off", zap.Error(lost),
				zap.Int("in_a_row", a.quick), zap.Duration("wait", d))
			if !wait.Sleep(ctx, d) {
				return nil, ctx.Err()
			}
		} else {
			a.quick = 0
			if d := a.s.cfg.profile.drv.Wait(lost); d > 0 {
				// A healthy link the broker ended for throttling:
				// reattaching at once would only be refused again.
				if !wait.Sleep(ctx, d) {
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
			a.endRetired(ctx, lost)
			s.attached(a.p, l)
			if l == nil {
				a.p.kind.SourceAttached(src)
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
				a.p.kind.SourceAttached(nil)
				a.current = nil
				if l != nil { // nil under a test source
					s.closeLink(context.WithoutCancel(ctx), l, nil)
				}
				return nil, ctx.Err()
			}
			return src, nil
		}
		refused, heldWait := a.p.kind.Refused(err, attempt-first)
		noSession := refused != driver.RefusedNot
		waiting := s.cfg.waitForQueue && isNotFound(err) || noSession
		switch {
		case ctx.Err() != nil:
			return nil, ctx.Err()
		case refused == driver.RefusedNoneFree:
			// The service waited for a session to become free and none
			// did: ask again at once (on the same connection).
			a.served = true
			s.log.Debug("no session available; asking again", zap.Error(err))
			attempt = first - 1
			if time.Since(asked) < s.cfg.backoffMin {
				// Answered at once rather than after waiting (the service
				// waits up to the accept timeout): do not ask in a loop.
				if !wait.Sleep(ctx, s.cfg.backoffMin) {
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
		pause := a.reconnectWait(err, attempt)
		if refused == driver.RefusedHeld {
			// Another receiver holds what was asked for (a named
			// session): ask again, on the same connection, after the
			// kind's wait.
			pause = heldWait
		}
		if !waiting {
			s.log.Warn("reconnect failed; trying again", zap.Int("attempt", attempt-first+1), zap.Duration("wait", pause), zap.Error(err))
			s.events.send(Event{Kind: EventReconnectFailed, Err: err, Queue: s.queue, Lane: -1, Attempt: attempt - first + 1})
		}
		if !wait.Sleep(ctx, pause) {
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

// attachOnce opens a connection, session and receiver, or takes the test
// source.
func (s *Subscriber) attachOnce(ctx context.Context, p *pipe) (driver.Source, *link, error) {
	if c, ok := s.connector.(sourceConnector); ok {
		src, err := c.attach(ctx, s, p)
		return src, nil, err
	}
	l, err := s.attach(ctx, p)
	if err != nil {
		return nil, nil, err
	}
	if err := p.kind.Ready(ctx, l); err != nil {
		s.closeLink(ctx, l, nil)
		return nil, nil, err
	}
	return l.src, l, nil
}

// endRetired closes what the lost link kept open while the next was
// attached (see attach): once the next link is up (a.current), its AMQP
// session and what the kind added there, or the whole connection if the
// next link is on another one. When attach returns without a link
// (stopping), the lost link is kept as the current one while its
// connection is open, so that what its kind added beside it serves the
// stop (Service Bus: the deliveries decided during the grace settle by
// lock token on its $management node); Run closes it with the rest.
func (a *attacher) endRetired(ctx context.Context, lost error) {
	old := a.retired
	if old == nil {
		return
	}
	a.retired = nil
	switch {
	case a.current != nil && a.current.connection == old.connection:
		cctx, cancel := context.WithTimeout(ctx, a.s.cfg.closeTimeout)
		a.s.closeSession(cctx, old, lost)
		cancel()
	case a.current == nil && live(old.conn) && a.spare != nil && a.spare.connection == old.connection:
		a.spare = nil
		a.current = old
	default:
		if a.p.current.Load() == old {
			a.p.current.Store(nil)
		}
		if a.spare != nil && a.spare.connection == old.connection {
			a.spare = nil // closed with old
		}
		a.s.closeLink(context.WithoutCancel(ctx), old, lost)
	}
}

// closeSpare closes the connection kept for the next attach, if the
// attacher returns without having used it.
func (a *attacher) closeSpare(ctx context.Context) {
	if a.spare != nil {
		a.s.closeLink(ctx, a.spare, nil)
		a.spare = nil
	}
}
