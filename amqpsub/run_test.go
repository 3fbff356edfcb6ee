package amqpsub_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/Azure/go-amqp"

	"github.com/amqpsub/amqpsub/amqpsub"
	"github.com/amqpsub/amqpsub/amqpsubtest"
	"github.com/amqpsub/amqpsub/internal/fake"
	"github.com/amqpsub/amqpsub/internal/lanes"
)

func TestShutdownWaitsForRun(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		src := fake.New(true, fake.Messages(50)...)
		var started atomic.Int64
		finish := make(chan struct{})
		s, _ := amqpsub.New(amqpsub.SourceOf(src), "q", amqpsub.HandlerFunc(func(ctx context.Context, d *amqpsub.Delivery) error {
			started.Add(1)
			<-finish
			return ctx.Err()
		}), amqpsub.Credit(20), amqpsub.Workers(2))
		_, errc := run(t, s)
		synctest.Wait()
		shut := make(chan error, 1)
		go func() { shut <- s.Shutdown(context.Background()) }()
		synctest.Wait()
		select {
		case err := <-shut:
			t.Fatalf("Shutdown returned %v while 2 handlers run", err)
		default:
		}
		close(finish)
		if err := <-shut; err != nil {
			t.Fatal(err)
		}
		if err := <-errc; err != nil {
			t.Fatal(err)
		}
	})
}

// Run after a Run that ended with its ctx: ErrClosed, not a second pump.
func TestSecondRunAfterCtxEnd(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		src := fake.New(true, fake.Messages(1)...)
		s, _ := amqpsub.New(amqpsub.SourceOf(src), "q", amqpsub.HandlerFunc(func(context.Context, *amqpsub.Delivery) error { return nil }))
		cancel, errc := run(t, s)
		synctest.Wait()
		cancel()
		if err := <-errc; err != nil {
			t.Fatal(err)
		}
		if err := s.Run(context.Background()); !errors.Is(err, amqpsub.ErrClosed) {
			t.Fatalf("second Run = %v, want ErrClosed", err)
		}
	})
}

// Close during the grace period of a graceful stop (or of a fatal error's)
// ends the wait: Run returns within CloseTimeout of Close.
func TestCloseCutsTheGracePeriodShort(t *testing.T) {
	for _, fatal := range []bool{false, true} {
		synctest.Test(t, func(t *testing.T) {
			src := fake.New(true, fake.Messages(3)...)
			refused := errors.New("refused")
			s, _ := amqpsub.New(amqpsub.SourcesOf(sources(src, refused)), "q", amqpsub.HandlerFunc(func(ctx context.Context, _ *amqpsub.Delivery) error {
				<-ctx.Done()
				return ctx.Err()
			}), amqpsub.GracePeriod(time.Hour), amqpsub.CloseTimeout(time.Second),
				amqpsub.Backoff(time.Nanosecond, time.Nanosecond),
				amqpsub.FatalErrors(func(err error) bool { return errors.Is(err, refused) }))
			cancel, errc := run(t, s)
			synctest.Wait()
			if fatal {
				src.Fail(fake.ErrLinkLost)
			} else {
				cancel()
			}
			time.Sleep(time.Minute) // well into the grace period
			start := time.Now()
			s.Close()
			<-errc
			if d := time.Since(start); d != 0 {
				t.Fatalf("fatal %v: Run returned %v after Close, want at once", fatal, d)
			}
			cancel()
		})
	}
}

// A handler's context cancelled by a stop says so: its cause is
// ErrStopping, not a bare context.Canceled.
func TestStopCancelsHandlersWithErrStopping(t *testing.T) {
	q := amqpsubtest.NewQueue()
	q.Publish(amqpsubtest.Message("", "1"))
	began := make(chan struct{})
	cause := make(chan error, 1)
	s, err := amqpsub.New(q.Connector(), "q", amqpsub.HandlerFunc(func(ctx context.Context, _ *amqpsub.Delivery) error {
		close(began)
		<-ctx.Done()
		cause <- context.Cause(ctx)
		return ctx.Err()
	}), amqpsub.GracePeriod(0))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	errc := make(chan error, 1)
	go func() { errc <- s.Run(ctx) }()
	<-began
	cancel()
	if err := <-errc; err != nil {
		t.Fatal(err)
	}
	if c := <-cause; !errors.Is(c, amqpsub.ErrStopping) {
		t.Fatalf("cause %v, want ErrStopping", c)
	}
}

// GracePeriod(0): a stop that comes while the pump reattaches a lost link,
// with a handler in progress that honours its ctx. Run must return within
// GracePeriod + CloseTimeout (here 1 s).
func TestGraceZeroStopWhileReattaching(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		first := fake.New(true, fake.Messages(1)...)
		in := make(chan struct{}, 1)
		s, err := amqpsub.New(amqpsub.SourcesOf(sources(first)), "q", amqpsub.HandlerFunc(func(ctx context.Context, _ *amqpsub.Delivery) error {
			in <- struct{}{}
			<-ctx.Done()
			return ctx.Err()
		}), amqpsub.GracePeriod(0), amqpsub.CloseTimeout(time.Second),
			amqpsub.Backoff(time.Hour, time.Hour))
		if err != nil {
			t.Fatal(err)
		}
		cancel, errc := run(t, s)
		<-in
		first.Fail(fake.ErrLinkLost)
		synctest.Wait() // the pump is reattaching (backing off)
		start := time.Now()
		cancel()
		select {
		case err := <-errc:
			t.Logf("Run = %v after %v", err, time.Since(start))
			if d := time.Since(start); d > time.Second {
				t.Fatalf("Run took %v, past GracePeriod(0)+CloseTimeout(1s)", d)
			}
		case <-time.After(time.Hour):
			t.Fatalf("Run had not returned 1 h after the stop; stats %v", s.Stats())
		}
	})
}

// Service Bus profile (settlers), GracePeriod(0): a stop releases the 255
// buffered deliveries through 64 settlers; the service does not answer. Run
// must still return within GracePeriod + CloseTimeout (2 s).
func TestGraceZeroDoesNotWaitForUnansweredReleases(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		src := fake.New(true, fake.Messages(256)...)
		src.SettleErr = func(ctx context.Context, _ *amqp.Message) error { <-ctx.Done(); return ctx.Err() }
		in := make(chan struct{}, 1)
		s, err := amqpsub.New(amqpsub.SourceOf(src), "q", amqpsub.HandlerFunc(func(ctx context.Context, _ *amqpsub.Delivery) error {
			select {
			case in <- struct{}{}:
			default:
			}
			<-ctx.Done()
			return ctx.Err()
		}), amqpsub.WithProfile(amqpsub.AzureServiceBus), amqpsub.GracePeriod(0), amqpsub.CloseTimeout(2*time.Second),
			amqpsub.SettleTimeout(30*time.Second), amqpsub.MaxLockRenewal(0))
		if err != nil {
			t.Fatal(err)
		}
		cancel, errc := run(t, s)
		<-in
		synctest.Wait()
		start := time.Now()
		cancel()
		err = <-errc
		took := time.Since(start)
		t.Logf("Run = %v after %v; stats %v", err, took, s.Stats())
		if took > 2*time.Second {
			t.Fatalf("Run took %v, past GracePeriod(0)+CloseTimeout(2s)", took)
		}
	})
}

// A handler that honours its ctx is not abandoned: after the grace period
// its ctx is cancelled, it returns, and Run returns nil at once.
func TestHandlerThatHonoursCancelIsNotAbandoned(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		src := fake.New(true, fake.Messages(3)...)
		s, _ := amqpsub.New(amqpsub.SourceOf(src), "q", amqpsub.HandlerFunc(func(ctx context.Context, _ *amqpsub.Delivery) error {
			<-ctx.Done()
			return ctx.Err()
		}), amqpsub.GracePeriod(time.Second), amqpsub.CloseTimeout(time.Hour))
		cancel, errc := run(t, s)
		synctest.Wait()
		start := time.Now()
		cancel()
		if err := <-errc; err != nil {
			t.Fatalf("Run = %v", err)
		}
		if d := time.Since(start); d != time.Second {
			t.Fatalf("Run took %v, want the 1 s grace", d)
		}
		if st := s.Stats(); st.Abandoned != 0 {
			t.Fatalf("abandoned %d", st.Abandoned)
		}
	})
}

// GracePeriod(0) means one thing: the buffered deliveries are released and
// the handlers cancelled, at once, every time.
func TestGracePeriodZeroReleasesAndCancelsAtOnce(t *testing.T) {
	// Every shape: what waits in Out, in a keyed lane's queue, in the
	// balanced pool or in an open batch goes back before any handler is
	// cancelled: keyed lanes and open batches too, not left to a race
	// with the cut.
	var k0, k1 string // two keys on different lanes of 2
	for i := 0; k0 == "" || k1 == ""; i++ {
		k := fmt.Sprint("k", i)
		if lanes.LaneOf(k, 2) == 0 {
			k0 = k
		} else {
			k1 = k
		}
	}
	for _, tc := range []struct {
		shape    string
		msgs     []*amqp.Message
		handling int
	}{
		{"Workers(1)", fake.Messages(10, "g"), 1},
		{"WorkersByKey(2)", fake.Messages(10, "g"), 1},
		{"WorkersByKey(2)+BalanceKeys", fake.Messages(10, "g"), 1},
		// k0's lane fills a batch of 3 and is in the handler; k1's lane
		// holds 2 in a batch open for an hour.
		{"Batch(3,1h)+WorkersByKey(2)", fake.Messages(5, k0, k1), 3},
		{"Batch(1,0)+WorkersByKey(2)", fake.Messages(10, "g"), 1},
	} {
		t.Run(tc.shape, func(t *testing.T) {
			for range 20 {
				synctest.Test(t, func(t *testing.T) {
					src := fake.New(true, tc.msgs...)
					var cancelledAt atomic.Int64
					h := func(ctx context.Context) error {
						<-ctx.Done()
						cancelledAt.Store(int64(src.Count(fake.Released)))
						return ctx.Err()
					}
					single := amqpsub.HandlerFunc(func(ctx context.Context, _ *amqpsub.Delivery) error { return h(ctx) })
					batch := amqpsub.BatchHandlerFunc(func(ctx context.Context, b []*amqpsub.Delivery) []error { return []error{h(ctx)} })
					opts := []amqpsub.Option{amqpsub.Credit(10), amqpsub.FixedCredit(), amqpsub.GracePeriod(0)}
					var s *amqpsub.Subscriber
					switch tc.shape {
					case "Workers(1)":
						s, _ = amqpsub.New(amqpsub.SourceOf(src), "q", single, opts...)
					case "WorkersByKey(2)":
						s, _ = amqpsub.New(amqpsub.SourceOf(src), "q", single, append(opts, amqpsub.WorkersByKey(2))...)
					case "WorkersByKey(2)+BalanceKeys":
						s, _ = amqpsub.New(amqpsub.SourceOf(src), "q", single, append(opts, amqpsub.WorkersByKey(2), amqpsub.BalanceKeys())...)
					case "Batch(3,1h)+WorkersByKey(2)":
						s, _ = amqpsub.NewBatch(amqpsub.SourceOf(src), "q", batch, append(opts, amqpsub.Batch(3, time.Hour), amqpsub.WorkersByKey(2))...)
					case "Batch(1,0)+WorkersByKey(2)":
						s, _ = amqpsub.NewBatch(amqpsub.SourceOf(src), "q", batch, append(opts, amqpsub.Batch(1, 0), amqpsub.WorkersByKey(2))...)
					}
					cancel, errc := run(t, s)
					synctest.Wait()
					if st := s.Stats(); st.Handling != tc.handling || st.Held != len(tc.msgs) {
						t.Fatalf("before the stop: %v", st)
					}
					start := time.Now()
					cancel()
					if err := <-errc; err != nil {
						t.Fatalf("Run = %v", err)
					}
					if d := time.Since(start); d != 0 {
						t.Fatalf("Run took %v", d)
					}
					// What no handler had was released before the handler
					// was cancelled (some may have come back once and been
					// released again before the stop's drain landed).
					if n, want := cancelledAt.Load(), int64(len(tc.msgs)-tc.handling); n < want {
						t.Fatalf("%d released when the handler was cancelled, want %d", n, want)
					}
				})
			}
		})
	}
}

// stuck2 is stuck, recording when its ctx was cancelled.
type stuck2 struct {
	release     chan struct{}
	in          chan struct{}
	cancelledAt atomic.Int64 // UnixNano; 0: not (yet)
}

func (h *stuck2) Handle(ctx context.Context, _ *amqpsub.Delivery) error {
	h.in <- struct{}{}
	go func() {
		<-ctx.Done()
		h.cancelledAt.CompareAndSwap(0, time.Now().UnixNano())
	}()
	<-h.release
	return nil
}

func TestRunReturnsWhateverAHandlerDoes(t *testing.T) {
	const grace, closing = 2 * time.Second, time.Second
	for _, tc := range []struct {
		name     string
		stop     func(s *amqpsub.Subscriber, cancel context.CancelFunc, src *fake.Source) time.Time
		bound    time.Duration // Run returns this long after the stop began
		cancelAt time.Duration // the handlers' ctx is cancelled this long after
		fatal    bool
	}{
		{"ctx", func(_ *amqpsub.Subscriber, cancel context.CancelFunc, _ *fake.Source) time.Time {
			cancel()
			return time.Now()
		}, grace + closing, grace, false},
		{"Shutdown", func(s *amqpsub.Subscriber, _ context.CancelFunc, _ *fake.Source) time.Time {
			go func() { _ = s.Shutdown(context.Background()) }()
			return time.Now()
		}, grace + closing, grace, false},
		{"Close", func(s *amqpsub.Subscriber, _ context.CancelFunc, _ *fake.Source) time.Time {
			_ = s.Close()
			return time.Now()
		}, closing, 0, false},
		{"fatal error", func(_ *amqpsub.Subscriber, _ context.CancelFunc, src *fake.Source) time.Time {
			src.Fail(fake.ErrLinkLost)
			return time.Now()
		}, grace + closing, grace, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				src := fake.New(true, fake.Messages(10)...)
				refused := &amqp.Error{Condition: amqp.ErrCondNotFound, Description: "queue deleted"}
				h := &stuck2{release: make(chan struct{}), in: make(chan struct{}, 2)}
				var events []amqpsub.Event
				var mu sync.Mutex
				s, err := amqpsub.New(amqpsub.SourcesOf(sources(src, refused)), "q", h, amqpsub.Credit(4), amqpsub.Workers(2),
					amqpsub.GracePeriod(grace), amqpsub.CloseTimeout(closing), amqpsub.Backoff(time.Nanosecond, time.Nanosecond),
					amqpsub.OnEvent(func(e amqpsub.Event) {
						mu.Lock()
						events = append(events, e)
						mu.Unlock()
					}))
				if err != nil {
					t.Fatal(err)
				}
				ctx, cancel := context.WithCancel(context.Background())
				defer cancel()
				errc := make(chan error, 1)
				go func() { errc <- s.Run(ctx) }()
				<-h.in
				<-h.in
				synctest.Wait()
				began := tc.stop(s, cancel, src)
				err = <-errc
				// Backoff(1ns, 1ns): a fatal stop may begin up to 1ns late.
				slack := time.Duration(0)
				if tc.fatal {
					slack = time.Nanosecond
				}
				if took := time.Since(began); took < tc.bound || took > tc.bound+slack {
					t.Fatalf("Run returned %v after the stop began, want %v", took, tc.bound)
				}
				if at := time.Duration(h.cancelledAt.Load() - began.UnixNano()); h.cancelledAt.Load() == 0 || at < tc.cancelAt || at > tc.cancelAt+slack {
					t.Fatalf("handlers' ctx cancelled %v after the stop began, want %v", at, tc.cancelAt)
				}
				if !errors.Is(err, amqpsub.ErrAbandoned) || !strings.Contains(err.Error(), "2 handlers") {
					t.Fatalf("Run = %v, want ErrAbandoned naming 2 handlers", err)
				}
				if tc.fatal != errors.Is(err, refused) || tc.fatal != errors.Is(err, amqpsub.ErrLinkLost) {
					t.Fatalf("Run = %v: fatal error reported %v, want %v", err, errors.Is(err, refused), tc.fatal)
				}
				settledBefore := len(src.Settlements())
				close(h.release)
				synctest.Wait()
				if n := len(src.Settlements()); n != settledBefore || src.Count(fake.Accepted) != 0 {
					t.Fatalf("the abandoned handlers' results were settled (%d settlements)", n-settledBefore)
				}
				if st := s.Stats(); st.Abandoned != 2 || st.Results.Accept != 0 {
					t.Fatalf("stats %v: want 2 abandoned, their results not counted", st)
				}
				mu.Lock()
				defer mu.Unlock()
				last := events[len(events)-1]
				if last.Kind != amqpsub.EventAbandoned || last.Count != 2 || last.Queue != "q" {
					t.Fatalf("last event %v, want abandoned", last)
				}
			})
		})
	}
}

// Close during a graceful stop's grace period sends nothing more: the
// settlers do not go on flushing after it.
func TestCloseDuringTheGracePeriodSendsNothingMore(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		src := fake.New(true, fake.Messages(2)...)
		var closedAt atomic.Int64
		var mu sync.Mutex
		var acceptedAfterClose time.Duration = -1
		src.SettleErr = func(ctx context.Context, m *amqp.Message) error {
			if m.Value.(int) != 0 {
				return nil
			}
			// The service answers this accept 2 s after it is sent.
			tm := time.NewTimer(2 * time.Second)
			defer tm.Stop()
			select {
			case <-tm.C:
				if c := closedAt.Load(); c != 0 {
					mu.Lock()
					acceptedAfterClose = time.Since(time.Unix(0, c))
					mu.Unlock()
				}
				return nil
			case <-ctx.Done():
				return ctx.Err()
			}
		}
		stopped := make(chan struct{})
		s, err := amqpsub.New(amqpsub.SourceOf(src), "q", amqpsub.HandlerFunc(func(ctx context.Context, d *amqpsub.Delivery) error {
			if index(d) == 0 {
				<-stopped
				return nil // returns in the grace period
			}
			<-ctx.Done() // holds the grace period open
			return ctx.Err()
		}), amqpsub.WithProfile(amqpsub.AzureServiceBus), amqpsub.GracePeriod(time.Minute), amqpsub.CloseTimeout(4*time.Second),
			amqpsub.MaxLockRenewal(0))
		if err != nil {
			t.Fatal(err)
		}
		cancel, errc := run(t, s)
		synctest.Wait()
		cancel() // graceful stop, 1 min grace
		synctest.Wait()
		close(stopped) // handler 0 returns: its accept goes to a settler
		time.Sleep(100 * time.Millisecond)
		closedAt.Store(time.Now().UnixNano())
		s.Close()
		err = <-errc
		took := time.Since(time.Unix(0, closedAt.Load()))
		mu.Lock()
		a := acceptedAfterClose
		mu.Unlock()
		t.Logf("Run = %v %v after Close; accept answered %v after Close; stats %v", err, took, a, s.Stats())
		if a >= 0 {
			t.Fatalf("a settlement was still being sent, and taken, %v after Close", a)
		}
	})
}

// Service Bus (settlers), GracePeriod(0): the accepts of handlers that
// returned before the stop, and the releases of what no handler had, are
// all sent before Run returns, though each waits 5 ms for its answer.
func TestGraceZeroSendsEverySettlementDecidedBeforeTheStop(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		const total, done = 256, 175
		src := fake.New(true, fake.Messages(total)...)
		src.SettleDelay = 5 * time.Millisecond
		blocked := make(chan struct{})
		var calls atomic.Int32
		s, err := amqpsub.New(amqpsub.SourceOf(src), "q", amqpsub.HandlerFunc(func(ctx context.Context, d *amqpsub.Delivery) error {
			calls.Add(1)
			if index(d) < done {
				return nil
			}
			close(blocked) // the handler of message `done`: the stop comes now
			<-ctx.Done()
			return ctx.Err()
		}), amqpsub.WithProfile(amqpsub.AzureServiceBus), amqpsub.GracePeriod(0), amqpsub.CloseTimeout(2*time.Second),
			amqpsub.MaxLockRenewal(0), amqpsub.FixedCredit())
		if err != nil {
			t.Fatal(err)
		}
		cancel, errc := run(t, s)
		<-blocked
		start := time.Now()
		cancel()
		err = <-errc
		took := time.Since(start)
		st := s.Stats()
		t.Logf("Run = %v after %v; accepted %d, released %d; stats %v", err, took, src.Count(fake.Accepted), src.Count(fake.Released), st)
		if took > 2*time.Second {
			t.Fatalf("Run took %v, past GracePeriod(0)+CloseTimeout(2s)", took)
		}
		if got := src.Count(fake.Accepted); got != done {
			t.Errorf("%d accepts reached the broker, want the %d of the handlers that returned before the stop", got, done)
		}
		if got := src.Count(fake.Released); got != total-done-1 {
			t.Errorf("%d releases reached the broker, want the %d deliveries no handler had", got, total-done-1)
		}
		if st.Held != 1 || st.Unsent != 0 {
			t.Errorf("held %d, unsent %d after Run: want 1 (the handler cut short), 0", st.Held, st.Unsent)
		}
	})
}

// Whatever the settlers could not send before the stop's bound is counted
// as not sent, not lost from the counts: here the service never answers.
func TestStopCountsSettlementsItCouldNotSend(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		src := fake.New(true, fake.Messages(10)...)
		src.SettleErr = func(ctx context.Context, _ *amqp.Message) error { <-ctx.Done(); return ctx.Err() }
		var handled atomic.Int32
		s, err := amqpsub.New(amqpsub.SourceOf(src), "q", amqpsub.HandlerFunc(func(context.Context, *amqpsub.Delivery) error {
			handled.Add(1)
			return nil
		}), amqpsub.WithProfile(amqpsub.AzureServiceBus), amqpsub.GracePeriod(0), amqpsub.CloseTimeout(time.Second),
			amqpsub.SettleTimeout(time.Minute), amqpsub.MaxLockRenewal(0), amqpsub.FixedCredit())
		if err != nil {
			t.Fatal(err)
		}
		cancel, errc := run(t, s)
		synctest.Wait()
		start := time.Now()
		cancel()
		err = <-errc
		took := time.Since(start)
		st := s.Stats()
		t.Logf("Run = %v after %v; stats %v", err, took, st)
		if took > time.Second {
			t.Fatalf("Run took %v, past CloseTimeout(1s)", took)
		}
		if handled.Load() != 10 || st.Results.Accept != 10 {
			t.Fatalf("handled %d, accepted results %d; want 10", handled.Load(), st.Results.Accept)
		}
		if st.Unsent != 10 || st.Held != 0 {
			t.Errorf("unsent %d, held %d after Run; want 10, 0", st.Unsent, st.Held)
		}
	})
}

// GracePeriod(0) on a broker settled on the pump's goroutine (Artemis):
// an accept stuck in the link (a peer that stopped reading: go-amqp waits
// for the write, whatever the ctx) must not hold Run past GracePeriod +
// CloseTimeout.
func TestGraceZeroStopWithASettlementStuckInTheLink(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		src := fake.New(true, fake.Messages(4)...)
		stuck, unstick := make(chan struct{}), make(chan struct{})
		var once sync.Once
		src.SettleErr = func(context.Context, *amqp.Message) error {
			once.Do(func() { close(stuck) })
			<-unstick // ignores ctx, as a blocked write does
			return nil
		}
		defer close(unstick)
		s, err := amqpsub.New(amqpsub.SourceOf(src), "q", amqpsub.HandlerFunc(func(context.Context, *amqpsub.Delivery) error { return nil }),
			amqpsub.WithProfile(amqpsub.Artemis), amqpsub.GracePeriod(0), amqpsub.CloseTimeout(time.Second))
		if err != nil {
			t.Fatal(err)
		}
		cancel, errc := run(t, s)
		<-stuck
		start := time.Now()
		cancel()
		select {
		case err := <-errc:
			t.Logf("Run = %v after %v", err, time.Since(start))
			if d := time.Since(start); d > time.Second {
				t.Fatalf("Run took %v, past GracePeriod(0)+CloseTimeout(1s)", d)
			}
		case <-time.After(time.Hour):
			t.Fatalf("Run had not returned 1 h after the stop")
		}
	})
}

func TestShutdownReleasesBufferedAndSettlesInProgress(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		src := fake.New(true, fake.Messages(50)...)
		var started atomic.Int64
		finish := make(chan struct{})
		s, _ := amqpsub.New(amqpsub.SourceOf(src), "q", amqpsub.HandlerFunc(func(ctx context.Context, d *amqpsub.Delivery) error {
			started.Add(1)
			<-finish
			return ctx.Err() // nil unless the grace period ran out
		}), amqpsub.Credit(20), amqpsub.FixedCredit(), amqpsub.Workers(2))
		_, errc := run(t, s)
		synctest.Wait()
		shut := make(chan error, 1)
		go func() { shut <- s.Shutdown(context.Background()) }()
		synctest.Wait()
		if n := src.Count(fake.Released); n != 18 {
			t.Fatalf("released %d at shutdown, want the 18 buffered", n)
		}
		close(finish)
		if err := <-shut; err != nil {
			t.Fatal(err)
		}
		if err := <-errc; err != nil {
			t.Fatal(err)
		}
		if started.Load() != 2 || src.Count(fake.Accepted) != 2 {
			t.Fatalf("handlers started %d, accepted %d", started.Load(), src.Count(fake.Accepted))
		}
		if err := s.Shutdown(context.Background()); err != nil {
			t.Fatalf("second Shutdown: %v", err)
		}
		if err := s.Close(); err != nil {
			t.Fatalf("Close after Shutdown: %v", err)
		}
		if err := s.Run(context.Background()); !errors.Is(err, amqpsub.ErrClosed) {
			t.Fatalf("second Run = %v", err)
		}
	})
}

func TestGracePeriodCancelsHandlers(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		src := fake.New(true, fake.Messages(5)...)
		s, _ := amqpsub.New(amqpsub.SourceOf(src), "q", amqpsub.HandlerFunc(func(ctx context.Context, d *amqpsub.Delivery) error {
			<-ctx.Done()
			return ctx.Err()
		}), amqpsub.Credit(5), amqpsub.GracePeriod(2*time.Second))
		cancel, errc := run(t, s)
		synctest.Wait()
		start := time.Now()
		cancel()
		if err := <-errc; err != nil {
			t.Fatal(err)
		}
		if d := time.Since(start); d != 2*time.Second {
			t.Fatalf("stopped after %v, want the 2 s grace", d)
		}
		// The handler's delivery was left for the broker to redeliver.
		if n := src.Count(fake.Accepted) + src.Count(fake.Modified); n != 0 {
			t.Fatalf("%d settled after the grace period", n)
		}
	})
}

func TestCloseStopsAtOnce(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		src := fake.New(true, fake.Messages(5)...)
		var cancelled atomic.Bool
		s, _ := amqpsub.New(amqpsub.SourceOf(src), "q", amqpsub.HandlerFunc(func(ctx context.Context, d *amqpsub.Delivery) error {
			<-ctx.Done()
			cancelled.Store(true)
			return ctx.Err()
		}))
		_, errc := run(t, s)
		synctest.Wait()
		start := time.Now()
		s.Close()
		s.Close()
		if err := <-errc; err != nil {
			t.Fatal(err)
		}
		if time.Since(start) != 0 || !cancelled.Load() {
			t.Fatal("Close did not cancel the handler at once")
		}
	})
}

func TestShutdownBeforeRun(t *testing.T) {
	s, _ := amqpsub.New(nowhere, "q", amqpsub.HandlerFunc(func(context.Context, *amqpsub.Delivery) error { return nil }))
	if err := s.Shutdown(context.Background()); err != nil {
		t.Fatal(err)
	}
	if err := s.Run(context.Background()); !errors.Is(err, amqpsub.ErrClosed) {
		t.Fatalf("Run = %v", err)
	}
	// Run has returned: Done says so (amqpsubtest's Drain waits on it).
	select {
	case <-s.Done():
	default:
		t.Fatal("Run returned ErrClosed, but Done is not closed")
	}
	if err := s.Run(context.Background()); !errors.Is(err, amqpsub.ErrClosed) {
		t.Fatalf("second Run = %v", err)
	}
}
