package amqpsub

import (
	"context"
	"errors"
	"fmt"
	"math"
	"sync"
	"time"

	"go.uber.org/zap"

	"github.com/amqpsub/amqpsub/internal/driver"
	"github.com/amqpsub/amqpsub/internal/lanes"
	"github.com/amqpsub/amqpsub/internal/wait"
)

// Run connects, attaches a receiver to the queue and consumes until ctx is
// cancelled, Shutdown or Close is called, or a fatal error.
//
// Cancelling ctx starts a graceful stop, like Shutdown: no more credit,
// deliveries no handler has taken are released at once, handlers in
// progress get the grace period ([GracePeriod]) to finish and are settled;
// then the link, session and connection are closed within [CloseTimeout].
// Where the broker counts a release as a delivery attempt (a RabbitMQ 4
// quorum queue, see [RabbitMQ4]), the buffered deliveries are handled
// rather than released, for up to half the grace period.
// Close stops at once: handlers' ctx is cancelled and the connection closed
// within CloseTimeout; the broker redelivers what was held. A fatal error
// (see [FatalErrors]) stops the same way as a graceful stop, except that what
// is held can no longer be settled.
//
// Whatever the handlers do, Run returns within GracePeriod + CloseTimeout
// of the start of a stop, and within CloseTimeout of Close: handlers that
// have not returned by then are abandoned (their ctx is cancelled and their
// results ignored) and the error wraps [ErrAbandoned].
//
// Run returns nil after a stop it was asked for. It returns an error naming
// the broker when it cannot connect or attach at the start (within
// [DialTimeout]; with [DialFailover], within DialTimeout for each address
// tried, the error naming each), one wrapping [ErrLinkLost] when a lost link
// or connection could not be replaced, and [ErrClosed] when called a second
// time, or after Shutdown or Close.
func (s *Subscriber) Run(ctx context.Context) error {
	s.mu.Lock()
	if s.started {
		s.mu.Unlock()
		return ErrClosed // the first Run owns Done
	}
	s.started = true
	if s.closed {
		// Closed before it ran: this Run has returned, as Done says.
		close(s.done)
		s.mu.Unlock()
		return ErrClosed
	}
	s.mu.Unlock()
	defer close(s.done)
	s.events.start()

	// Handlers and the pumps outlive ctx by the grace period.
	hctx, cancelHandlers := context.WithCancelCause(context.WithoutCancel(ctx))
	defer cancelHandlers(ErrStopping)
	s.hctx = hctx // set before the lanes start; they read it
	pctx, cancelPump := context.WithCancel(context.WithoutCancel(ctx))
	defer cancelPump()

	// Each pipe's pump and lanes, and what its driver runs beside them. A pump that ends by itself
	// (attach failed for good) reports on ended; the lanes end when every
	// handler has returned: a handler that never returns keeps its lane,
	// which Run then leaves behind (abandoned).
	ended := make(chan *running, len(s.pipes))
	runs := make([]*running, len(s.pipes))
	for i, p := range s.pipes {
		r := &running{p: p, done: make(chan struct{}), lanesDone: make(chan struct{})}
		runs[i] = r
		// What the driver runs beside the pipe (a lease book) ends after the
		// pumps: their settlers may use it until they have returned.
		defer p.dp.Start(context.WithoutCancel(ctx))()
		go func() {
			r.err = p.pump.Run(pctx, p.att.attach)
			close(r.done)
			ended <- r
		}()
		go func() {
			defer close(r.lanesDone)
			lanes.Run(p.pump.Out(), s.laneConfig(hctx, p))
		}()
	}

	var fatal error
	why := "close"
	select {
	case r := <-ended:
		fatal = r.err
	case <-ctx.Done():
		why = "context"
	case <-s.stopReq:
		why = "shutdown"
	case <-s.closeReq:
	}
	stopAt := time.Now()
	closing := wait.Closed(s.closeReq)
	attached := uint64(0)
	for _, p := range s.pipes {
		attached += p.pump.Stats().Links
	}
	switch {
	case fatal != nil && attached == 0 && errors.Is(fatal, errQueueMismatch):
		// Connected, but the queue does not fit an option (MaxDeliveryCount
		// on a RabbitMQ classic queue).
		s.log.Error("an option does not fit the queue; stopping", zap.Error(fatal),
			zap.Duration("grace", s.cfg.grace), zap.Duration("close_timeout", s.cfg.closeTimeout))
	case fatal != nil && attached == 0:
		// Not fatal in itself (a refused connection may be), but Run does
		// not wait for a broker it never reached: see Backoff.
		s.log.Error("could not connect at start; stopping", zap.Error(fatal),
			zap.Duration("grace", s.cfg.grace), zap.Duration("close_timeout", s.cfg.closeTimeout))
	case fatal != nil:
		s.log.Error("stopping after a fatal error", zap.Error(fatal),
			zap.Duration("grace", s.cfg.grace), zap.Duration("close_timeout", s.cfg.closeTimeout))
	default:
		grace := s.cfg.grace
		if closing {
			why, grace = "close", 0
		}
		s.log.Info("stopping", zap.String("reason", why),
			zap.Duration("grace", grace), zap.Duration("close_timeout", s.cfg.closeTimeout))
	}
	if !closing && fatal == nil {
		s.finishBuffered(runs, stopAt)
	}
	if !closing {
		for _, r := range runs {
			r.p.pump.Stop() // from here on, lanes release what no handler has taken
		}
	}
	switch {
	case closing:
	case fatal != nil:
		// Attach failed for good: nothing held can be settled any more,
		// but handlers in progress get the grace period to finish.
		s.waitGrace(runs)
	default:
		s.graceful(runs, stopAt)
	}

	// Nothing more is decided: the results of handlers still running are
	// ignored from here on, and they are told to stop. What was decided
	// goes on being sent (FlushBy) until a quarter of CloseTimeout before
	// closeBy, but not after Close: Close sends nothing more.
	s.cut.Store(true)
	closeBy := time.Now().Add(s.cfg.closeTimeout)
	if grace := s.cfg.grace; !closing && fatal == nil {
		// The stop's bound holds, whatever graceful waited.
		closeBy = minTime(closeBy, stopAt.Add(addSat(grace, s.cfg.closeTimeout)))
	}
	if !wait.Closed(s.closeReq) { // Close, also one that cut the grace short, sends nothing more
		for _, r := range runs {
			r.p.pump.FlushBy(closeBy.Add(-s.cfg.closeTimeout / 4))
		}
	}
	cancelPump()
	cancelHandlers(ErrStopping)
	for _, r := range runs {
		r.p.pump.Stop() // after Close: lanes drop what they hold
	}
	var errs []error
	if fatal != nil {
		errs = append(errs, fatal)
	}
	var closings sync.WaitGroup
	for _, r := range runs {
		if !wait.Until(r.done, closeBy, nil) {
			if s.inOnReconnect.Load() > 0 {
				// Its attach goroutine is in OnReconnect, user code that
				// has not returned: the link it attached is closed once
				// that returns.
				s.log.Error("the receiver did not end within CloseTimeout: OnReconnect has not returned; leaving it",
					zap.Int("slot", r.p.index))
				errs = append(errs, fmt.Errorf("%w: OnReconnect had not returned %v after the stop began",
					ErrAbandoned, time.Since(stopAt).Round(time.Millisecond)))
			} else {
				s.log.Error("the pump did not end within CloseTimeout; leaving the link to the broker", zap.Int("slot", r.p.index))
			}
			continue
		}
		r.p.current.Store(nil)
		r.p.dp.SourceAttached(nil)
		if l := r.p.att.current; l != nil {
			closings.Go(func() { s.closeWithin(l, closeBy) })
		}
	}
	closings.Wait()
	for _, r := range runs {
		if !wait.Until(r.lanesDone, closeBy, nil) {
			if n := s.abandon(); n > 0 {
				errs = append(errs, fmt.Errorf("%w: %d handlers had not returned %v after the stop began",
					ErrAbandoned, n, time.Since(stopAt).Round(time.Millisecond)))
			}
			break
		}
	}
	if s.rec != nil {
		// What is still held now is settled by nobody (handlers cut short
		// or abandoned): the broker delivers it again. The Recorder hears
		// of it as dropped, so that received = settled + dropped there.
		held := 0
		for _, p := range s.pipes {
			held += p.pump.Held()
		}
		if held > 0 {
			s.rec.Dropped(held)
		}
	}
	if !s.events.close(closeBy) {
		s.log.Warn("the OnEvent function had not returned by the end of Run; leaving it")
	}
	// A limited line's count since it was last written at its level (a
	// stream of lost locks, say) is said now, or never.
	s.limited.Flush()
	err := errors.Join(errs...)
	s.log.Info("stopped", zap.Duration("elapsed", time.Since(stopAt)), zap.Error(err), zap.Object("stats", s.Stats()))
	return err
}

// endUnrun ends a subscriber stopped before it ran: a later Run returns
// ErrClosed at once, so Done is closed now (an adapter of WithMetrics stops
// reporting it). s.mu is held.
func (s *Subscriber) endUnrun() {
	if !s.started {
		s.started = true
		close(s.done)
	}
}

// running is a pipe while Run runs it.
type running struct {
	p         *pipe
	err       error         // the pump's result, once done is closed
	done      chan struct{} // the pump has returned
	lanesDone chan struct{} // the lanes have returned
}

// graceful waits for the pumps to settle everything held, up to the grace
// period. Close cuts the wait short.
//
// GracePeriod(0) waits only until each pump holds nothing but what
// handlers and settlers have: what waited in the pump, Out, a lane's queue
// or an open batch was released (or handed to a settler, which sends it
// after: see Run); and that for a quarter of CloseTimeout at most, so that
// a pump stuck on a settlement the broker does not take (a peer that
// stopped reading) cannot hold the stop past its bound.
func (s *Subscriber) graceful(runs []*running, stopAt time.Time) {
	if s.cfg.grace == 0 {
		by := time.Now().Add(s.cfg.closeTimeout / 4)
		for _, r := range runs {
			if !wait.Until(r.p.pump.Quiet(), by, s.closeReq) {
				if !wait.Closed(s.closeReq) {
					s.log.Warn("the receiver did not release what it held within a quarter of CloseTimeout; closing anyway",
						zap.Int("slot", r.p.index))
				}
				return
			}
		}
		return
	}
	by := stopAt.Add(s.cfg.grace)
	for _, r := range runs {
		if !wait.Until(r.done, by, s.closeReq) {
			if !wait.Closed(s.closeReq) {
				held, handling := 0, 0
				for _, r := range runs {
					st := r.p.pump.Stats()
					held, handling = held+st.Held, handling+st.Handling
				}
				s.log.Warn("grace period over; cancelling the handlers still running, the broker redelivers what they hold",
					zap.Int("handling", handling), zap.Int("held", held))
			}
			return
		}
	}
}

// finishBuffered is the first part of a graceful stop where the broker
// counts a release as a delivery attempt (a RabbitMQ 4 quorum queue): each
// such pump takes its credit back while the lanes go on with what is
// buffered, until nothing is held or half the grace period has passed, and
// only then does Stop release what is left. Releasing at once would cost
// every buffered delivery an attempt at every stop, and a consumer
// restarted at each deploy would see its queue dead-letter, at the
// delivery-limit, messages no handler ever saw. Close cuts it short;
// GracePeriod(0) skips it.
func (s *Subscriber) finishBuffered(runs []*running, stopAt time.Time) {
	if s.cfg.grace == 0 {
		return
	}
	var counted []*running
	for _, r := range runs {
		if r.p.dp.ReturnsCounted() {
			r.p.pump.Hold()
			counted = append(counted, r)
		}
	}
	by := stopAt.Add(s.cfg.grace / 2)
	for _, r := range counted {
		if !wait.Until(r.p.pump.Emptied(), by, s.closeReq) {
			if !wait.Closed(s.closeReq) {
				held := 0
				for _, r := range counted {
					held += r.p.pump.Held()
				}
				s.log.Warn("half the grace period passed before what was buffered was handled; releasing the rest, which the broker counts as delivery attempts",
					zap.Int("held", held))
			}
			return
		}
	}
}

// waitGrace waits for the handlers to return, up to the grace period; Close
// cuts it short.
func (s *Subscriber) waitGrace(runs []*running) {
	by := time.Now().Add(s.cfg.grace)
	for _, r := range runs {
		if !wait.Until(r.lanesDone, by, s.closeReq) {
			return
		}
	}
}

// abandon gives up on the handlers still running, logs them (one line,
// and one at debug for each delivery concerned), and returns how many
// there were.
func (s *Subscriber) abandon() int {
	n := int(s.running.Load())
	if n <= 0 {
		return 0
	}
	s.abandoned.Add(uint64(n))
	s.log.Warn("handlers abandoned: they did not return after their context was cancelled; the broker redelivers their deliveries",
		zap.Int("count", n))
	if s.debug() {
		for _, p := range s.pipes {
			p.pump.Each(func(pd *driver.Delivery) bool {
				if pd.State() == driver.Handling {
					s.log.Debug("handler abandoned", s.fields(&Delivery{msg: pd.Message(), lane: -1}, nil)...)
				}
				return true
			})
		}
	}
	s.events.send(Event{Kind: EventAbandoned, Queue: s.queue, Lane: -1, Count: n,
		Err: fmt.Errorf("%w: %d", ErrAbandoned, n)})
	return n
}

// Shutdown starts a graceful stop (see Run) and waits until Run has returned
// or ctx ends, whichever comes first; then it returns ctx.Err(). The stop
// goes on after ctx ends, bounded by [GracePeriod] + [CloseTimeout]. Shutdown
// before Run makes Run return [ErrClosed]. It is safe to call more than once.
func (s *Subscriber) Shutdown(ctx context.Context) error {
	s.mu.Lock()
	if !s.closed {
		s.closed = true
		close(s.stopReq)
	}
	started := s.started
	s.endUnrun()
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
// subscriber held. Close does not wait; Run returns within [CloseTimeout]. It
// is safe to call more than once, and after Shutdown.
func (s *Subscriber) Close() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.closed = true
	s.endUnrun()
	select {
	case <-s.closeReq:
	default:
		close(s.closeReq)
	}
	return nil
}

func minTime(a, b time.Time) time.Time {
	if b.Before(a) {
		return b
	}
	return a
}

// addSat is a + b for durations ≥ 0, at most the longest Duration.
func addSat(a, b time.Duration) time.Duration {
	if a > math.MaxInt64-b {
		return math.MaxInt64
	}
	return a + b
}
