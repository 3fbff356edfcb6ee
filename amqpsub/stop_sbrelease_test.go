package amqpsub_test

import (
	"context"
	"testing"
	"testing/synctest"
	"time"

	"github.com/Azure/go-amqp"

	"github.com/amqpsub/amqpsub/amqpsub"
	"github.com/amqpsub/amqpsub/internal/fake"
)

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
