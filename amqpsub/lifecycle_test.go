package amqpsub_test

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/Azure/go-amqp"
	"github.com/amqpsub/amqpsub/amqpsub"
	"github.com/amqpsub/amqpsub/internal/fake"
	"github.com/amqpsub/amqpsub/lanes"
)

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
	// cancelled (the review found keyed lanes and open batches left to a
	// race with the cut).
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
					opts := []amqpsub.Option{amqpsub.Credit(10), amqpsub.GracePeriod(0)}
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
