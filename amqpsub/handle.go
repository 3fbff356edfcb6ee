package amqpsub

import (
	"context"
	"errors"
	"fmt"
	"runtime/debug"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/amqpsub/amqpsub/internal/driver"
	"github.com/amqpsub/amqpsub/internal/lanes"
)

// Handler handles one delivery at a time. Its return value settles the
// delivery:
//   - nil accepts it;
//   - Release() puts it back untouched;
//   - Reject(reason) dead-letters it;
//   - Retry(err), or any other error, puts it back as a failed attempt.
//
// A handler that panics is recovered: the panic is logged with its stack and
// the delivery is retried.
//
// ctx is cancelled when the subscriber gives up on the handler (Close, or
// the grace period of a graceful stop running out: cause [ErrStopping]),
// and on Service Bus when the delivery's lock is lost (cause
// [ErrLockLost]); the delivery's settlement is then in doubt, or not sent,
// and the broker may deliver it again.
// The [Delivery] stays valid after Handle returns.
type Handler interface {
	Handle(ctx context.Context, d *Delivery) error
}

// HandlerFunc adapts a function to a [Handler].
type HandlerFunc func(ctx context.Context, d *Delivery) error

// Handle calls f(ctx, d).
func (f HandlerFunc) Handle(ctx context.Context, d *Delivery) error { return f(ctx, d) }

// BatchHandler handles a batch of deliveries and returns one outcome for
// each, as [Handler] does for one: results[i] settles batch[i]. A nil slice
// accepts the whole batch. A slice of the wrong length, or a panic, retries
// the whole batch.
//
// With [WorkersByKey] a batch holds several groups, each in order; to keep a
// group's order, a handler that fails one of its deliveries returns a
// failure for the group's later ones as well.
//
// The slice is valid only until HandleBatch returns; the Deliveries stay
// valid.
type BatchHandler interface {
	HandleBatch(ctx context.Context, batch []*Delivery) (results []error)
}

// BatchHandlerFunc adapts a function to a [BatchHandler].
type BatchHandlerFunc func(ctx context.Context, batch []*Delivery) []error

// HandleBatch calls f(ctx, batch).
func (f BatchHandlerFunc) HandleBatch(ctx context.Context, batch []*Delivery) []error {
	return f(ctx, batch)
}

// handle runs the handler on d, after the poison checks (when
// MaxMessageSize or MaxDeliveryCount is given), and retries it in the lane
// as LocalRetry says.
func (s *Subscriber) handle(ctx context.Context, d *Delivery) error {
	if s.cfg.maxMessageSize > 0 || s.cfg.maxDelivery > 0 {
		if err := s.poison(d); err != nil {
			return err
		}
	}
	err := s.call(ctx, d)
	if err == nil {
		return nil // no retry to decide
	}
	r := s.retrier()
	for attempt := 1; isRetry(err) && r.allows(attempt) && !d.t.Stale(); attempt++ {
		s.failed(d, err, attempt)
		if !s.pause(ctx, d.p, r.wait(attempt)) {
			// Stopping: the delivery is released, since the stop and not
			// the message ended its retries. Artemis, RabbitMQ 3.10 and
			// Service Bus do not count a release; where the broker does
			// (returnsCounted: a RabbitMQ 4 quorum queue, toward its
			// delivery-limit), a graceful stop lets the retries go on
			// for up to half the grace period (finishBuffered) before
			// Stopping is closed.
			return Release()
		}
		if d.t.Stale() {
			// Its link was lost while it waited: no result of it can be
			// settled, and the broker delivers it again (to this lane,
			// behind it, or elsewhere). Retrying would only run the
			// handler beside that copy.
			return err
		}
		s.results.localRetries.Add(1)
		err = s.call(ctx, d)
	}
	return err
}

// handleBatch runs the batch handler on batch, retries the deliveries that
// failed in the lane as LocalRetry says (as a batch of their own), and
// settles every delivery.
func (s *Subscriber) handleBatch(ctx context.Context, lane int, batch []*Delivery) {
	results := s.callBatch(ctx, batch)
	r := s.retrier()
	for attempt := 1; ; attempt++ {
		var failed []*Delivery
		var firstErr error
		for i, d := range batch {
			// A stale delivery is not retried (see handle).
			if isRetry(results[i]) && r.allows(attempt) && !d.t.Stale() {
				if firstErr == nil {
					firstErr = results[i]
				}
				failed = append(failed, d)
				continue
			}
			s.settle(d, results[i])
		}
		if len(failed) == 0 {
			return
		}
		s.batchFailed(lane, failed, firstErr, attempt)
		if !s.pause(ctx, batch[0].p, r.wait(attempt)) {
			// Stopping: they are released (see handle for what the
			// broker counts).
			for _, d := range failed {
				s.settle(d, Release())
			}
			return
		}
		s.results.localRetries.Add(uint64(len(failed)))
		batch, results = failed, s.callBatch(ctx, failed)
	}
}

// call runs the handler, turning a panic into a Retry.
func (s *Subscriber) call(ctx context.Context, d *Delivery) (err error) {
	began := s.begin()
	defer func() {
		r := recover()
		if r != nil {
			err = s.recovered(r, d)
		}
		s.end(began, d.lane, 1, err, nil, r != nil)
	}()
	return s.handler.Handle(ctx, d)
}

// callBatch runs the batch handler, turning a panic, or a result slice of
// the wrong length, into a Retry of the whole batch.
func (s *Subscriber) callBatch(ctx context.Context, batch []*Delivery) (results []error) {
	began := s.begin()
	defer func() {
		r := recover()
		if r != nil {
			results = fill(len(batch), s.recovered(r, nil))
		}
		s.end(began, batch[0].lane, len(batch), nil, results, r != nil)
	}()
	results = s.batch.HandleBatch(ctx, batch)
	switch {
	case results == nil:
		return make([]error, len(batch))
	case len(results) != len(batch):
		err := fmt.Errorf("amqpsub: BatchHandler returned %d results for %d deliveries", len(results), len(batch))
		s.limited.Error("batch handler broke its contract; the batch fails as a whole", zap.Error(err))
		return fill(len(batch), err)
	}
	return results
}

// begin counts a handler call as running, and returns when it began for
// the Recorder (zero without one).
func (s *Subscriber) begin() time.Time {
	s.running.Add(1)
	if s.rec == nil {
		return time.Time{}
	}
	return time.Now()
}

// end counts a handler call begun at began done, and tells the Recorder
// its result: err's for one delivery, the most severe of results for a
// batch (worked out only when there is a Recorder).
func (s *Subscriber) end(began time.Time, lane, n int, err error, results []error, panicked bool) {
	if s.rec != nil {
		result := ResultOf(err)
		if results != nil {
			result = worst(results)
		}
		s.rec.Handled(HandlerCall{Lane: lane, Deliveries: n, Took: time.Since(began), Result: result, Panicked: panicked})
	}
	s.running.Add(-1)
}

// worst is the most severe result of a batch's.
func worst(results []error) Result {
	w := ResultAccept
	for _, err := range results {
		w = mostSevere(w, ResultOf(err))
	}
	return w
}

func fill(n int, err error) []error {
	out := make([]error, n)
	for i := range out {
		out[i] = err
	}
	return out
}

func (s *Subscriber) recovered(r any, d *Delivery) error {
	s.results.panics.Add(1)
	err := fmt.Errorf("%w: %v", ErrHandlerPanic, r)
	if s.cut.Load() {
		return err
	}
	// Limited: a message that panics its handler every time comes back
	// until the broker dead-letters it, and each time would log a stack.
	if d != nil {
		s.events.send(s.event(d, EventHandlerPanicked, err))
		s.limited.Error("handler panicked; retrying the delivery", s.fields(d, err, zap.ByteString("stack", debug.Stack()))...)
	} else {
		s.events.send(Event{Kind: EventHandlerPanicked, Err: err, Queue: s.queue, Lane: -1})
		s.limited.Error("batch handler panicked; retrying the batch", zap.Error(err), zap.ByteString("stack", debug.Stack()))
	}
	return err
}

// failed reports a handler failure that is retried in the lane.
func (s *Subscriber) failed(d *Delivery, err error, attempt int) {
	if s.cut.Load() {
		return
	}
	if !errors.Is(err, ErrHandlerPanic) && s.debug() {
		s.log.Debug("handler failed; retrying in the lane", s.fields(d, err, zap.Int("attempt", attempt))...)
	}
	ev := s.event(d, EventHandlerFailed, err)
	ev.Attempt = attempt
	s.events.send(ev)
}

// batchFailed reports, in one debug line, the deliveries of a batch that
// failed and are retried in the lane; each is an event of its own.
func (s *Subscriber) batchFailed(lane int, failed []*Delivery, err error, attempt int) {
	if s.cut.Load() {
		return
	}
	if s.debug() {
		s.log.Debug("batch handler failed; retrying the failed deliveries in the lane",
			zap.Int("lane", lane), zap.Int("failed", len(failed)), zap.Int("attempt", attempt),
			zap.Any("first_message_id", failed[0].MessageID()), zap.Error(err))
	}
	for _, d := range failed {
		ev := s.event(d, EventHandlerFailed, err)
		ev.Attempt = attempt
		s.events.send(ev)
	}
}

// fields name d in a log line: message_id, group_id, delivery_count and
// lane, then error when err is not nil, then more.
func (s *Subscriber) fields(d *Delivery, err error, more ...zap.Field) []zap.Field {
	f := make([]zap.Field, 0, 5+len(more))
	f = append(f, zap.Any("message_id", d.MessageID()), zap.String("group_id", d.GroupID()),
		zap.Uint32("delivery_count", d.DeliveryCount()), zap.Int("lane", d.lane))
	if err != nil {
		f = append(f, zap.Error(err))
	}
	return append(f, more...)
}

// debug reports whether debug lines are written: the per-delivery ones
// build their fields only then.
func (s *Subscriber) debug() bool { return s.log.Core().Enabled(zapcore.DebugLevel) }

// event returns an Event of kind about d.
func (s *Subscriber) event(d *Delivery, kind EventKind, err error) Event {
	ev := d.event(kind, err)
	ev.Queue = s.queue
	return ev
}

// laneConfig wires the lanes to the pump and the handler. ctx is the
// handlers' context, cancelled when Run gives up on them.
func (s *Subscriber) laneConfig(ctx context.Context, p *pipe) lanes.Config[driver.Ticket] {
	cfg := lanes.Config[driver.Ticket]{
		Lanes:    s.cfg.workers,
		Balanced: s.cfg.balanced,
		Gauge:    p.gauge,
		Stop:     p.pump.Stopping(),
		Flush:    p.pump.Holding(),
		Take:     driver.Ticket.Begin,
		Drop: func(t driver.Ticket) {
			kind := driver.Release
			if t.Stale() {
				kind = driver.Drop
			}
			p.settle(t, driver.Outcome{Kind: kind}, -1)
		},
	}
	if s.cfg.byKey {
		cfg.Key = func(t driver.Ticket) string { return groupID(t.Message()) }
	}
	if s.batch == nil {
		cfg.Handle = func(lane int, t driver.Ticket) {
			d := newDelivery(t, lane, p)
			hctx, done := p.dp.HandlerContext(ctx, t)
			err := s.handle(hctx, d)
			done()
			s.settle(d, err)
		}
		return cfg
	}
	// A batch never holds more than the credit.
	cfg.BatchSize, cfg.BatchWait = min(s.cfg.batchSize, s.cfg.credit), s.cfg.batchWait
	scratch := make([][]*Delivery, s.cfg.workers) // one per lane, reused
	tickets := make([][]driver.Ticket, s.cfg.workers)
	cfg.HandleBatch = func(lane int, ts []driver.Ticket) {
		batch := scratch[lane][:0]
		for _, t := range ts {
			d := newDelivery(t, lane, p)
			if err := s.poison(d); err != nil {
				s.settle(d, err)
				continue
			}
			batch = append(batch, d)
		}
		scratch[lane] = batch
		if len(batch) > 0 {
			held := tickets[lane][:0] // those handed to the handler, not the poisoned ones
			for _, d := range batch {
				held = append(held, d.t)
			}
			tickets[lane] = held
			bctx, done := p.dp.HandlerContext(ctx, held...)
			s.handleBatch(bctx, lane, batch)
			done()
		}
		clear(batch)
	}
	return cfg
}

func newDelivery(t driver.Ticket, lane int, p *pipe) *Delivery {
	return &Delivery{msg: t.Message(), lane: lane, t: t, p: p, l: p.current.Load()}
}
