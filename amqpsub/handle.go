package amqpsub

import (
	"context"
	"errors"
	"fmt"
	"runtime/debug"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
)

// handle runs the handler on d, after the poison check, and retries it in
// the lane as LocalRetry says.
func (s *Subscriber) handle(ctx context.Context, d *Delivery) error {
	if err := s.poison(d); err != nil {
		return err
	}
	err := s.call(ctx, d)
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
