package amqpsub_test

import (
	"context"
	"testing"
	"testing/synctest"
	"time"

	"github.com/amqpsub/amqpsub/amqpsub"
	"github.com/amqpsub/amqpsub/internal/fake"
)

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
