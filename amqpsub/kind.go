package amqpsub

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/Azure/go-amqp"
	"go.uber.org/zap"

	"github.com/amqpsub/amqpsub/internal/driver"

	"github.com/amqpsub/amqpsub/internal/pump"
)

// brokerKind is what a profile adds to the links of one pipe: the plain
// kind (plainKind) over the profile's driver (package internal/driver,
// the seam every broker's facts and behaviour come through), or, for a
// profile that makes its own, Service Bus's kind (sbkind.go: peek-lock,
// the lease book that renews locks, settlements by lock token once a link
// is gone, the $management node beside each link, and sessions).
//
// The core calls these methods and nothing else of a kind: attach.go
// (receiverOptions, refused, attached, reattachOn, release), reconnect.go
// (attachedSource, reattachOn, refused, ready), pipe.go (configure),
// run.go (start, attachedSource, returnsCounted), handle.go
// (handlerContext), settle.go (settle), stats.go (addLocks) and
// testhook.go (checkSource). Besides, servicebus.go, the Service Bus API,
// reads what its kind keeps on a link (link.ext, through link.sb).
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
	// checkSource checks a test source (package amqpsubtest) attached in
	// place of a link, as attached checks a link; step names what failed.
	checkSource(src driver.Source) (step string, err error)
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

// plainKind is the kind of every profile that makes no kind of its own
// (all but AzureServiceBus, this round): it adds what its driver's pipe
// part adds (driver.Pipe: the queue's check at attach, the outcome sent,
// whether returns count), nothing when the driver has none.
type plainKind struct {
	p  *pipe
	dp driver.Pipe // nil: the driver adds nothing
}

// newPlainKind is the plain kind of p under its profile's driver.
func newPlainKind(p *pipe) plainKind {
	return plainKind{p: p, dp: p.s.cfg.profile.drv.NewPipe(pipeEnv{p.s})}
}

func (plainKind) configure(*pump.Config)                                     {}
func (plainKind) start(context.Context) func()                               { return func() {} }
func (plainKind) receiverOptions(*amqp.ReceiverOptions)                      {}
func (plainKind) ready(context.Context, *link) error                         { return nil }
func (plainKind) attachedSource(driver.Source)                               {}
func (plainKind) refused(error, int) (refusal, time.Duration)                { return refusedNot, 0 }
func (plainKind) addLocks(*Locks)                                            {}
func (plainKind) reattachOn(context.Context, *connection, error, bool) bool  { return false }
func (plainKind) release(_ context.Context, _ *link, _ error, detach func()) { detach() }

func (k plainKind) returnsCounted() bool { return k.dp != nil && k.dp.ReturnsCounted() }

func (k plainKind) attached(ctx context.Context, l *link) (driver.Source, string, error) {
	if k.dp != nil {
		if step, err := k.dp.Attached(ctx, l.conn); err != nil {
			return nil, step, mismatch(err)
		}
	}
	return l.rcv, "", nil
}

// checkSource is attached for a test source attached in place of a link.
func (k plainKind) checkSource(src driver.Source) (step string, err error) {
	if k.dp == nil {
		return "", nil
	}
	step, err = k.dp.AttachedSource(src)
	return step, mismatch(err)
}

func (k plainKind) settle(t driver.Ticket, o driver.Outcome, _ int) {
	if k.dp != nil {
		o = k.dp.Settle(o)
	}
	k.p.pump.Settle(t, o)
}

func (plainKind) handlerContext(ctx context.Context, _ ...driver.Ticket) (context.Context, func()) {
	return ctx, func() {}
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

// pipeEnv is what a driver's pipe part reads of the subscriber.
type pipeEnv struct{ s *Subscriber }

func (e pipeEnv) Log() *zap.Logger      { return e.s.log }
func (e pipeEnv) Queue() string         { return e.s.queue }
func (e pipeEnv) MaxDeliveryCount() int { return int(e.s.cfg.maxDelivery) }
