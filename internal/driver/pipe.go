package driver

import (
	"context"
	"errors"
	"time"

	"github.com/Azure/go-amqp"
	"go.uber.org/zap"

	"github.com/amqpsub/amqpsub/internal/loglimit"
)

// Pipe is what a driver adds to the links of one pipe (a receive path: one
// engine, the lanes behind it, and the links its attacher opens one after
// another). The core makes one per pipe (Driver.NewPipe) and calls:
//
//   - Engine once, as the pipe is made, before its engine exists;
//   - Start as Run begins, and the stop it returns after the engine has
//     returned;
//   - ReceiverOptions, Refused, Attached, Ready and ReattachOn as it
//     attaches a link and reads an attach's failure, in that order of an
//     attach's life; Release as it closes one;
//   - CheckSource and SourceAttached for a test source (package
//     amqpsubtest) attached in place of a link;
//   - HandlerContext as a handler (or a batch handler) begins;
//   - Outcome and SettleOrder on every settlement it hands the engine;
//   - Locks whenever Stats are read, and ReturnsCounted as a graceful stop
//     begins.
//
// A driver embeds Base and overrides what it adds.
type Pipe interface {
	// Engine returns what the pipe adds to its engine's configuration.
	Engine() Engine
	// Start starts what runs beside the pipe while Run runs, within ctx;
	// stop ends it and waits for it.
	Start(ctx context.Context) (stop func())
	// ReceiverOptions adds to the options of the pipe's receive links.
	ReceiverOptions(ro *amqp.ReceiverOptions)
	// Attached runs once l's receiver is attached, within ctx: it opens
	// what the driver adds beside the receiver and returns the source the
	// engine receives from (nil: the receiver itself). On an error, step
	// names what failed, and the core closes l. A *MismatchError says the
	// queue does not fit an option.
	Attached(ctx context.Context, l Link) (src Source, step string, err error)
	// Ready runs once Attached has returned, within the attacher's ctx
	// (not the attach's DialTimeout): it waits until l may be handed to
	// the engine. On an error the core closes l.
	Ready(ctx context.Context, l Link) error
	// CheckSource checks a test source attached in place of a link, as
	// Attached checks a link; step names what failed.
	CheckSource(src Source) (step string, err error)
	// SourceAttached is told of a test source once it is attached, and of
	// nil when it is lost.
	SourceAttached(src Source)
	// Release closes what l opened beside its receiver, within ctx:
	// detach closes the receiver and its AMQP session, between what the
	// driver ends before and what it waits for after. why is what ended
	// the link (nil: a stop), for the log.
	Release(ctx context.Context, l Link, why error, detach func())
	// ReattachOn says whether a link lost with lost (not a source done)
	// is attached again on its connection, still open (true), or the
	// connection is closed and a new one made (false). reclaim, nil when
	// the connection has none, puts fresh credentials on it within ctx.
	// refused says that lost is the broker's refusal of such an attach.
	ReattachOn(ctx context.Context, reclaim func(context.Context) error, lost error, refused bool) bool
	// Refused reads an attach error of the attempt-th attempt in a row
	// (from 0); for RefusedHeld, wait is how long to wait before the next.
	Refused(err error, attempt int) (r Refusal, wait time.Duration)
	// HandlerContext returns the context for a handler of ts, derived
	// from ctx; done releases it.
	HandlerContext(ctx context.Context, ts ...Ticket) (hctx context.Context, done func())
	// Outcome returns the outcome to send for o.
	Outcome(o Outcome) Outcome
	// SettleOrder says whether t's settlement is sent in order with the
	// others of key (each once the one before it was answered), and
	// under which key; lane is the delivery's lane, -1 when not known.
	SettleOrder(t Ticket, lane int) (key uint64, ordered bool)
	// Locks returns the pipe's lease counters, added to Stats.Locks.
	Locks() Locks
	// ReturnsCounted says whether the broker counts a release as a
	// delivery attempt, as far as the driver knows now: a graceful stop
	// then finishes what is buffered before it releases anything.
	ReturnsCounted() bool
}

// Engine is what a pipe adds to its engine's configuration; the zero
// value adds nothing. The fields are the engine's (package
// internal/pump, Config) of the same names.
type Engine struct {
	// Leases hears of every delivery entering and leaving the engine.
	Leases Leases
	// Settlers, when > 0, sends settlements from that many goroutines,
	// each waiting for the broker's answer.
	Settlers int
	// SettleTimeout bounds each settlement sent by a settler.
	SettleTimeout time.Duration
	// LeasesOutliveLinks: what a lost link held stays held and
	// settleable (the source settles it without the link).
	LeasesOutliveLinks bool
	// DropBufferedOn says whether a source that ended with err drops what
	// it delivered and no handler has yet.
	DropBufferedOn func(err error) bool
}

// Refusal is how a pipe reads an attach error (Pipe.Refused).
type Refusal uint8

const (
	// RefusedNot is a failure like any other, judged by FatalErrors and
	// retried after backoff.
	RefusedNot Refusal = iota
	// RefusedNoneFree says nothing became free to attach to in time: ask
	// again at once, on the same connection.
	RefusedNoneFree
	// RefusedHeld says what was asked for is held by another receiver: ask
	// again on the same connection, after the wait Refused gives.
	RefusedHeld
)

// Locks are a pipe's lease counters (the fields of Stats.Locks of the
// same names).
type Locks struct {
	Held                                  int
	RenewRequests, Renewed, RenewFailures uint64
	Lost, Unrenewable                     uint64
	SettledByToken, DispositionRequests   uint64
}

// Link is one attached link as a driver's pipe sees it.
type Link interface {
	// Conn is the link's connection; Broker names the address it is
	// connected to, without credentials, for logs.
	Conn() *amqp.Conn
	Broker() string
	// Session is the link's AMQP session.
	Session() *amqp.Session
	// Receiver is the link's receiver; nil on a link opened for a node
	// beside it only (PipeEnv.OpenSession).
	Receiver() *amqp.Receiver
	// Ext is what the pipe keeps of the link (SetExt); nil before.
	Ext() any
	// SetExt keeps v with the link, for the pipe.
	SetExt(v any)
}

// PipeConfig is what the core tells a driver's pipe of the subscriber and
// of the pipe, fixed for the pipe's life.
type PipeConfig struct {
	// Queue is the queue name the subscriber was made for; Address is the
	// driver's address of it (Driver.Address).
	Queue, Address string
	// Index is the pipe's place among the subscriber's pipes, from 0; Key
	// is what the options asked this pipe for ("" for anything free, or
	// a subscriber of one pipe).
	Index int
	Key   string
	// Credit is the pipe's credit: the subscriber's, or its share of it
	// when it has several pipes.
	Credit int
	// ByKey: the lanes run WorkersByKey (a delivery without a group-id
	// keeps its lane's order).
	ByKey bool
	// MaxDeliveryCount is the MaxDeliveryCount option, 0 when not given.
	MaxDeliveryCount int
	// DialTimeout and CloseTimeout are the options of those names.
	DialTimeout, CloseTimeout time.Duration
	// Options are the driver's own options, as its public wrapper set
	// them; nil when none was given.
	Options any
}

// PipeEnv is what the core tells a driver's pipe, and does for it.
type PipeEnv interface {
	// Config is the pipe's configuration.
	Config() PipeConfig
	// Log is the subscriber's logger; Limited its rate-limited logger,
	// for lines that can repeat.
	Log() *zap.Logger
	Limited() *loglimit.Logger
	// Engine is the pipe's engine. It exists once Pipe.Engine has
	// returned: Pipe.Engine must not call it.
	Engine() EngineEnv
	// Current returns the pipe's link attached now (nil between links,
	// and under a test source), and a channel closed when the next one
	// attaches.
	Current() (l Link, next <-chan struct{})
	// HandlersOf counts the handlers running now, in any pipe of the
	// subscriber, of deliveries of group-id group.
	HandlersOf(group string) int
	// LeaseLost tells the core of a delivery whose lease was lost (why
	// wraps the cause; m is its message, nil when not known): the engine
	// drops it if no handler has it, and skips its settlement if one has;
	// what changed anything is logged and reported as an event.
	LeaseLost(t Ticket, m *amqp.Message, why error)
	// OnRenewed is told of each request that renewed n leases; nil when
	// the subscriber has no metrics.
	OnRenewed() func(n int)
	// OpenSession connects, within ctx and DialTimeout, and opens an AMQP
	// session, for a node a stopping pipe needs without a link: the Link
	// it returns has no receiver, and is closed with CloseLink; by is when
	// the DialTimeout of its connect ends, for what the pipe opens on the
	// session. It returns an error wrapping ErrNoBroker under a test
	// source.
	OpenSession(ctx context.Context) (l Link, by time.Time, err error)
	// CloseLink closes a link OpenSession returned, by the time by.
	CloseLink(l Link, by time.Time)
}

// ErrNoBroker says that a pipe receives from a test source, with no
// broker to connect to (PipeEnv.OpenSession).
var ErrNoBroker = errors.New("amqpsub: no broker to connect to (a test source)")

// EngineEnv is the part of a pipe's engine a driver reads.
type EngineEnv interface {
	// Held is how many deliveries the engine holds.
	Held() int
	// Each calls fn for each delivery held, until fn returns false.
	Each(fn func(d *Delivery) bool)
	// Stopping is closed once the engine stops (its grace began).
	Stopping() <-chan struct{}
}

// Base is a Pipe that adds nothing: a driver's pipe embeds it and
// overrides what it adds.
type Base struct{}

// Engine adds nothing.
func (Base) Engine() Engine { return Engine{} }

// Start runs nothing.
func (Base) Start(context.Context) func() { return func() {} }

// ReceiverOptions adds nothing.
func (Base) ReceiverOptions(*amqp.ReceiverOptions) {}

// Attached adds nothing: the engine receives from the receiver.
func (Base) Attached(context.Context, Link) (Source, string, error) { return nil, "", nil }

// Ready waits for nothing.
func (Base) Ready(context.Context, Link) error { return nil }

// CheckSource finds nothing to check.
func (Base) CheckSource(Source) (string, error) { return "", nil }

// SourceAttached keeps nothing.
func (Base) SourceAttached(Source) {}

// Release detaches, and waits for nothing more.
func (Base) Release(_ context.Context, _ Link, _ error, detach func()) { detach() }

// ReattachOn makes a new connection for every lost link.
func (Base) ReattachOn(context.Context, func(context.Context) error, error, bool) bool { return false }

// Refused reads every attach error as a failure like any other.
func (Base) Refused(error, int) (Refusal, time.Duration) { return RefusedNot, 0 }

// HandlerContext is ctx.
func (Base) HandlerContext(ctx context.Context, _ ...Ticket) (context.Context, func()) {
	return ctx, func() {}
}

// Outcome sends o.
func (Base) Outcome(o Outcome) Outcome { return o }

// SettleOrder orders no settlement.
func (Base) SettleOrder(Ticket, int) (uint64, bool) { return 0, false }

// Locks counts nothing.
func (Base) Locks() Locks { return Locks{} }

// ReturnsCounted says the broker does not count a release.
func (Base) ReturnsCounted() bool { return false }
