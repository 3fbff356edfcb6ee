package amqpsub

import (
	"context"
	"time"

	"github.com/Azure/go-amqp"

	"github.com/amqpsub/amqpsub/internal/driver"

	"github.com/amqpsub/amqpsub/internal/pump"
)

// brokerKind is what a kind of broker adds to the links of one pipe, and
// the only place where kinds differ beyond their Profile's settings. The
// core (attach.go, reconnect.go, pipe.go, run.go, handle.go, settle.go,
// stats.go) calls these methods and nothing else of a kind; only
// servicebus.go, the Service Bus API, reads what its kind put on a link
// (link.sb).
//
// plainKind, for Artemis, RabbitMQ 3 and any other AMQP 1.0 broker, adds
// nothing. RabbitMQ 4's kind (rabbitmq4.go) reads the queue's type at each
// attach, and settles a Reject on a quorum queue as modified. Service
// Bus's kind (sbkind.go) adds peek-lock: the lease book
// (servicebus.Leases) that renews locks, settlements sent concurrently in
// each group's order and by lock token once a link is gone, the
// $management node beside each link, and sessions.
type brokerKind interface {
	// configure adds to the pipe's pump configuration, once, as the pipe
	// is made.
	configure(pc *pump.Config)
	// start starts what runs beside the pipe while Run runs; stop ends it
	// and waits for it, after the pump has returned.
	start(ctx context.Context) (stop func())
	// receiverOptions adds to the options of the pipe's receive links.
	receiverOptions(ro *amqp.ReceiverOptions)
	// attached runs once l's receiver is attached, within ctx: it opens
	// what the kind adds beside the receiver and returns the source the
	// pump receives from. On an error, step names what failed, and the
	// caller closes l.
	attached(ctx context.Context, l *link) (src driver.Source, step string, err error)
	// ready runs once attach has returned l, within the attacher's ctx
	// (not the attach's DialTimeout): it waits until l may be handed to
	// the pump. On an error the caller closes l.
	ready(ctx context.Context, l *link) error
	// attachedSource is told of a test source attached in place of a link
	// (package amqpsubtest), and of nil when it is lost.
	attachedSource(src driver.Source)
	// release closes what l opened on its AMQP session, within ctx:
	// detach closes the receiver and the session, between what the kind
	// ends before (a session's lock renewal) and what it waits for after.
	// why is what ended the link (nil: a stop), for the log.
	release(ctx context.Context, l *link, why error, detach func())
	// reattachOn says whether a link lost with lost (not a source done)
	// is attached again on c, its connection, still open (true), or c is
	// closed and a new connection made (false). It may first prepare c
	// for the link, within ctx (fresh credentials). refused says that
	// lost is the broker's refusal of such an attach on c.
	reattachOn(ctx context.Context, c *connection, lost error, refused bool) bool
	// refused reads an attach error of the attempt-th attempt in a row
	// (from 0); for refusedHeld, wait is how long to wait before the next.
	refused(err error, attempt int) (r refusal, wait time.Duration)
	// handlerContext returns the context for a handler of ts, derived from
	// ctx; done releases it.
	handlerContext(ctx context.Context, ts ...driver.Ticket) (hctx context.Context, done func())
	// settle hands t's settlement (o) to the pipe's pump; lane is the
	// delivery's lane, -1 when it is not known.
	settle(t driver.Ticket, o driver.Outcome, lane int)
	// addLocks adds the kind's lock counters to l.
	addLocks(l *Locks)
	// returnsCounted says whether the broker counts a release as a
	// delivery attempt (a RabbitMQ quorum queue does), as far as the kind
	// knows now: a graceful stop then finishes what is buffered before it
	// releases anything (see Run).
	returnsCounted() bool
}

// refusal is how a kind reads an attach error.
type refusal uint8

const (
	// refusedNot: a failure like any other, judged by FatalErrors and
	// retried after backoff.
	refusedNot refusal = iota
	// refusedNoneFree: nothing became free to attach to in time (no
	// Service Bus session): ask again at once, on the same connection.
	refusedNoneFree
	// refusedHeld: what was asked for is held by another receiver (a
	// named session): ask again on the same connection, after
	// the wait refused gives.
	refusedHeld
)

// plainKind is the kind of every broker but Service Bus: it adds nothing.
type plainKind struct{ p *pipe }

func (plainKind) configure(*pump.Config)                                     {}
func (plainKind) start(context.Context) func()                               { return func() {} }
func (plainKind) receiverOptions(*amqp.ReceiverOptions)                      {}
func (plainKind) ready(context.Context, *link) error                         { return nil }
func (plainKind) attachedSource(driver.Source)                               {}
func (plainKind) refused(error, int) (refusal, time.Duration)                { return refusedNot, 0 }
func (plainKind) addLocks(*Locks)                                            {}
func (plainKind) reattachOn(context.Context, *connection, error, bool) bool  { return false }
func (plainKind) returnsCounted() bool                                       { return false }
func (plainKind) release(_ context.Context, _ *link, _ error, detach func()) { detach() }

func (plainKind) attached(_ context.Context, l *link) (driver.Source, string, error) {
	return l.rcv, "", nil
}

func (k plainKind) settle(t driver.Ticket, o driver.Outcome, _ int) { k.p.pump.Settle(t, o) }

func (plainKind) handlerContext(ctx context.Context, _ ...driver.Ticket) (context.Context, func()) {
	return ctx, func() {}
}
