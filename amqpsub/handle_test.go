package amqpsub_test

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/amqpsub/amqpsub/amqpsub"
	"github.com/amqpsub/amqpsub/amqpsubtest"
)

// runToEnd runs sub on q until every message has reached its end.
func runToEnd(t *testing.T, q *amqpsubtest.Queue, sub *amqpsub.Subscriber) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), time.Hour)
	defer cancel()
	if err := q.Drain(ctx, sub); err != nil {
		t.Fatal(err)
	}
}

// On Service Bus, MaxDeliveryCount(n) means what an entity's
// MaxDeliveryCount of n means: n deliveries are handled, the next one is
// dead-lettered unhandled. The entity's own limit is set far above, so
// only amqpsub's acts.
func TestMaxDeliveryCountOnServiceBusHandlesTheNthDelivery(t *testing.T) {
	for _, n := range []uint32{1, 3} {
		synctest.Test(t, func(t *testing.T) {
			q := amqpsubtest.NewQueue(amqpsubtest.WithProfile(amqpsub.AzureServiceBus), amqpsubtest.MaxDeliveryAttempts(100))
			q.Publish(amqpsubtest.Message("", "poison"))
			var calls atomic.Int32
			sub, err := amqpsub.New(q.Connector(), "q", amqpsub.HandlerFunc(func(context.Context, *amqpsub.Delivery) error {
				calls.Add(1)
				return errors.New("always")
			}), amqpsub.MaxDeliveryCount(n))
			if err != nil {
				t.Fatal(err)
			}
			runToEnd(t, q, sub)
			if got := calls.Load(); got != int32(n) {
				t.Errorf("MaxDeliveryCount(%d): handler called %d times, want %d", n, got, n)
			}
			dead := q.DeadLetters()
			if len(dead) != 1 {
				t.Fatalf("MaxDeliveryCount(%d): %d dead letters, want 1", n, len(dead))
			}
			r := dead[0]
			if r.Reason() != "MaxDeliveryCountExceeded" || !strings.Contains(r.Description(), "amqpsub") {
				t.Errorf("MaxDeliveryCount(%d): dead-lettered with reason %q, description %q", n, r.Reason(), r.Description())
			}
			if st := sub.Stats(); st.Results.Poisoned != 1 {
				t.Errorf("MaxDeliveryCount(%d): Poisoned = %d, want 1", n, st.Results.Poisoned)
			}
		})
	}
}

// The subscriber's limit and the entity's agree: with both at n the
// message is handled n times on either side of the limit.
func TestMaxDeliveryCountOnServiceBusMatchesTheEntity(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		const n = 4
		count := func(withOption bool) int32 {
			q := amqpsubtest.NewQueue(amqpsubtest.WithProfile(amqpsub.AzureServiceBus), amqpsubtest.MaxDeliveryAttempts(n))
			q.Publish(amqpsubtest.Message("", "poison"))
			var calls atomic.Int32
			opts := []amqpsub.Option{}
			if withOption {
				opts = append(opts, amqpsub.MaxDeliveryCount(n))
			}
			sub, err := amqpsub.New(q.Connector(), "q", amqpsub.HandlerFunc(func(context.Context, *amqpsub.Delivery) error {
				calls.Add(1)
				return errors.New("always")
			}), opts...)
			if err != nil {
				t.Fatal(err)
			}
			runToEnd(t, q, sub)
			return calls.Load()
		}
		if entity, both := count(false), count(true); entity != n || both != n {
			t.Fatalf("handler calls: entity's limit alone %d, with MaxDeliveryCount(%d) too %d; want %d each", entity, n, both, n)
		}
	})
}

// On Service Bus an oversized delivery is dead-lettered as Reject does
// there, with a reason and a description, not with
// amqp:link:message-size-exceeded.
func TestMaxMessageSizeOnServiceBusDeadLettersWithAReason(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		q := amqpsubtest.NewQueue(amqpsubtest.WithProfile(amqpsub.AzureServiceBus))
		q.Publish(amqpsubtest.Message("", strings.Repeat("x", 100)), amqpsubtest.Message("", "small"))
		var calls atomic.Int32
		sub, err := amqpsub.New(q.Connector(), "q", amqpsub.HandlerFunc(func(context.Context, *amqpsub.Delivery) error {
			calls.Add(1)
			return nil
		}), amqpsub.MaxMessageSize(64))
		if err != nil {
			t.Fatal(err)
		}
		runToEnd(t, q, sub)
		dead := q.DeadLetters()
		if len(dead) != 1 || calls.Load() != 1 {
			t.Fatalf("%d dead letters, %d handled; want 1 and 1", len(dead), calls.Load())
		}
		r := dead[0]
		last := r.Deliveries[len(r.Deliveries)-1]
		if last.Error == nil || last.Error.Condition != amqpsub.ErrCondDeadLetter {
			t.Fatalf("rejected with %v, want condition %s", last.Error, amqpsub.ErrCondDeadLetter)
		}
		if r.Reason() != "MaxMessageSizeExceeded" || !strings.Contains(r.Description(), "100 bytes") {
			t.Fatalf("dead-lettered with reason %q, description %q", r.Reason(), r.Description())
		}
	})
}
