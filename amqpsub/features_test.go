package amqpsub_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/Azure/go-amqp"
	"go.uber.org/zap"

	"github.com/amqpsub/amqpsub/amqpsub"
	"github.com/amqpsub/amqpsub/internal/fake"
	"github.com/amqpsub/amqpsub/lanes"
)

// Batch(1, …) is valid: a BatchHandler gets batches of one. (It used to
// take the unbatched path and call a nil Handle.)
func TestBatchOfOne(t *testing.T) {
	for _, shape := range []amqpsub.Option{amqpsub.Workers(2), amqpsub.WorkersByKey(2)} {
		synctest.Test(t, func(t *testing.T) {
			src := fake.New(true, fake.Messages(6, "a", "b")...)
			var sizes []int
			var mu sync.Mutex
			s, err := amqpsub.NewBatch(nowhere, "q", amqpsub.BatchHandlerFunc(func(_ context.Context, b []*amqpsub.Delivery) []error {
				mu.Lock()
				sizes = append(sizes, len(b))
				mu.Unlock()
				return nil
			}), amqpsub.Batch(1, time.Second), shape, amqpsub.WithSource(src))
			if err != nil {
				t.Fatal(err)
			}
			cancel, errc := run(t, s)
			synctest.Wait()
			cancel()
			if err := <-errc; err != nil {
				t.Fatal(err)
			}
			if fmt.Sprint(sizes) != "[1 1 1 1 1 1]" || src.Count(fake.Accepted) != 6 {
				t.Fatalf("batches %v, accepted %d", sizes, src.Count(fake.Accepted))
			}
		})
	}
}

// Batch(n, 0) means no wait: a batch closes as soon as nothing more waits.
func TestBatchWithoutWait(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		src := fake.New(true, fake.Messages(10)...)
		var sizes []int
		start := time.Now()
		var at []time.Duration
		s, _ := amqpsub.NewBatch(nowhere, "q", amqpsub.BatchHandlerFunc(func(_ context.Context, b []*amqpsub.Delivery) []error {
			sizes = append(sizes, len(b))
			at = append(at, time.Since(start))
			return nil
		}), amqpsub.Batch(4, 0), amqpsub.WithSource(src))
		cancel, errc := run(t, s)
		synctest.Wait()
		src.Push(fake.Messages(1)...) // a lone delivery goes at once
		synctest.Wait()
		cancel()
		if err := <-errc; err != nil {
			t.Fatal(err)
		}
		total := 0
		for i, n := range sizes {
			total += n
			if n > 4 || at[i] != 0 {
				t.Fatalf("batch %d of %d at %v", i, n, at[i])
			}
		}
		if total != 11 || sizes[len(sizes)-1] != 1 {
			t.Fatalf("batches %v", sizes)
		}
	})
}

// Every option at its smallest valid value, together, runs end to end.
func TestSmallestValidOptionsRun(t *testing.T) {
	for _, batch := range []bool{false, true} {
		for _, keyed := range []bool{false, true} {
			synctest.Test(t, func(t *testing.T) {
				src := fake.New(true, fake.Messages(20, "a", "b", "")...)
				var handled atomic.Int64
				opts := []amqpsub.Option{
					amqpsub.Credit(1), amqpsub.GracePeriod(0), amqpsub.DialTimeout(time.Nanosecond),
					amqpsub.CloseTimeout(time.Nanosecond), amqpsub.WithProfile(amqpsub.Generic),
					amqpsub.Logger(zap.NewNop()), amqpsub.LinkName(""), amqpsub.IdleTimeout(100 * time.Millisecond),
					amqpsub.Backoff(time.Nanosecond, time.Nanosecond), amqpsub.FatalErrors(nil),
					amqpsub.OnReconnect(nil), amqpsub.OnEvent(nil),
					amqpsub.LocalRetry(amqpsub.RetryPolicy{Attempts: 1, Initial: 0, Max: 0}),
					amqpsub.MaxDeliveryCount(0), amqpsub.WithSource(src),
				}
				if keyed {
					opts = append(opts, amqpsub.WorkersByKey(1))
				} else {
					opts = append(opts, amqpsub.Workers(1))
				}
				var s *amqpsub.Subscriber
				var err error
				if batch {
					opts = append(opts, amqpsub.Batch(1, 0))
					s, err = amqpsub.NewBatch(nowhere, "q", amqpsub.BatchHandlerFunc(func(_ context.Context, b []*amqpsub.Delivery) []error {
						handled.Add(int64(len(b)))
						return nil
					}), opts...)
				} else {
					s, err = amqpsub.New(nowhere, "q", amqpsub.HandlerFunc(func(context.Context, *amqpsub.Delivery) error {
						handled.Add(1)
						return nil
					}), opts...)
				}
				if err != nil {
					t.Fatal(err)
				}
				cancel, errc := run(t, s)
				synctest.Wait()
				cancel()
				if err := <-errc; err != nil {
					t.Fatal(err)
				}
				if handled.Load() != 20 || src.Count(fake.Accepted) != 20 {
					t.Fatalf("batch %v keyed %v: handled %d accepted %d", batch, keyed, handled.Load(), src.Count(fake.Accepted))
				}
			})
		}
	}
}

// The largest credit runs too, and lets the broker send everything it has.
func TestLargestCreditRuns(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		src := fake.New(true, fake.Messages(1000, "a", "b", "c")...)
		gate := make(chan struct{})
		s, err := amqpsub.New(nowhere, "q", amqpsub.HandlerFunc(func(context.Context, *amqpsub.Delivery) error {
			<-gate
			return nil
		}), amqpsub.Credit(1<<20), amqpsub.WorkersByKey(64), amqpsub.WithSource(src))
		if err != nil {
			t.Fatal(err)
		}
		cancel, errc := run(t, s)
		synctest.Wait()
		if st := s.Stats(); st.Held != 1000 {
			t.Fatalf("held %d of the 1000 queued", st.Held)
		}
		close(gate)
		synctest.Wait()
		cancel()
		if err := <-errc; err != nil {
			t.Fatal(err)
		}
		if st := s.Stats(); st.MaxHeld != 1000 || st.Settled.Accepted != 1000 {
			t.Fatalf("stats %v", st)
		}
	})
}

// A Delivery stays valid after its handler returned: a goroutine it was
// handed to reads the same message, not a later one.
func TestRetainedDeliveryKeepsItsMessage(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		src := fake.New(true, fake.Messages(50, "k")...)
		var kept []*amqpsub.Delivery
		var seen []int
		s, _ := amqpsub.New(nowhere, "q", amqpsub.HandlerFunc(func(_ context.Context, d *amqpsub.Delivery) error {
			kept = append(kept, d)
			seen = append(seen, index(d))
			return nil
		}), amqpsub.Credit(2), amqpsub.WithSource(src))
		cancel, errc := run(t, s)
		synctest.Wait()
		cancel()
		if err := <-errc; err != nil {
			t.Fatal(err)
		}
		for i, d := range kept {
			if index(d) != seen[i] || d.GroupID() != "k" || d.Lane() != 0 {
				t.Fatalf("delivery %d now reads message %d", seen[i], index(d))
			}
		}
	})
}

// OnEvent hears of handler failures and panics with the delivery's
// identity, of lost links and reconnects, in order, off the lanes'
// goroutines.
func TestEventsReachTheHook(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		msgs := fake.Messages(3, "g")
		id := "m-1"
		msgs[1].Properties.MessageID = id
		msgs[1].Header = &amqp.MessageHeader{DeliveryCount: 2}
		first := fake.New(true, msgs...)
		second := fake.New(true)
		boom := errors.New("store down")
		var mu sync.Mutex
		var got []amqpsub.Event
		var calls [3]atomic.Int64 // the fake broker redelivers without counting
		s, _ := amqpsub.New(nowhere, "orders", amqpsub.HandlerFunc(func(_ context.Context, d *amqpsub.Delivery) error {
			first := calls[index(d)].Add(1) == 1
			switch {
			case index(d) == 1 && first:
				return boom
			case index(d) == 2 && first:
				panic("bad")
			}
			return nil
		}), amqpsub.WorkersByKey(2), amqpsub.Backoff(time.Millisecond, time.Millisecond),
			amqpsub.OnEvent(func(e amqpsub.Event) {
				mu.Lock()
				got = append(got, e)
				mu.Unlock()
			}), amqpsub.WithSources(sources(first, second)))
		cancel, errc := run(t, s)
		synctest.Wait()
		first.Fail(fake.ErrLinkLost)
		synctest.Wait()
		time.Sleep(time.Second)
		cancel()
		if err := <-errc; err != nil {
			t.Fatal(err)
		}
		mu.Lock()
		defer mu.Unlock()
		var kinds []string
		for _, e := range got {
			kinds = append(kinds, e.Kind.String())
		}
		// The panic also ends as a failed attempt sent to the broker.
		want := "[handler-failed handler-panicked handler-failed link-lost reconnected]"
		if fmt.Sprint(kinds) != want {
			t.Fatalf("events %v, want %s", kinds, want)
		}
		if e := got[0]; e.MessageID != id || e.GroupID != "g" || e.DeliveryCount != 2 || e.Lane != lanes.LaneOf("g", 2) ||
			e.Queue != "orders" || !errors.Is(e.Err, boom) {
			t.Fatalf("first event %+v", e)
		}
		if e := got[1]; !errors.Is(e.Err, amqpsub.ErrHandlerPanic) {
			t.Fatalf("panic event %+v", e)
		}
		if e := got[4]; e.Attempt != 1 || !errors.Is(e.Err, fake.ErrLinkLost) {
			t.Fatalf("reconnect event %+v", e)
		}
	})
}
