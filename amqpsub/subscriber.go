package amqpsub

import (
	"context"
	"errors"
	"fmt"
	"reflect"
	"sync"
	"sync/atomic"

	"go.uber.org/zap"

	"github.com/amqpsub/amqpsub/internal/loglimit"
	"github.com/amqpsub/amqpsub/internal/pump"
)

// Subscriber consumes one queue. Build it with [New] or [NewBatch], start it
// with Run.
type Subscriber struct {
	connector Connector
	queue     string
	handler   Handler
	batch     BatchHandler
	cfg       config
	log       *zap.Logger
	// limited writes the lines that can fire once per delivery: at their
	// level at most once a minute, at debug otherwise (docs/logging.md).
	limited *loglimit.Logger
	pipes   []*pipe     // one, or one per session held at once
	events  *events     // nil without OnEvent and WithMetrics
	rec     Recorder    // nil without WithMetrics
	built   atomic.Bool // build is done: the fields above are set

	mu       sync.Mutex
	started  bool
	closed   bool
	stopReq  chan struct{} // closed by Shutdown
	closeReq chan struct{} // closed by Close
	done     chan struct{} // closed when Run returns

	// hctx is the handlers' context of the running Run, cancelled at the
	// cut; DeadLetterCopy's sends are bound to it. Set by Run before the
	// lanes start.
	hctx context.Context

	running                atomic.Int64 // handler calls in progress
	cut                    atomic.Bool  // Run gave up on the running handlers: ignore their results
	reconnects             atomic.Uint64
	inOnReconnect          atomic.Int32 // OnReconnect calls in progress
	profileWarned          atomic.Bool  // the broker's own name was found at odds with the profile
	abandoned              atomic.Uint64
	deadLetterCopies       atomic.Uint64
	deadLetterCopyFailures atomic.Uint64
	results                struct {
		accept, release, retry, reject, panics, localRetries, poisoned, oversize atomic.Uint64
	}
}

// New returns a [Subscriber] that consumes queue from the broker c connects
// to and passes each delivery to h. Options it is given are validated here:
// an invalid one gives an error wrapping [ErrInvalidOption], as does a
// handler that would panic on every delivery: nil, HandlerFunc(nil), or a
// nil *T whose T has a Handle method. Nothing connects until Run.
func New(c Connector, queue string, h Handler, opts ...Option) (*Subscriber, error) {
	if isNil(h, handlerType) {
		return nil, fmt.Errorf("%w: nil Handler", ErrInvalidOption)
	}
	s, err := build(c, queue, opts, false)
	if err != nil {
		return nil, err
	}
	s.handler = h
	return s, nil
}

// NewBatch is [New] for a BatchHandler: deliveries are handed over in batches
// sized by the [Batch] option. With [WorkersByKey], batches are assembled per
// lane, so the order of each group holds across batches.
func NewBatch(c Connector, queue string, h BatchHandler, opts ...Option) (*Subscriber, error) {
	if isNil(h, batchHandlerType) {
		return nil, fmt.Errorf("%w: nil BatchHandler", ErrInvalidOption)
	}
	s, err := build(c, queue, opts, true)
	if err != nil {
		return nil, err
	}
	s.batch = h
	return s, nil
}

func build(c Connector, queue string, opts []Option, batch bool) (*Subscriber, error) {
	if c == nil {
		return nil, fmt.Errorf("%w: nil Connector", ErrInvalidOption)
	}
	if g, ok := c.(given); ok && g.c == nil {
		return nil, fmt.Errorf("%w: Conn(nil)", ErrInvalidOption)
	}
	if queue == "" {
		return nil, fmt.Errorf("%w: empty queue name", ErrInvalidOption)
	}
	cfg := defaultConfig()
	for _, o := range opts {
		if o == nil {
			cfg.invalid("nil Option")
			continue
		}
		o.apply(&cfg)
	}
	if v, ok := c.(validator); ok {
		v.validate(&cfg, queue)
	}
	if cfg.deadLetterCopy != "" && !cfg.profile.f.DeadLetterCopy {
		cfg.invalid("DeadLetterCopy is for brokers that drop a rejection's reason (Artemis, Generic); %s keeps it or dead-letters through its own configuration", cfg.profile.system())
	}
	if cfg.batchSet && !batch {
		cfg.invalid("Batch needs a BatchHandler: use NewBatch")
	}
	if cfg.balanced && !cfg.byKey {
		cfg.invalid("BalanceKeys needs WorkersByKey")
	}
	if cfg.broker != nil {
		cfg.broker.check(&cfg)
	}
	if !cfg.fatalSet {
		cfg.isFatal = cfg.profile.defaultFatal()
	}
	if err := errors.Join(cfg.errs...); err != nil {
		return nil, err
	}
	cfg.floor = cfg.creditFloor(batch)
	log := cfg.log.With(zap.String("queue", queue))
	s := &Subscriber{
		connector: c,
		queue:     queue,
		cfg:       cfg,
		log:       log,
		limited:   loglimit.New(log, loglimit.Every),
		stopReq:   make(chan struct{}),
		closeReq:  make(chan struct{}),
		done:      make(chan struct{}),
	}
	// One pipe per slot (a Service Bus session held at once), the credit
	// shared between them.
	pipes, credit := 1, cfg.credit
	if n := len(cfg.slots); n > 0 {
		pipes, credit = n, max(1, cfg.credit/n)
	}
	if cfg.metrics != nil {
		// The Recorder is made first, since the pipes report to it; an
		// adapter may call Stats at once (a scrape), before the pipes
		// exist: it reads zeros until build is done.
		s.rec = cfg.metrics.Recorder(MetricsInfo{
			Queue:  queue,
			System: cfg.profile.system(),
			Credit: credit * pipes,
			Lanes:  cfg.workers,
			Batch:  batch,
			Stats: func() Stats {
				if !s.built.Load() {
					return Stats{}
				}
				return s.Stats()
			},
			Done: s.done,
		})
	}
	s.events = newEvents(cfg.onEvent, s.rec)
	for i := range pipes {
		key := ""
		if len(cfg.slots) > 0 {
			key = cfg.slots[i]
		}
		s.pipes = append(s.pipes, s.newPipe(i, credit, key))
	}
	s.built.Store(true)
	return s, nil
}

// pumpEvent passes on what the pump reports. It runs on the pump's
// goroutine and never blocks.
func (s *Subscriber) pumpEvent(e pump.Event) {
	ev := Event{Err: e.Err, Queue: s.queue, Lane: -1}
	switch e.Kind {
	case pump.SettleFailed:
		ev.Kind = EventSettleFailed
		if e.Message != nil {
			d := &Delivery{msg: e.Message, lane: -1}
			ev.MessageID, ev.GroupID, ev.DeliveryCount = d.MessageID(), d.GroupID(), d.DeliveryCount()
		}
	case pump.LinkLost:
		ev.Kind = EventLinkLost
	case pump.Overshoot:
		ev.Kind = EventCreditOvershoot
	default:
		return
	}
	s.events.send(ev)
}

// Done returns a channel closed when Run has returned, or, for a subscriber
// stopped (Close, Shutdown) before it ran, at the stop.
func (s *Subscriber) Done() <-chan struct{} { return s.done }

// validator is a Connector that checks the options it is given with (in
// build, after they are applied): a Service Bus connector takes the
// AzureServiceBus profile, say.
type validator interface {
	validate(cfg *config, queue string)
}

// isNil reports whether h is a handler that would panic on every call,
// and retry every message until the broker dead-letters it: a nil
// interface, a nil func (HandlerFunc(nil)), a pointer to a nil func, or a
// nil *T whose T has the handler's method (a value-receiver method called
// through a nil pointer always panics). A nil pointer, map or slice of a
// type whose own methods take it as it is may work, and is accepted.
func isNil(h any, iface reflect.Type) bool {
	if h == nil {
		return true
	}
	v := reflect.ValueOf(h)
	switch v.Kind() {
	case reflect.Func:
		return v.IsNil()
	case reflect.Pointer:
		if v.IsNil() {
			return v.Type().Elem().Implements(iface)
		}
		e := v.Elem()
		return e.Kind() == reflect.Func && e.IsNil()
	}
	return false
}

var (
	handlerType      = reflect.TypeFor[Handler]()
	batchHandlerType = reflect.TypeFor[BatchHandler]()
)
