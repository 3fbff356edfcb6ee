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

	"github.com/amqpsub/amqpsub/amqpsub"
	"github.com/amqpsub/amqpsub/amqpsubtest"
	"github.com/amqpsub/amqpsub/internal/fake"
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

// LocalRetry ends at once for a delivery whose link was lost: no result of
// it could be settled, and the broker's redelivery must not wait behind
// it, nor run beside it.
func TestLocalRetryEndsWhenTheLinkIsLost(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		first := fake.New(true, fake.Messages(1, "g")...)
		second := fake.New(true)
		var calls, afterLoss atomic.Int32
		var lost atomic.Bool
		failing := make(chan struct{}, 1)
		s, err := amqpsub.New(amqpsub.SourcesOf(sources(first, second)), "q", amqpsub.HandlerFunc(func(context.Context, *amqpsub.Delivery) error {
			calls.Add(1)
			if lost.Load() {
				afterLoss.Add(1)
			}
			select {
			case failing <- struct{}{}:
			default:
			}
			return errors.New("store down")
		}), amqpsub.WithProfile(amqpsub.Artemis), amqpsub.WorkersByKey(1),
			amqpsub.LocalRetry(amqpsub.RetryPolicy{Initial: 100 * time.Millisecond, Max: 100 * time.Millisecond, Budget: time.Minute}),
			amqpsub.Backoff(time.Millisecond, time.Millisecond))
		if err != nil {
			t.Fatal(err)
		}
		cancel, errc := run(t, s)
		<-failing
		time.Sleep(250 * time.Millisecond) // a few retries in the lane
		lost.Store(true)
		first.Fail(fake.ErrLinkLost)
		time.Sleep(10 * time.Second)
		cancel()
		if err := <-errc; err != nil {
			t.Fatal(err)
		}
		t.Logf("handler calls %d, of which %d after the loss", calls.Load(), afterLoss.Load())
		if afterLoss.Load() > 0 {
			t.Fatalf("the handler ran %d times after its delivery's link was lost", afterLoss.Load())
		}
	})
}

func TestLocalRetryGivesUpToTheBroker(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		src := fake.New(true, fake.Messages(1)...)
		var calls atomic.Int64
		s, _ := amqpsub.New(amqpsub.SourceOf(src), "q", amqpsub.HandlerFunc(func(_ context.Context, d *amqpsub.Delivery) error {
			if calls.Add(1) <= 5 {
				return errors.New("down")
			}
			return nil
		}), amqpsub.LocalRetry(amqpsub.RetryPolicy{Attempts: 2, Initial: time.Millisecond, Max: time.Millisecond}))
		cancel, errc := run(t, s)
		synctest.Wait()
		time.Sleep(time.Second)
		cancel()
		<-errc
		// 1 call + 2 local retries, then modified; on the redelivery 2
		// more fail and the third is accepted.
		if calls.Load() != 6 || src.Count(fake.Modified) != 1 || src.Count(fake.Accepted) != 1 {
			t.Fatalf("calls %d modified %d accepted %d", calls.Load(), src.Count(fake.Modified), src.Count(fake.Accepted))
		}
	})
}

func TestBatchesAndTheirResults(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		msgs := fake.Messages(10)
		src := fake.New(true, msgs...)
		var mu sync.Mutex
		var sizes []int
		s, err := amqpsub.NewBatch(amqpsub.SourceOf(src), "q", amqpsub.BatchHandlerFunc(func(_ context.Context, b []*amqpsub.Delivery) []error {
			mu.Lock()
			sizes = append(sizes, len(b))
			mu.Unlock()
			res := make([]error, len(b))
			for i, d := range b {
				if index(d) == 7 && d.DeliveryCount() == 0 {
					res[i] = amqpsub.Reject("seven")
				}
			}
			return res
		}), amqpsub.Batch(4, 10*time.Millisecond))
		if err != nil {
			t.Fatal(err)
		}
		cancel, errc := run(t, s)
		synctest.Wait()
		time.Sleep(10 * time.Millisecond)
		synctest.Wait()
		cancel()
		if err := <-errc; err != nil {
			t.Fatal(err)
		}
		if fmt.Sprint(sizes) != "[4 4 2]" {
			t.Fatalf("batch sizes %v, want [4 4 2]", sizes)
		}
		if src.Count(fake.Accepted) != 9 || src.Count(fake.Rejected) != 1 {
			t.Fatalf("accepted %d rejected %d", src.Count(fake.Accepted), src.Count(fake.Rejected))
		}
	})
}

func TestBatchHandlerContractBreachesRetry(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		src := fake.New(true, fake.Messages(3)...)
		var calls atomic.Int64
		s, _ := amqpsub.NewBatch(amqpsub.SourceOf(src), "q", amqpsub.BatchHandlerFunc(func(_ context.Context, b []*amqpsub.Delivery) []error {
			switch calls.Add(1) {
			case 1:
				return make([]error, len(b)+1) // wrong length
			case 2:
				panic("batch boom")
			}
			return nil
		}), amqpsub.Batch(3, 10*time.Millisecond))
		cancel, errc := run(t, s)
		synctest.Wait()
		cancel()
		<-errc
		if src.Count(fake.Modified) != 6 || src.Count(fake.Accepted) != 3 {
			t.Fatalf("modified %d accepted %d", src.Count(fake.Modified), src.Count(fake.Accepted))
		}
		if s.Stats().Results.Panics != 1 {
			t.Fatal("panic not counted")
		}
	})
}
