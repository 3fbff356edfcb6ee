package amqpsub_test

import (
	"context"
	"errors"
	"fmt"
	"math"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"go.uber.org/zap"

	"github.com/amqpsub/amqpsub/amqpsub"
	"github.com/amqpsub/amqpsub/internal/fake"
)

// Batch(1, …) is valid: a BatchHandler gets batches of one. (It used to
// take the unbatched path and call a nil Handle.)
func TestBatchOfOne(t *testing.T) {
	for _, shape := range []amqpsub.Option{amqpsub.Workers(2), amqpsub.WorkersByKey(2)} {
		synctest.Test(t, func(t *testing.T) {
			src := fake.New(true, fake.Messages(6, "a", "b")...)
			var sizes []int
			var mu sync.Mutex
			s, err := amqpsub.NewBatch(amqpsub.SourceOf(src), "q", amqpsub.BatchHandlerFunc(func(_ context.Context, b []*amqpsub.Delivery) []error {
				mu.Lock()
				sizes = append(sizes, len(b))
				mu.Unlock()
				return nil
			}), amqpsub.Batch(1, time.Second), shape)
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
		s, _ := amqpsub.NewBatch(amqpsub.SourceOf(src), "q", amqpsub.BatchHandlerFunc(func(_ context.Context, b []*amqpsub.Delivery) []error {
			sizes = append(sizes, len(b))
			at = append(at, time.Since(start))
			return nil
		}), amqpsub.Batch(4, 0))
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
					amqpsub.MaxDeliveryCount(0),
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
					s, err = amqpsub.NewBatch(amqpsub.SourceOf(src), "q", amqpsub.BatchHandlerFunc(func(_ context.Context, b []*amqpsub.Delivery) []error {
						handled.Add(int64(len(b)))
						return nil
					}), opts...)
				} else {
					s, err = amqpsub.New(amqpsub.SourceOf(src), "q", amqpsub.HandlerFunc(func(context.Context, *amqpsub.Delivery) error {
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
		s, err := amqpsub.New(amqpsub.SourceOf(src), "q", amqpsub.HandlerFunc(func(context.Context, *amqpsub.Delivery) error {
			<-gate
			return nil
		}), amqpsub.Credit(1<<20), amqpsub.FixedCredit(), amqpsub.WorkersByKey(64))
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

// Every option runs at its largest valid value, and one past it is refused
// (a batch size past the credit once crashed a lane with makeslice).
func TestLargestValidOptionsRun(t *testing.T) {
	accept := amqpsub.HandlerFunc(func(context.Context, *amqpsub.Delivery) error { return nil })
	acceptBatch := amqpsub.BatchHandlerFunc(func(_ context.Context, b []*amqpsub.Delivery) []error { return nil })
	for _, tc := range []struct {
		name  string
		batch bool
		opts  []amqpsub.Option
	}{
		{"Workers(4096)", false, []amqpsub.Option{amqpsub.Workers(4096)}},
		{"WorkersByKey(4096)", false, []amqpsub.Option{amqpsub.WorkersByKey(4096)}},
		{"WorkersByKey(4096)+BalanceKeys", false, []amqpsub.Option{amqpsub.WorkersByKey(4096), amqpsub.BalanceKeys()}},
		{"Batch(MaxInt,0)", true, []amqpsub.Option{amqpsub.Batch(math.MaxInt, 0)}},
		{"Batch(MaxInt,1ms)+WorkersByKey(4096)", true, []amqpsub.Option{amqpsub.Batch(math.MaxInt, time.Millisecond), amqpsub.WorkersByKey(4096), amqpsub.Credit(1 << 20)}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				src := fake.New(true, fake.Messages(100, "a", "b", "c", "")...)
				opts := tc.opts
				var s *amqpsub.Subscriber
				var err error
				if tc.batch {
					s, err = amqpsub.NewBatch(amqpsub.SourceOf(src), "q", acceptBatch, opts...)
				} else {
					s, err = amqpsub.New(amqpsub.SourceOf(src), "q", accept, opts...)
				}
				if err != nil {
					t.Fatal(err)
				}
				cancel, errc := run(t, s)
				time.Sleep(time.Second) // the batches' wait, on the bubble's clock
				synctest.Wait()
				cancel()
				if err := <-errc; err != nil {
					t.Fatal(err)
				}
				if st := s.Stats(); st.Settled.Accepted != 100 {
					t.Fatalf("stats %v", st)
				}
			})
		})
	}
	for _, o := range []amqpsub.Option{amqpsub.Workers(4097), amqpsub.WorkersByKey(4097), amqpsub.Workers(math.MaxInt),
		amqpsub.Sessions(257), amqpsub.SessionIDs("a", "a"), amqpsub.Credit(1<<20 + 1), amqpsub.MaxHeldBytes(-1), amqpsub.MaxMessageSize(-1)} {
		if _, err := amqpsub.New(nowhere, "q", accept, o); !errors.Is(err, amqpsub.ErrInvalidOption) {
			t.Errorf("New(%v) = %v, want ErrInvalidOption", o, err)
		}
	}
}

// BalanceKeys on the whole pipeline: every group in order, one delivery at
// a time, and nothing held at the end.
func TestBalanceKeysKeepsGroupOrder(t *testing.T) {
	for _, batch := range []bool{false, true} {
		synctest.Test(t, func(t *testing.T) {
			src := fake.New(true, fake.Messages(600, "a", "b", "c", "d", "e", "")...)
			var mu sync.Mutex
			last := map[string]int{}
			violations := 0
			check := func(d *amqpsub.Delivery) {
				mu.Lock()
				defer mu.Unlock()
				if g := d.GroupID(); g != "" {
					if i, ok := last[g]; ok && index(d) < i {
						violations++
					}
					last[g] = index(d)
				}
			}
			opts := []amqpsub.Option{amqpsub.WorkersByKey(4), amqpsub.BalanceKeys(), amqpsub.Credit(32)}
			var s *amqpsub.Subscriber
			if batch {
				s, _ = amqpsub.NewBatch(amqpsub.SourceOf(src), "q", amqpsub.BatchHandlerFunc(func(_ context.Context, b []*amqpsub.Delivery) []error {
					for _, d := range b {
						check(d)
					}
					time.Sleep(time.Millisecond)
					return nil
				}), append(opts, amqpsub.Batch(5, time.Millisecond))...)
			} else {
				s, _ = amqpsub.New(amqpsub.SourceOf(src), "q", amqpsub.HandlerFunc(func(_ context.Context, d *amqpsub.Delivery) error {
					check(d)
					time.Sleep(time.Millisecond)
					return nil
				}), opts...)
			}
			cancel, errc := run(t, s)
			synctest.Wait()
			for src.Count(fake.Accepted) < 600 {
				time.Sleep(10 * time.Millisecond)
			}
			cancel()
			if err := <-errc; err != nil {
				t.Fatal(err)
			}
			st := s.Stats()
			if violations != 0 || st.Settled.Accepted != 600 || st.GroupsHeld != 0 || len(st.Lanes) != 4 {
				t.Fatalf("batch %v: %d violations; stats %v", batch, violations, st)
			}
		})
	}
}

// MaxHeldBytes(n) with a large n (math.MaxInt64 as "no practical bound")
// must not bound the process more tightly than a small one.
func TestMaxHeldBytesTooLargeToScaleIsUnbounded(t *testing.T) {
	for _, n := range []int64{1 << 40, math.MaxInt64} {
		synctest.Test(t, func(t *testing.T) {
			msgs := fake.Messages(100)
			for _, m := range msgs {
				m.Data = [][]byte{make([]byte, 10)}
			}
			src := fake.New(true, msgs...)
			release := make(chan struct{})
			s, err := amqpsub.New(amqpsub.SourceOf(src), "q", amqpsub.HandlerFunc(func(context.Context, *amqpsub.Delivery) error {
				<-release
				return nil
			}), amqpsub.Credit(256), amqpsub.FixedCredit(), amqpsub.MaxHeldBytes(n))
			if err != nil {
				t.Fatal(err)
			}
			cancel, errc := run(t, s)
			for range 20 { // let a few round trips of credit happen
				synctest.Wait()
			}
			st := s.Stats()
			close(release)
			cancel()
			<-errc
			t.Logf("MaxHeldBytes(%d): held %d of 100 (bytes %d)", n, st.Held, st.BytesHeld)
			if st.Held != 100 {
				t.Errorf("MaxHeldBytes(%d): held %d, want all 100 (1000 bytes, far under the budget)", n, st.Held)
			}
		})
	}
}

// A Service Bus connector checks what New is given with it: the queue
// against the connection string's EntityPath (the entity, a topic's
// subscriptions, dead-letter queues, in any case), and the profile (only
// AzureServiceBus); sources that play Service Bus refuse sessions.
func TestServiceBusConnectorChecksItsOptions(t *testing.T) {
	h := amqpsub.HandlerFunc(func(context.Context, *amqpsub.Delivery) error { return nil })
	scoped := func(path string) amqpsub.Connector {
		c, err := amqpsub.ServiceBus("Endpoint=sb://ns.servicebus.windows.net/;SharedAccessKeyName=k;SharedAccessKey=v;EntityPath=" + path)
		if err != nil {
			t.Fatal(err)
		}
		return c
	}
	entity, topic, subscription := scoped("orders"), scoped("payments"), scoped("payments/Subscriptions/ledger")
	for _, tc := range []struct {
		name string
		c    amqpsub.Connector
		q    string
		opts []amqpsub.Option
		want string // in the error; "" for none
	}{
		{"the EntityPath's queue", entity, "orders", nil, ""},
		{"another queue than EntityPath", entity, "invoices", nil, `queue "invoices" is outside the connection string's EntityPath "orders"`},
		{"another queue than EntityPath, said what to do", entity, "orders2", nil, "use a namespace-level connection string, without EntityPath"},
		{"the EntityPath's queue in another case", entity, "Orders", nil, ""},
		{"the EntityPath's dead-letter queue", entity, "orders/$DeadLetterQueue", nil, ""},
		{"a subscription of the EntityPath's topic", topic, "payments/Subscriptions/ledger", nil, ""},
		{"its dead-letter queue", topic, "Payments/subscriptions/Ledger/$DeadLetterQueue", nil, ""},
		{"the subscription's own dead-letter queue", subscription, "payments/Subscriptions/ledger/$DeadLetterQueue", nil, ""},
		{"another subscription than EntityPath", subscription, "payments/Subscriptions/audit", nil, `EntityPath "payments/Subscriptions/ledger"`},
		{"another profile", entity, "orders", []amqpsub.Option{amqpsub.WithProfile(amqpsub.Artemis)}, "WithProfile(artemis) with a Service Bus connector: use AzureServiceBus"},
		{"its own profile", entity, "orders", []amqpsub.Option{amqpsub.WithProfile(amqpsub.AzureServiceBus)}, ""},
		{"sessions on sources", amqpsub.ServiceBusSourceOf(fake.New(true)), "q", []amqpsub.Option{amqpsub.Sessions(2)}, "does not play Service Bus sessions"},
		{"sessions without Service Bus", amqpsub.Dial("amqp://127.0.0.1:1", nil), "q", []amqpsub.Option{amqpsub.Sessions(2)}, "Sessions and SessionIDs need the AzureServiceBus profile"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := amqpsub.New(tc.c, tc.q, h, tc.opts...)
			switch {
			case tc.want == "" && err != nil:
				t.Fatalf("New: %v", err)
			case tc.want != "" && (!errors.Is(err, amqpsub.ErrInvalidOption) || !strings.Contains(err.Error(), tc.want)):
				t.Fatalf("New: %v, want an ErrInvalidOption saying %q", err, tc.want)
			}
		})
	}
}

// Workers ignores group-ids: deliveries of one group run side by side.
func TestWorkersIgnoreGroups(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		src := fake.New(true, fake.Messages(4, "g")...)
		gate := make(chan struct{})
		s, _ := amqpsub.New(amqpsub.SourceOf(src), "q", amqpsub.HandlerFunc(func(context.Context, *amqpsub.Delivery) error {
			<-gate
			return nil
		}), amqpsub.Workers(2))
		cancel, errc := run(t, s)
		synctest.Wait()
		if st := s.Stats(); st.Handling != 2 {
			t.Fatalf("%d handlers run for one group under Workers(2), want 2", st.Handling)
		}
		close(gate)
		synctest.Wait()
		cancel()
		if err := <-errc; err != nil {
			t.Fatal(err)
		}
	})
}
