package amqpsub_test

import (
	"context"
	"errors"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/Azure/go-amqp"

	"github.com/amqpsub/amqpsub/amqpsub"
	"github.com/amqpsub/amqpsub/internal/fake"
)

// stuck is a handler that never returns until released, whatever its ctx
// says; it records whether its ctx was cancelled.
type stuck struct {
	release   chan struct{}
	in        chan struct{}
	cancelled atomic.Bool
}

func newStuck() *stuck { return &stuck{release: make(chan struct{}), in: make(chan struct{}, 1)} }

func (h *stuck) Handle(ctx context.Context, _ *amqpsub.Delivery) error {
	select {
	case h.in <- struct{}{}:
	default:
	}
	<-h.release
	h.cancelled.Store(ctx.Err() != nil)
	return nil // would accept, were it not abandoned
}

// Whatever a handler does, Run returns within GracePeriod + CloseTimeout of
// the start of a stop (CloseTimeout after Close), with an error naming the
// handlers it abandoned, whose ctx it cancelled and whose results it
// ignores. One case per way a stop begins.
func TestRunReturnsWhateverAHandlerDoes(t *testing.T) {
	const grace, closing = 2 * time.Second, time.Second
	for _, tc := range []struct {
		name string
		// stop begins the stop and returns when it began.
		stop func(s *amqpsub.Subscriber, cancel context.CancelFunc, src *fake.Source) time.Time
		// bound is how long Run may take after the stop began.
		bound time.Duration
		fatal bool
	}{
		{"ctx", func(_ *amqpsub.Subscriber, cancel context.CancelFunc, _ *fake.Source) time.Time {
			cancel()
			return time.Now()
		}, grace + closing, false},
		{"Shutdown", func(s *amqpsub.Subscriber, _ context.CancelFunc, _ *fake.Source) time.Time {
			go func() { _ = s.Shutdown(context.Background()) }()
			return time.Now()
		}, grace + closing, false},
		{"Close", func(s *amqpsub.Subscriber, _ context.CancelFunc, _ *fake.Source) time.Time {
			_ = s.Close()
			return time.Now()
		}, closing, false},
		{"fatal error", func(_ *amqpsub.Subscriber, _ context.CancelFunc, src *fake.Source) time.Time {
			// The link is lost and the reconnect is refused for good;
			// Backoff(1ns, 1ns) makes the stop begin within a nanosecond.
			src.Fail(fake.ErrLinkLost)
			return time.Now()
		}, grace + closing + time.Nanosecond, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				src := fake.New(true, fake.Messages(10)...)
				refused := &amqp.Error{Condition: amqp.ErrCondNotFound, Description: "queue deleted"}
				h := newStuck()
				var events []amqpsub.Event
				var mu sync.Mutex
				s, err := amqpsub.New(nowhere, "q", h, amqpsub.Credit(4),
					amqpsub.GracePeriod(grace), amqpsub.CloseTimeout(closing), amqpsub.Backoff(time.Nanosecond, time.Nanosecond),
					amqpsub.OnEvent(func(e amqpsub.Event) {
						mu.Lock()
						events = append(events, e)
						mu.Unlock()
					}),
					amqpsub.WithSources(sources(src, refused)))
				if err != nil {
					t.Fatal(err)
				}
				ctx, cancel := context.WithCancel(context.Background())
				defer cancel()
				errc := make(chan error, 1)
				go func() { errc <- s.Run(ctx) }()
				<-h.in
				synctest.Wait()
				began := tc.stop(s, cancel, src)
				err = <-errc
				took := time.Since(began)
				if took > tc.bound {
					t.Fatalf("Run returned %v after the stop began, past %v", took, tc.bound)
				}
				if !errors.Is(err, amqpsub.ErrAbandoned) || !strings.Contains(err.Error(), "1 handlers") {
					t.Fatalf("Run = %v, want ErrAbandoned naming 1 handler", err)
				}
				if tc.fatal != errors.Is(err, refused) || tc.fatal != errors.Is(err, amqpsub.ErrLinkLost) {
					t.Fatalf("Run = %v: fatal error reported %v, want %v", err, errors.Is(err, refused), tc.fatal)
				}
				if st := s.Stats(); st.Abandoned != 1 {
					t.Fatalf("stats %v", st)
				}
				settledBefore := len(src.Settlements())
				close(h.release)
				synctest.Wait()
				if !h.cancelled.Load() {
					t.Fatal("the abandoned handler's ctx was not cancelled")
				}
				if n := len(src.Settlements()); n != settledBefore || src.Count(fake.Accepted) != 0 {
					t.Fatalf("the abandoned handler's result was settled (%d settlements, %d accepted)", n-settledBefore, src.Count(fake.Accepted))
				}
				mu.Lock()
				defer mu.Unlock()
				last := events[len(events)-1]
				if last.Kind != amqpsub.EventAbandoned || last.Count != 1 || last.Queue != "q" {
					t.Fatalf("last event %v, want abandoned", last)
				}
			})
		})
	}
}

// A handler that honours its ctx is not abandoned: after the grace period
// its ctx is cancelled, it returns, and Run returns nil at once.
func TestHandlerThatHonoursCancelIsNotAbandoned(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		src := fake.New(true, fake.Messages(3)...)
		s, _ := amqpsub.New(nowhere, "q", amqpsub.HandlerFunc(func(ctx context.Context, _ *amqpsub.Delivery) error {
			<-ctx.Done()
			return ctx.Err()
		}), amqpsub.GracePeriod(time.Second), amqpsub.CloseTimeout(time.Hour), amqpsub.WithSource(src))
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
	for range 20 {
		synctest.Test(t, func(t *testing.T) {
			src := fake.New(true, fake.Messages(10)...)
			var cancelledAt atomic.Int64
			s, _ := amqpsub.New(nowhere, "q", amqpsub.HandlerFunc(func(ctx context.Context, _ *amqpsub.Delivery) error {
				<-ctx.Done()
				cancelledAt.Store(int64(src.Count(fake.Released)))
				return ctx.Err()
			}), amqpsub.Credit(10), amqpsub.GracePeriod(0), amqpsub.WithSource(src))
			cancel, errc := run(t, s)
			synctest.Wait()
			start := time.Now()
			cancel()
			if err := <-errc; err != nil {
				t.Fatalf("Run = %v", err)
			}
			if d := time.Since(start); d != 0 {
				t.Fatalf("Run took %v", d)
			}
			// The 9 buffered were released before the handler was cancelled.
			if n := cancelledAt.Load(); n != 9 {
				t.Fatalf("%d released when the handler was cancelled, want 9", n)
			}
		})
	}
}
