package amqpsub

import (
	"context"
	"errors"
	"fmt"
	"net"
	"time"

	"github.com/Azure/go-amqp"
	"github.com/amqpsub/amqpsub/internal/driver"
	"go.uber.org/zap"
)

// link is what one attach opened.
type link struct {
	*connection
	sess *amqp.Session
	rcv  *amqp.Receiver
	dlq  deadLetterSender // DeadLetterCopy's sender on sess
	src  driver.Source    // what the pump receives from: rcv, or what the kind made of it
	kind driver.Pipe      // the pipe's, which releases what it added
	ext  any              // what the pipe's kind keeps of the link; nil for most
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
		l, by = &link{connection: c, kind: p.kind}, cby
	}
	ctx, cancel := context.WithDeadline(ctx, by)
	defer cancel()
	c := l.connection
	conn := c.conn
	var err error
	fail := func(what string, err error) (*link, error) {
		if relink && live(conn) && (ctx.Err() != nil || p.kind.ReattachOn(ctx, c.reclaim, err, true)) {
			// Cut short (a stop, or DialTimeout), or refused as the kind
			// says is worth asking again on the same connection: it
			// stays, for the next attempt and for what the lost link
			// left on it (what it held settles through that meanwhile);
			// only what this attempt opened goes.
			cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), s.cfg.closeTimeout)
			s.closeSession(cctx, l, nil)
			cancel()
			p.att.spare = &link{connection: c, kind: p.kind}
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
	p.kind.ReceiverOptions(ro)
	l.rcv, err = l.sess.NewReceiver(ctx, addr, ro)
	if err != nil {
		if r, _ := p.kind.Refused(err, 0); r != driver.RefusedNot && live(conn) {
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
	src, step, err := p.kind.Attached(ctx, l)
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

// connect opens a connection for an attach, from the address at index from
// on for a DialFailover connector, each address within DialTimeout (see
// failover.pass), or else within DialTimeout; by is when the DialTimeout of
// the address that answered ends.
func (s *Subscriber) connect(ctx context.Context, from int, first bool) (c *connection, by time.Time, err error) {
	req := connectRequest{idle: s.cfg.idleTimeout, entity: s.cfg.profile.drv.Address(s.queue), log: s.log,
		from: from, noWrap: first, timeout: s.cfg.dialTimeout, fatal: s.cfg.isFatal}
	if f, ok := s.connector.(*failover); ok {
		return f.pass(ctx, req)
	}
	by = time.Now().Add(s.cfg.dialTimeout)
	cctx, cancel := context.WithDeadline(ctx, by)
	defer cancel()
	if c, err = s.connector.connect(cctx, req); err != nil {
		return nil, by, timeoutError(cctx, err)
	}
	if c.addr == "" {
		c.addr = s.connector.String()
	}
	return c, by, nil
}

// timeoutError returns err, the error of a connect within ctx, marked as
// ctx's when ctx ended. go-amqp sets the socket's deadline from ctx's, so a
// dial timeout shows as the socket's i/o timeout or as ctx's, whichever
// fires first: it is reported as ctx's either way.
func timeoutError(ctx context.Context, err error) error {
	var nerr net.Error
	if cerr := ctx.Err(); cerr != nil && !errors.Is(err, cerr) {
		return fmt.Errorf("%w: %w", cerr, err)
	} else if _, ok := ctx.Deadline(); ok && cerr == nil && errors.As(err, &nerr) && nerr.Timeout() {
		return fmt.Errorf("%w: %w", context.DeadlineExceeded, err)
	}
	return err
}

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
// what its kind added (a Service Bus session's lock renewal, the
// $management link pair), the receiver, and the AMQP session. The
// connection, and what runs beside it, stay.
func (s *Subscriber) closeSession(ctx context.Context, l *link, why error) {
	l.kind.Release(ctx, l, why, func() {
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
