package amqpsub

import (
	"context"
	"errors"
	"fmt"
	"net"
	"runtime/debug"
	"sync"
	"sync/atomic"
	"time"

	"github.com/Azure/go-amqp"
	"go.uber.org/zap"

	"github.com/amqpsub/amqpsub/lanes"
	"github.com/amqpsub/amqpsub/pump"
)

// Errors Run returns.
var (
	// ErrClosed is returned by Run when the Subscriber was already run, or
	// closed or shut down before Run.
	ErrClosed = errors.New("amqpsub: subscriber closed")
	// ErrLinkLost is wrapped by the error Run returns when the link or
	// connection to the broker was lost.
	ErrLinkLost = errors.New("amqpsub: link lost")
	// ErrHandlerPanic is wrapped by the error logged when a handler panics;
	// the delivery is retried.
	ErrHandlerPanic = errors.New("amqpsub: handler panicked")
)

// RejectCondition is the AMQP error condition sent with a Reject outcome;
// its description is the reason given to Reject.
const RejectCondition amqp.ErrCond = "amqpsub:rejected"

// Subscriber consumes one queue. Build it with New or NewBatch, start it
// with Run.
type Subscriber struct {
	connector Connector
	queue     string
	handler   Handler
	batch     BatchHandler
	cfg       config
	log       *zap.Logger
	pump      *pump.Pump

	mu       sync.Mutex
	started  bool
	closed   bool
	stopReq  chan struct{} // closed by Shutdown
	closeReq chan struct{} // closed by Close
	done     chan struct{} // closed when Run returns

	panics       atomic.Uint64
	reconnects   atomic.Uint64
	localRetries atomic.Uint64
	poisoned     atomic.Uint64
	retries      atomic.Uint64
	rejects      atomic.Uint64
	releases     atomic.Uint64
}

// New returns a Subscriber that consumes queue from the broker c connects
// to and passes each delivery to h. Options it is given are validated here:
// an invalid one gives an error wrapping ErrInvalidOption. Nothing connects
// until Run.
func New(c Connector, queue string, h Handler, opts ...Option) (*Subscriber, error) {
	if h == nil {
		return nil, fmt.Errorf("%w: nil Handler", ErrInvalidOption)
	}
	s, err := build(c, queue, opts)
	if err != nil {
		return nil, err
	}
	if s.cfg.batchSet {
		return nil, fmt.Errorf("%w: Batch needs a BatchHandler: use NewBatch", ErrInvalidOption)
	}
	s.handler = h
	return s, nil
}

// NewBatch is New for a BatchHandler: deliveries are handed over in batches
// sized by the Batch option. With WorkersByKey, batches are assembled per
// lane, so the order of each group holds across batches.
func NewBatch(c Connector, queue string, h BatchHandler, opts ...Option) (*Subscriber, error) {
	if h == nil {
		return nil, fmt.Errorf("%w: nil BatchHandler", ErrInvalidOption)
	}
	s, err := build(c, queue, opts)
	if err != nil {
		return nil, err
	}
	if s.cfg.localRetries > 0 {
		return nil, fmt.Errorf("%w: LocalRetry applies to a Handler, not a BatchHandler", ErrInvalidOption)
	}
	s.batch = h
	return s, nil
}

func build(c Connector, queue string, opts []Option) (*Subscriber, error) {
	if c == nil {
		return nil, fmt.Errorf("%w: nil Connector", ErrInvalidOption)
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
	if err := errors.Join(cfg.errs...); err != nil {
		return nil, err
	}
	log := cfg.log.With(zap.String("queue", queue))
	s := &Subscriber{
		connector: c,
		queue:     queue,
		cfg:       cfg,
		log:       log,
		stopReq:   make(chan struct{}),
		closeReq:  make(chan struct{}),
		done:      make(chan struct{}),
		pump: pump.New(pump.Config{
			Credit: cfg.credit,
			Mode:   cfg.profile.creditMode,
			Logger: log,
		}),
	}
	return s, nil
}

// link is what one attach opened.
type link struct {
	conn  *amqp.Conn
	owned bool
	sess  *amqp.Session
	rcv   *amqp.Receiver
}

// Run connects, attaches a receiver to the queue and consumes until ctx is
// cancelled, Shutdown or Close is called, or a fatal error. Cancelling ctx
// starts a graceful stop, like Shutdown: no more credit, deliveries no
// handler has taken are released at once, handlers in progress get the grace
// period to finish and are settled, then the link, session and connection
// are closed, each within CloseTimeout. Run returns nil after a stop it was
// asked for. It returns an error naming the broker when it cannot connect or
// attach (within DialTimeout), and one wrapping ErrLinkLost when the link or
// connection is lost. Run returns only after every handler it started has
// returned. It may be called once; later calls return ErrClosed.
func (s *Subscriber) Run(ctx context.Context) error {
	s.mu.Lock()
	if s.started || s.closed {
		s.mu.Unlock()
		return ErrClosed
	}
	s.started = true
	s.mu.Unlock()
	defer close(s.done)

	// Handlers and the pump outlive ctx by the grace period.
	hctx, cancelHandlers := context.WithCancel(context.WithoutCancel(ctx))
	defer cancelHandlers()
	pctx, cancelPump := context.WithCancel(context.WithoutCancel(ctx))
	defer cancelPump()

	// The attacher is used by the pump only; Run reads it after the pump is
	// done.
	att := &attacher{s: s}
	var wg sync.WaitGroup
	pumpDone := make(chan error, 1)
	wg.Go(func() { pumpDone <- s.pump.Run(pctx, att.attach) })
	wg.Go(func() { lanes.Run(s.pump.Out(), s.laneConfig(hctx)) })

	var err error
	select {
	case err = <-pumpDone:
	case <-ctx.Done():
		err = s.stop(pumpDone, cancelHandlers, cancelPump)
	case <-s.stopReq:
		err = s.stop(pumpDone, cancelHandlers, cancelPump)
	case <-s.closeReq:
		err = s.abort(pumpDone, cancelHandlers, cancelPump)
	}
	// Lanes drop whatever is still queued from here on.
	s.pump.Stop()
	if att.current != nil {
		s.closeLink(att.current)
	}
	wg.Wait()
	if errors.Is(err, pump.ErrStopped) || errors.Is(err, context.Canceled) {
		return nil
	}
	return err
}

// stop runs a graceful stop and returns the pump's result.
func (s *Subscriber) stop(pumpDone <-chan error, cancelHandlers, cancelPump context.CancelFunc) error {
	s.log.Debug("stopping", zap.Duration("grace", s.cfg.grace))
	s.pump.Stop()
	grace := time.NewTimer(s.cfg.grace)
	defer grace.Stop()
	select {
	case err := <-pumpDone:
		return err
	case <-grace.C:
		st := s.pump.Stats()
		s.log.Warn("grace period over; cancelling handlers, the broker redelivers what they held",
			zap.Int("handling", st.Handling), zap.Int("held", st.Held))
		return s.abort(pumpDone, cancelHandlers, cancelPump)
	case <-s.closeReq:
		return s.abort(pumpDone, cancelHandlers, cancelPump)
	}
}

// abort stops at once: handlers' ctx is cancelled and the pump leaves what it
// holds unsettled, for the broker to redeliver when the link closes.
func (s *Subscriber) abort(pumpDone <-chan error, cancelHandlers, cancelPump context.CancelFunc) error {
	s.pump.Stop()
	cancelHandlers()
	cancelPump()
	<-pumpDone
	return nil
}

func (s *Subscriber) attach(ctx context.Context) (*link, error) {
	ctx, cancel := context.WithTimeout(ctx, s.cfg.dialTimeout)
	defer cancel()
	conn, owned, err := s.connector.connect(ctx, s.cfg.idleTimeout)
	if err != nil {
		// go-amqp sets the socket's deadline from ctx's, so a dial timeout
		// shows as the socket's i/o timeout or as ctx's, whichever fires
		// first: report it as ctx's either way.
		var nerr net.Error
		if cerr := ctx.Err(); cerr != nil && !errors.Is(err, cerr) {
			err = fmt.Errorf("%w: %w", cerr, err)
		} else if _, ok := ctx.Deadline(); ok && cerr == nil && errors.As(err, &nerr) && nerr.Timeout() {
			err = fmt.Errorf("%w: %w", context.DeadlineExceeded, err)
		}
		return nil, fmt.Errorf("amqpsub: connect to %s: %w", s.connector, err)
	}
	l := &link{conn: conn, owned: owned}
	fail := func(what string, err error) (*link, error) {
		s.closeLink(l)
		return nil, fmt.Errorf("amqpsub: %s on %s queue %q: %w", what, s.connector, s.queue, err)
	}
	if l.sess, err = conn.NewSession(ctx, nil); err != nil {
		return fail("open session", err)
	}
	addr := s.cfg.profile.address(s.queue)
	l.rcv, err = l.sess.NewReceiver(ctx, addr, &amqp.ReceiverOptions{
		Credit:             -1,
		SourceCapabilities: s.cfg.profile.sourceCaps,
		Name:               s.cfg.linkName,
	})
	if err != nil {
		return fail("attach receiver", err)
	}
	s.log.Info("attached", zap.Stringer("broker", s.connector), zap.String("address", addr),
		zap.Stringer("profile", s.cfg.profile), zap.Int("credit", s.cfg.credit))
	return l, nil
}

// closeLink closes what l opened, each step within CloseTimeout. Brokers
// that never answer a detach (RabbitMQ 3.10) get their session closed
// instead.
func (s *Subscriber) closeLink(l *link) {
	step := func(what string, f func(context.Context) error) {
		ctx, cancel := context.WithTimeout(context.Background(), s.cfg.closeTimeout)
		defer cancel()
		if err := f(ctx); err != nil {
			s.log.Debug("close "+what, zap.Error(err))
		}
	}
	if l.rcv != nil && s.cfg.profile.detach {
		step("receiver", l.rcv.Close)
	}
	if l.sess != nil {
		step("session", l.sess.Close)
	}
	if l.owned {
		if err := l.conn.Close(); err != nil {
			var ce *amqp.ConnError
			if !errors.As(err, &ce) || ce.RemoteErr != nil {
				s.log.Debug("close connection", zap.Error(err))
			}
		}
	}
}

// Shutdown starts a graceful stop (see Run) and waits until Run has returned
// or ctx ends, whichever comes first; then it returns ctx.Err(). The stop
// goes on after ctx ends, bounded by the grace period. Shutdown before Run
// makes Run return ErrClosed. It is safe to call more than once.
func (s *Subscriber) Shutdown(ctx context.Context) error {
	s.mu.Lock()
	if !s.closed {
		s.closed = true
		close(s.stopReq)
	}
	started := s.started
	s.mu.Unlock()
	if !started {
		return nil
	}
	select {
	case <-s.done:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// Close stops at once: handlers' ctx is cancelled, nothing more is settled,
// and the connection is closed, so the broker redelivers every delivery the
// subscriber held. Close does not wait; Run returns once the handlers have
// returned. It is safe to call more than once, and after Shutdown.
func (s *Subscriber) Close() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.closed = true
	select {
	case <-s.closeReq:
	default:
		close(s.closeReq)
	}
	return nil
}

// Done returns a channel closed when Run has returned.
func (s *Subscriber) Done() <-chan struct{} { return s.done }

func (s *Subscriber) laneConfig(ctx context.Context) lanes.Config[*pump.Delivery] {
	cfg := lanes.Config[*pump.Delivery]{
		Lanes: s.cfg.workers,
		Depth: s.cfg.credit,
		Stop:  s.pump.Stopping(),
		Skip:  (*pump.Delivery).Stale,
		Drop: func(pd *pump.Delivery) {
			kind := pump.Release
			if pd.Stale() {
				kind = pump.Drop
			}
			s.pump.Settle(pd, pump.Outcome{Kind: kind})
		},
	}
	if s.cfg.byKey {
		cfg.Key = func(pd *pump.Delivery) string { return groupID(pd.Message()) }
	}
	if s.batch == nil {
		scratch := make([]Delivery, s.cfg.workers)
		cfg.Handle = func(lane int, pd *pump.Delivery) {
			d := &scratch[lane]
			d.reset(pd, lane)
			pd.SetState(pump.Handling)
			s.settle(pd, s.handle(ctx, d))
			d.reset(nil, lane)
		}
		return cfg
	}
	cfg.BatchSize, cfg.BatchWait = s.cfg.batchSize, s.cfg.batchWait
	type laneBatch struct {
		ds   []Delivery
		ptrs []*Delivery
	}
	scratch := make([]laneBatch, s.cfg.workers)
	for i := range scratch {
		scratch[i].ds = make([]Delivery, s.cfg.batchSize)
		scratch[i].ptrs = make([]*Delivery, 0, s.cfg.batchSize)
	}
	cfg.HandleBatch = func(lane int, pds []*pump.Delivery) {
		b := &scratch[lane]
		b.ptrs = b.ptrs[:0]
		for i, pd := range pds {
			pd.SetState(pump.Handling)
			b.ds[i].reset(pd, lane)
			if err := s.poison(&b.ds[i]); err != nil {
				s.settle(pd, err)
				b.ds[i].reset(nil, lane)
				continue
			}
			b.ptrs = append(b.ptrs, &b.ds[i])
		}
		if len(b.ptrs) == 0 {
			return
		}
		results := s.callBatch(ctx, b.ptrs)
		for i, d := range b.ptrs {
			var err error
			if results != nil {
				err = results[i]
			}
			s.settle(d.pd, err)
			d.reset(nil, lane)
		}
	}
	return cfg
}

// handle runs the handler on d, after the poison check, and retries it in
// the lane as LocalRetry says.
func (s *Subscriber) handle(ctx context.Context, d *Delivery) error {
	if err := s.poison(d); err != nil {
		return err
	}
	err := s.call(ctx, d)
	for attempt := 0; attempt < s.cfg.localRetries; attempt++ {
		if kind, _ := decide(err); kind != outcomeRetry || !s.pause(ctx, attempt) {
			return err
		}
		s.localRetries.Add(1)
		err = s.call(ctx, d)
	}
	return err
}

// pause waits before local retry attempt k; false means the subscriber is
// stopping and the retry should go to the broker instead.
func (s *Subscriber) pause(ctx context.Context, k int) bool {
	wait := s.cfg.localMin
	for i := 0; i < k && wait < s.cfg.localMax; i++ {
		wait *= 2
	}
	t := time.NewTimer(min(wait, s.cfg.localMax))
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
	case <-s.pump.Stopping():
	}
	return false
}

// poison rejects a delivery whose delivery count is past MaxDeliveryCount.
func (s *Subscriber) poison(d *Delivery) error {
	if s.cfg.maxDelivery == 0 || d.DeliveryCount() <= s.cfg.maxDelivery {
		return nil
	}
	s.poisoned.Add(1)
	s.log.Warn("delivery count past the limit; rejecting", zap.Uint32("delivery_count", d.DeliveryCount()),
		zap.Uint32("limit", s.cfg.maxDelivery), zap.Any("message_id", d.MessageID()))
	return Reject(fmt.Sprintf("amqpsub: delivery count %d is past the limit %d", d.DeliveryCount(), s.cfg.maxDelivery))
}

// call runs the handler, turning a panic into a Retry.
func (s *Subscriber) call(ctx context.Context, d *Delivery) (err error) {
	defer func() {
		if r := recover(); r != nil {
			err = s.recovered(r)
		}
	}()
	return s.handler.Handle(ctx, d)
}

func (s *Subscriber) callBatch(ctx context.Context, batch []*Delivery) (results []error) {
	defer func() {
		if r := recover(); r != nil {
			results = fill(len(batch), s.recovered(r))
		}
	}()
	results = s.batch.HandleBatch(ctx, batch)
	if results != nil && len(results) != len(batch) {
		err := fmt.Errorf("amqpsub: BatchHandler returned %d results for %d deliveries", len(results), len(batch))
		s.log.Error("batch handler broke its contract; retrying the batch", zap.Error(err))
		return fill(len(batch), err)
	}
	return results
}

func fill(n int, err error) []error {
	out := make([]error, n)
	for i := range out {
		out[i] = err
	}
	return out
}

func (s *Subscriber) recovered(r any) error {
	s.panics.Add(1)
	err := fmt.Errorf("%w: %v", ErrHandlerPanic, r)
	s.log.Error("handler panicked; retrying the delivery", zap.Error(err), zap.ByteString("stack", debug.Stack()))
	return err
}

// settle maps a handler's result to the broker settlement.
func (s *Subscriber) settle(pd *pump.Delivery, err error) {
	kind, oe := decide(err)
	switch kind {
	case outcomeAccept:
		s.pump.Settle(pd, pump.Outcome{Kind: pump.Accept})
	case outcomeRelease:
		s.releases.Add(1)
		s.pump.Settle(pd, pump.Outcome{Kind: pump.Release})
	case outcomeReject:
		s.rejects.Add(1)
		s.pump.Settle(pd, pump.Outcome{Kind: pump.Reject, Error: &amqp.Error{
			Condition:   RejectCondition,
			Description: oe.reason,
		}})
	default:
		s.retries.Add(1)
		if !errors.Is(err, ErrHandlerPanic) {
			s.log.Warn("handler failed; retrying the delivery", zap.Error(err))
		}
		s.pump.Settle(pd, s.cfg.profile.retry)
	}
}
