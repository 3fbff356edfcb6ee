package amqpsub

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/Azure/go-amqp"
	"go.uber.org/zap"

	"github.com/amqpsub/amqpsub/internal/backoff"
	"github.com/amqpsub/amqpsub/internal/driver"
	"github.com/amqpsub/amqpsub/internal/wait"
)

// link is what one attach opened.
type link struct {
	*connection
	sess *amqp.Session
	rcv  *amqp.Receiver
	dlq  deadLetterSender // DeadLetterCopy's sender on sess
	src  driver.Source    // what the pump receives from: rcv, or what the driver made of it
	dp   driver.Pipe      // the pipe's driver part, which releases what it added
	ext  any              // what the pipe's driver keeps of the link; nil for most
}

// attach connects (or takes the given connection), opens a session and
// attaches a receiver to the queue, all within DialTimeout; with
// DialFailover, within the DialTimeout of the address that answered, each
// address tried having its own.
//
// It attaches on the connection (and session) the attacher kept
// (attacher.spare) when it has one: the pipe's driver said that the broker
// refused the last link for want of something to give it
// (driver.Pipe.Refused), the last source ended by itself
// (driver.ErrSourceDone), or the driver attaches a lost link again on its
// connection (driver.Pipe.ReattachOn). A new connection is opened only
// when that one is lost. (On Service Bus this is how a session consumer
// asks for the next session, and how a detached link is recovered.)
func (s *Subscriber) attach(ctx context.Context, p *pipe) (*link, error) {
	l, by := p.att.spare, time.Now().Add(s.cfg.dialTimeout)
	p.att.spare = nil
	// On the connection of a lost link attached again there (see
	// driver.Pipe.ReattachOn), which also carries what the lost link left
	// open until this one is up.
	relink := l != nil && p.att.retired != nil && l.connection == p.att.retired.connection
	if l == nil {
		c, cby, err := s.connect(ctx, p.att.from, !p.att.before)
		if err != nil {
			return nil, fmt.Errorf("amqpsub: connect to %s: %w", s.connector, err)
		}
		l, by = &link{connection: c, dp: p.dp}, cby
	}
	ctx, cancel := context.WithDeadline(ctx, by)
	defer cancel()
	c := l.connection
	conn := c.conn
	var err error
	fail := func(what string, err error) (*link, error) {
		if relink && live(conn) && (ctx.Err() != nil || p.dp.ReattachOn(ctx, c.reclaim, err, true)) {
			// Cut short (a stop, or DialTimeout), or refused as the driver
			// says is worth asking again on the same connection: it
			// stays, for the next attempt and for what the lost link
			// left on it (what it held settles through that meanwhile);
			// only what this attempt opened goes.
			cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), s.cfg.closeTimeout)
			s.closeSession(cctx, l, nil)
			cancel()
			p.att.spare = &link{connection: c, dp: p.dp}
			return nil, fmt.Errorf("amqpsub: %s on %s queue %q: %w", what, c.addr, s.queue, err)
		}
		s.closeLink(ctx, l, nil)
		if !c.owned && conn.Err() != nil {
			// A connection the caller gave us is gone: we cannot dial
			// another.
			err = fmt.Errorf("%w: %w", ErrLinkLost, err)
		}
		// The next attach starts at the address after this one.
		p.att.from = c.index + 1
		p.att.connected = true
		return nil, fmt.Errorf("amqpsub: %s on %s queue %q: %w", what, c.addr, s.queue, err)
	}
	if l.sess == nil {
		if l.sess, err = conn.NewSession(ctx, nil); err != nil {
			return fail("open session", err)
		}
	}
	addr := s.cfg.profile.drv.Address(s.queue)
	ro := &amqp.ReceiverOptions{
		Credit:             -1,
		SourceCapabilities: s.cfg.profile.f.SourceCaps,
		Name:               s.cfg.linkName,
	}
	p.dp.ReceiverOptions(ro)
	l.rcv, err = l.sess.NewReceiver(ctx, addr, ro)
	if err != nil {
		if r, _ := p.dp.Refused(err, 0); r != driver.RefusedNot && live(conn) {
			// The broker refused the link for want of something to give
			// it (a Service Bus session) and nothing else: the
			// connection and session stay for the next attach.
			l.rcv = nil
			p.att.spare = l
			return nil, fmt.Errorf("amqpsub: attach receiver on %s queue %q: %w", c.addr, s.queue, err)
		}
		return fail("attach receiver", err)
	}
	if s.cfg.deadLetterCopy != "" {
		// Before any delivery: at the first attach, a dead-letter address
		// the broker refuses fails the attach as a missing queue does,
		// rather than the reasons of the first rejections. At a reconnect
		// the subscriber goes on without it (a queue deleted meanwhile
		// costs the reasons of the copies it refuses, not the consumer);
		// the first copy tries again.
		if l.dlq.snd, err = s.deadLetterSender(ctx, l.sess); err != nil {
			if !p.att.before {
				return fail("attach dead-letter sender", err)
			}
			s.log.Warn("dead-letter address refused at a reconnect; going on, copies will try it again", zap.Error(err))
		}
	}
	src, step, err := p.dp.Attached(ctx, l)
	if err != nil {
		return fail(step, mismatch(err))
	}
	if l.src = src; src == nil {
		l.src = l.rcv
	}
	return l, nil
}

// errQueueMismatch wraps ErrInvalidOption for a queue that does not fit an
// option (a driver's MismatchError), found at an attach.
var errQueueMismatch = fmt.Errorf("%w for this queue", ErrInvalidOption)

// mismatch turns a driver's MismatchError into an errQueueMismatch.
func mismatch(err error) error {
	var me *driver.MismatchError
	if errors.As(err, &me) {
		return fmt.Errorf("%w: %s", errQueueMismatch, me.Detail)
	}
	return err
}

// Conn is l's connection (driver.Link).
func (l *link) Conn() *amqp.Conn { return l.conn }

// Broker names the address l is connected to (driver.Link).
func (l *link) Broker() string { return l.addr }

// Session is l's AMQP session (driver.Link).
func (l *link) Session() *amqp.Session { return l.sess }

// Receiver is l's receiver (driver.Link); nil on a link opened for a node
// only (pipeEnv.OpenSession).
func (l *link) Receiver() *amqp.Receiver { return l.rcv }

// Ext is what the pipe's driver keeps of l (driver.Link).
func (l *link) Ext() any { return l.ext }

// SetExt keeps v with l, for the pipe's driver (driver.Link).
func (l *link) SetExt(v any) { l.ext = v }

// attached logs a link attached for p: l, or a test source when l is nil.
func (s *Subscriber) attached(p *pipe, l *link) {
	name, broker := "", s.connector.String()
	if l != nil {
		broker = l.addr
		if l.rcv != nil {
			name = l.rcv.LinkName()
		}
	}
	var product, version string
	if l != nil && l.conn != nil {
		props := l.conn.Properties()
		product, _ = props["product"].(string)
		version, _ = props["version"].(string)
	}
	s.log.Info("attached", zap.String("broker", broker), zap.String("address", s.cfg.profile.drv.Address(s.queue)),
		zap.String("link", name), zap.Stringer("profile", s.cfg.profile), zap.Int("credit", p.pump.Credit()),
		zap.String("product", product), zap.String("version", version))
	if want := profileFor(product, version); want != "" && want != s.cfg.profile.String() && !s.cfg.profile.f.AnyBroker &&
		!s.profileWarned.Swap(true) {
		s.log.Warn("the broker is not the profile's; give WithProfile the broker's profile",
			zap.String("product", product), zap.String("version", version),
			zap.Stringer("profile", s.cfg.profile), zap.String("suggested", want))
	}
}

// closeLink closes what l opened, all steps within CloseTimeout and before
// ctx ends; why is what ended it (nil: a stop), for the log. Brokers that
// never answer a detach (RabbitMQ 3.10) get their session closed instead.
// A connection the subscriber owns whose close is still waiting at the end
// (on a write to a peer that no longer reads) has its socket closed under
// it.
func (s *Subscriber) closeLink(ctx context.Context, l *link, why error) {
	// A close whose time had run out before it began (a stop past its
	// bound) did not take too long: its socket is closed at once, unsaid.
	// One that used up CloseTimeout on the way (a peer that stopped
	// answering) did, and says so.
	late := ctx.Err() != nil
	ctx, cancel := context.WithTimeout(ctx, s.cfg.closeTimeout)
	defer cancel()
	s.closeSession(ctx, l, why)
	if l.stop != nil {
		l.stop()
	}
	if !l.owned {
		return
	}
	closed := make(chan error, 1)
	go func() { closed <- l.conn.Close() }()
	var err error
	select {
	case err = <-closed:
	case <-ctx.Done():
		if !late {
			s.log.Debug("connection close took too long; closing its socket")
		}
		if l.abort != nil {
			l.abort()
		}
		err = <-closed
	}
	if err != nil {
		var ce *amqp.ConnError
		if !errors.As(err, &ce) || ce.RemoteErr != nil {
			s.log.Debug("close connection", zap.Error(err))
		}
	}
}

// closeSession closes what l opened on its connection, before ctx ends:
// what its driver added (a Service Bus session's lock renewal, the
// $management link pair), the receiver, and the AMQP session. The
// connection, and what runs beside it, stay.
func (s *Subscriber) closeSession(ctx context.Context, l *link, why error) {
	l.dp.Release(ctx, l, why, func() {
		if l.rcv != nil && s.cfg.profile.f.Detach {
			if err := l.rcv.Close(ctx); err != nil {
				s.log.Debug("close receiver", zap.Error(err))
			}
		}
		if l.sess != nil {
			if err := l.sess.Close(ctx); err != nil {
				s.log.Debug("close session", zap.Error(err))
			}
		}
	})
}

// live reports whether conn is still open.
func live(conn *amqp.Conn) bool {
	select {
	case <-conn.Done():
		return false
	default:
		return true
	}
}

// closeWithin closes l, ending by the deadline by.
func (s *Subscriber) closeWithin(l *link, by time.Time) {
	ctx, cancel := context.WithDeadline(context.Background(), by)
	defer cancel()
	s.closeLink(ctx, l, nil)
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
	// Also the connection of a lost link that is attached again on it
	// (driver.Pipe.ReattachOn).
	spare *link
	// retired is the lost link whose connection is spare, kept open, and
	// the pipe's current link, until the next link is up (see
	// endRetired).
	retired *link
}

// healthy is how long a link must have lived for its loss to count as
// unrelated to the one before.
const healthy = 10 * time.Second

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
	a.p.dp.SourceAttached(nil)
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
			a.spare = &link{connection: a.current.connection, dp: a.p.dp}
		case !moveOn && lost != nil && live(a.current.conn) && a.p.dp.ReattachOn(ctx, a.current.reclaim, lost, false):
			// The link is attached again on its connection. Where a lost
			// link's deliveries stay settleable (LeasesOutliveLinks), the
			// lost one stays the pipe's current link until the next is
			// up: what its driver added beside it (Service Bus's
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
			a.spare = &link{connection: a.current.connection, dp: a.p.dp}
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
				a.p.dp.SourceAttached(src)
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
				a.p.dp.SourceAttached(nil)
				a.current = nil
				if l != nil { // nil under a test source
					s.closeLink(context.WithoutCancel(ctx), l, nil)
				}
				return nil, ctx.Err()
			}
			return src, nil
		}
		refused, heldWait := a.p.dp.Refused(err, attempt-first)
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
			// driver's wait.
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
	if err := p.dp.Ready(ctx, l); err != nil {
		s.closeLink(ctx, l, nil)
		return nil, nil, err
	}
	return l.src, l, nil
}

// endRetired closes what the lost link kept open while the next was
// attached (see attach): once the next link is up (a.current), its AMQP
// session and what the driver added there, or the whole connection if the
// next link is on another one. When attach returns without a link
// (stopping), the lost link is kept as the current one while its
// connection is open, so that what its driver added beside it serves the
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
