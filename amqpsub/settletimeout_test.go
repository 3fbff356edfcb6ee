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

// SettleTimeout(d) bounds a Service Bus settlement by d, not by the
// default 30 s: the option reaches the engine through the driver's
// options (config.broker), which no other test checks.
func TestSettleTimeoutReachesTheEngine(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		src := fake.New(true, fake.Messages(1)...)
		src.SettleErr = func(ctx context.Context, _ *amqp.Message) error { <-ctx.Done(); return ctx.Err() }
		s, err := amqpsub.New(amqpsub.SourceOf(src), "q", amqpsub.HandlerFunc(func(context.Context, *amqpsub.Delivery) error {
			return nil
		}), amqpsub.SettleTimeout(2*time.Second), amqpsub.WithProfile(amqpsub.AzureServiceBus), amqpsub.MaxLockRenewal(0))
		if err != nil {
			t.Fatal(err)
		}
		cancel, errc := run(t, s)
		defer func() { cancel(); <-errc }()
		time.Sleep(3 * time.Second) // past SettleTimeout(2s), well within the default 30 s
		synctest.Wait()
		if st := s.Stats(); st.Locks.SettleTimeouts != 1 {
			t.Fatalf("settle timeouts %d after 3 s with SettleTimeout(2s); want 1: %v", st.Locks.SettleTimeouts, st)
		}
	})
}
