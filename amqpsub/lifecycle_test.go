package amqpsub_test

import (
	"context"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

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
