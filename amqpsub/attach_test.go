package amqpsub_test

import (
	"context"
	"errors"
	"fmt"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/Azure/go-amqp"

	"github.com/amqpsub/amqpsub/amqpsub"
	"github.com/amqpsub/amqpsub/internal/backoff"
	"github.com/amqpsub/amqpsub/internal/driver"
	"github.com/amqpsub/amqpsub/internal/driver/servicebus"
	"github.com/amqpsub/amqpsub/internal/fake"
	"github.com/amqpsub/amqpsub/internal/wire"
)

// silentBroker accepts TCP connections on 127.0.0.1, holds them open and
// says nothing, until the test ends; each one is also sent on accepted
// (when there is room).
func silentBroker(t *testing.T) (addr string, accepted <-chan net.Conn) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ch := make(chan net.Conn, 16)
	var mu sync.Mutex
	var conns []net.Conn
	var wg sync.WaitGroup
	wg.Go(func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns = append(conns, c)
			mu.Unlock()
			select {
			case ch <- c:
			default:
			}
		}
	})
	t.Cleanup(func() {
		ln.Close()
		wg.Wait()
		for _, c := range conns {
			c.Close()
		}
	})
	return ln.Addr().String(), ch
}

// A broker that accepts the TCP connection but never answers: Run gives up
// at DialTimeout, with an error that says so.
func TestDialTimeoutBoundsASilentBroker(t *testing.T) {
	addr, _ := silentBroker(t)
	s, _ := amqpsub.New(amqpsub.Dial("amqp://"+addr, nil), "q",
		amqpsub.HandlerFunc(func(context.Context, *amqpsub.Delivery) error { return nil }),
		amqpsub.DialTimeout(200*time.Millisecond))
	start := time.Now()
	err := s.Run(context.Background())
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Run = %v, want DeadlineExceeded", err)
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Fatalf("Run took %v with DialTimeout(200ms)", d)
	}
}

// sources hands out the given sources and errors in turn, then blocks.
func sources(items ...any) func(context.Context) (driver.Source, error) {
	var mu sync.Mutex
	return func(ctx context.Context) (driver.Source, error) {
		mu.Lock()
		if len(items) == 0 {
			mu.Unlock()
			<-ctx.Done()
			return nil, ctx.Err()
		}
		it := items[0]
		items = items[1:]
		mu.Unlock()
		switch v := it.(type) {
		case error:
			return nil, v
		case driver.Source:
			return v, nil
		}
		panic(fmt.Sprintf("sources: %T", it))
	}
}

func TestLostLinkIsReplacedAfterBackoff(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		first := fake.New(true, fake.Messages(5)...)
		second := fake.New(true, fake.Messages(5)...)
		transient := &amqp.ConnError{}
		var reconnects []string
		block := make(chan struct{})
		var handled atomic.Int64
		s, _ := amqpsub.New(amqpsub.SourcesOf(sources(first, transient, transient, second)), "q", amqpsub.HandlerFunc(func(_ context.Context, d *amqpsub.Delivery) error {
			if handled.Add(1) == 1 {
				<-block // in a handler when the link goes
			}
			return nil
		}), amqpsub.Credit(4), amqpsub.FixedCredit(), amqpsub.Backoff(100*time.Millisecond, 400*time.Millisecond),
			amqpsub.OnReconnect(func(attempts int, cause error) {
				reconnects = append(reconnects, fmt.Sprintf("%d %v", attempts, errors.Is(cause, fake.ErrLinkLost)))
			}))
		cancel, errc := run(t, s)
		synctest.Wait()
		lostAt := time.Now()
		first.Fail(fake.ErrLinkLost)
		synctest.Wait()
		close(block)
		for s.Stats().Settled.Accepted < 5 {
			time.Sleep(time.Millisecond)
		}
		// The link died young, so even the first attempt waits (≤ 100 ms);
		// the two failed ones then wait at most 200 ms and 400 ms.
		if d := time.Since(lostAt); d > 700*time.Millisecond+time.Millisecond {
			t.Fatalf("reconnected after %v, past the backoff bound", d)
		}
		cancel()
		if err := <-errc; err != nil {
			t.Fatal(err)
		}
		st := s.Stats()
		if fmt.Sprint(reconnects) != "[3 true]" || st.Reconnects != 1 || st.LinksLost != 1 || st.Links != 2 {
			t.Fatalf("reconnects %v, stats %+v", reconnects, st)
		}
		// The handler in progress finished; its settlement could not reach
		// the lost link. The 3 buffered were dropped unhandled.
		if st.Stale != 1 || st.Dropped != 3 || second.Count(fake.Accepted) != 5 || first.Count(fake.Accepted) != 0 {
			t.Fatalf("stats %+v, second accepted %d", st, second.Count(fake.Accepted))
		}
		if st.Held != 0 {
			t.Fatalf("held %d after the run", st.Held)
		}
	})
}

func TestFatalErrorsEndRun(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		first := fake.New(false, fake.Messages(1)...)
		refused := &amqp.Error{Condition: amqp.ErrCondUnauthorizedAccess, Description: "no"}
		s, _ := amqpsub.New(amqpsub.SourcesOf(sources(first, &amqp.ConnError{}, refused)), "q", amqpsub.HandlerFunc(func(context.Context, *amqpsub.Delivery) error { return nil }))
		_, errc := run(t, s)
		synctest.Wait()
		first.Fail(fake.ErrLinkLost)
		err := <-errc
		if !errors.Is(err, refused) {
			t.Fatalf("Run = %v, want the refusal", err)
		}
	})
}

func TestFirstConnectErrorIsNotRetried(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		down := &amqp.ConnError{}
		s, _ := amqpsub.New(amqpsub.SourcesOf(sources(down)), "q", amqpsub.HandlerFunc(func(context.Context, *amqpsub.Delivery) error { return nil }))
		if err := s.Run(context.Background()); !errors.Is(err, down) {
			t.Fatalf("Run = %v", err)
		}
	})
}

func TestIsFatal(t *testing.T) {
	for _, tc := range []struct {
		err   error
		fatal bool
	}{
		{&amqp.Error{Condition: amqp.ErrCondUnauthorizedAccess}, true},
		{fmt.Errorf("attach: %w", &amqp.Error{Condition: amqp.ErrCondNotFound}), true},
		{&amqp.LinkError{RemoteErr: &amqp.Error{Condition: amqp.ErrCondNotFound}}, true},
		{&wire.SASLError{Code: wire.SASLAuth, Err: errors.New("SASL PLAIN auth failed with code 0x1: ")}, true},
		{fmt.Errorf("connect: %w", &wire.SASLError{Code: wire.SASLSysPerm}), true},
		{&wire.SASLError{Code: wire.SASLSysTemp}, false},
		{&wire.SASLError{Code: wire.SASLSys}, false},
		// The text alone is not enough: only what was read off the wire.
		{errors.New("SASL PLAIN auth failed with code 0x1: "), false},
		{fmt.Errorf("reconnecting: %w", amqpsub.ErrLinkLost), true},
		{&amqp.Error{Condition: amqp.ErrCondIllegalState}, true},
		{&amqp.Error{Condition: amqp.ErrCondInvalidField}, true},
		{&amqp.Error{Condition: amqp.ErrCondNotImplemented}, true},
		{&amqp.ConnError{}, false},
		{&amqp.LinkError{}, false},
		{&amqp.Error{Condition: amqp.ErrCondDetachForced}, false},
		// Service Bus, as azservicebus's recovery kinds judge them.
		{&amqp.Error{Condition: "com.microsoft:entity-disabled"}, true},
		{&amqp.LinkError{RemoteErr: &amqp.Error{Condition: "com.microsoft:entity-disabled"}}, true},
		{&amqp.Error{Condition: "com.microsoft:server-busy"}, false},
		{&amqp.Error{Condition: "com.microsoft:timeout"}, false},
		{context.DeadlineExceeded, false},
		{nil, false},
	} {
		if got := amqpsub.IsFatal(tc.err); got != tc.fatal {
			t.Errorf("IsFatal(%v) = %v", tc.err, got)
		}
	}
}

func TestLocalRetryKeepsTheDeliveryInItsLane(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		msgs := fake.Messages(3, "k")
		src := fake.New(true, msgs...)
		var mu sync.Mutex
		var order []string
		attempts := map[int]int{}
		s, _ := amqpsub.New(amqpsub.SourceOf(src), "q", amqpsub.HandlerFunc(func(_ context.Context, d *amqpsub.Delivery) error {
			i := index(d)
			mu.Lock()
			defer mu.Unlock()
			attempts[i]++
			order = append(order, fmt.Sprintf("%d@%v", i, time.Since(t0)))
			if i == 0 && attempts[i] <= 2 {
				return errors.New("flaky")
			}
			return nil
		}), amqpsub.WorkersByKey(2), amqpsub.LocalRetry(amqpsub.RetryPolicy{Attempts: 3, Initial: 10 * time.Millisecond, Max: 15 * time.Millisecond}))
		t0 = time.Now()
		cancel, errc := run(t, s)
		synctest.Wait()
		time.Sleep(time.Second)
		cancel()
		<-errc
		if got := fmt.Sprint(order); got != "[0@0s 0@10ms 0@25ms 1@25ms 2@25ms]" {
			t.Fatalf("calls %s", got)
		}
		if st := s.Stats(); st.Results.LocalRetries != 2 || st.Settled.Modified != 0 || st.Settled.Accepted != 3 {
			t.Fatalf("stats %+v", st)
		}
	})
}

var t0 time.Time

func TestStopCutsLocalRetryShort(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		src := fake.New(true, fake.Messages(1)...)
		s, _ := amqpsub.New(amqpsub.SourceOf(src), "q", amqpsub.HandlerFunc(func(context.Context, *amqpsub.Delivery) error {
			return errors.New("down")
		}), amqpsub.LocalRetry(amqpsub.RetryPolicy{Attempts: 5, Initial: time.Hour, Max: time.Hour}))
		cancel, errc := run(t, s)
		synctest.Wait()
		start := time.Now()
		cancel()
		<-errc
		// The stop drains the credit on a goroutine of its own: the
		// released message is sent back at most once before the drain
		// lands (and released again), never until the credit is spent.
		// No modified, one release by the handler path.
		st := s.Stats()
		if rel := src.Count(fake.Released); time.Since(start) != 0 || rel < 1 || rel > 2 || src.Count(fake.Modified) != 0 ||
			st.Results.Release != 1 || st.Results.Retry != 0 {
			t.Fatalf("stop took %v, released %d, modified %d, results %+v", time.Since(start), src.Count(fake.Released), src.Count(fake.Modified), st.Results)
		}
	})
}

func TestPoisonLimitRejectsBeforeTheHandler(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		msgs := fake.Messages(2)
		msgs[0].Header = &amqp.MessageHeader{DeliveryCount: 4}
		msgs[1].Header = &amqp.MessageHeader{DeliveryCount: 3}
		for _, batch := range []bool{false, true} {
			src := fake.New(true, msgs...)
			var seen atomic.Int64
			var s *amqpsub.Subscriber
			if batch {
				s, _ = amqpsub.NewBatch(amqpsub.SourceOf(src), "q", amqpsub.BatchHandlerFunc(func(_ context.Context, b []*amqpsub.Delivery) []error {
					seen.Add(int64(len(b)))
					return nil
				}), amqpsub.MaxDeliveryCount(3), amqpsub.Batch(2, time.Millisecond))
			} else {
				s, _ = amqpsub.New(amqpsub.SourceOf(src), "q", amqpsub.HandlerFunc(func(context.Context, *amqpsub.Delivery) error {
					seen.Add(1)
					return nil
				}), amqpsub.MaxDeliveryCount(3))
			}
			cancel, errc := run(t, s)
			synctest.Wait()
			time.Sleep(10 * time.Millisecond)
			cancel()
			<-errc
			sts := src.Settlements()
			if seen.Load() != 1 || len(sts) != 2 || s.Stats().Results.Poisoned != 1 {
				t.Fatalf("batch %v: handler saw %d, settlements %d", batch, seen.Load(), len(sts))
			}
			for _, st := range sts {
				if st.Msg == msgs[0] && (st.Outcome != fake.Rejected || st.Error == nil || st.Error.Description == "") {
					t.Fatalf("poison settled %+v", st)
				}
			}
		}
	})
}

// MaxMessageSize rejects a delivery whose body is past the limit before a
// handler sees it, with condition message-size-exceeded, single and batch.
func TestMaxMessageSizeRejectsBeforeTheHandler(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		msgs := fake.Messages(3)
		msgs[0].Data = [][]byte{make([]byte, 60), make([]byte, 41)} // 101 bytes
		msgs[1].Data = [][]byte{make([]byte, 100)}
		msgs[2].Value = string(make([]byte, 200))
		for _, batch := range []bool{false, true} {
			src := fake.New(true, msgs...)
			var seen atomic.Int64
			var events atomic.Int64
			opts := []amqpsub.Option{amqpsub.MaxMessageSize(100), amqpsub.OnEvent(func(e amqpsub.Event) {
				if e.Kind == amqpsub.EventOversize {
					events.Add(1)
				}
			})}
			var s *amqpsub.Subscriber
			if batch {
				s, _ = amqpsub.NewBatch(amqpsub.SourceOf(src), "q", amqpsub.BatchHandlerFunc(func(_ context.Context, b []*amqpsub.Delivery) []error {
					seen.Add(int64(len(b)))
					return nil
				}), append(opts, amqpsub.Batch(3, time.Millisecond))...)
			} else {
				s, _ = amqpsub.New(amqpsub.SourceOf(src), "q", amqpsub.HandlerFunc(func(context.Context, *amqpsub.Delivery) error {
					seen.Add(1)
					return nil
				}), opts...)
			}
			cancel, errc := run(t, s)
			synctest.Wait()
			time.Sleep(10 * time.Millisecond)
			cancel()
			<-errc
			st := s.Stats()
			if seen.Load() != 1 || st.Results.Oversize != 2 || st.Results.Reject != 0 || st.Settled.Rejected != 2 || events.Load() != 2 {
				t.Fatalf("batch %v: handler saw %d; %d events; stats %v", batch, seen.Load(), events.Load(), st)
			}
			for _, set := range src.Settlements() {
				if set.Msg != msgs[1] && (set.Outcome != fake.Rejected || set.Error == nil || set.Error.Condition != amqp.ErrCondMessageSizeExceeded) {
					t.Fatalf("oversize settled %+v", set)
				}
			}
		}
	})
}

func TestInvalidRecoveryOptions(t *testing.T) {
	for _, o := range []amqpsub.Option{
		amqpsub.Backoff(0, time.Second), amqpsub.Backoff(time.Second, time.Millisecond),
		amqpsub.LocalRetry(amqpsub.RetryPolicy{Attempts: -1}), amqpsub.LocalRetry(amqpsub.RetryPolicy{}),
		amqpsub.LocalRetry(amqpsub.RetryPolicy{Budget: -time.Second}),
		amqpsub.LocalRetry(amqpsub.RetryPolicy{Attempts: 1, Initial: time.Second, Max: time.Millisecond}),
		amqpsub.LocalRetry(amqpsub.RetryPolicy{Attempts: 1, Initial: -time.Second}),
		amqpsub.IdleTimeout(0), amqpsub.IdleTimeout(99 * time.Millisecond),
	} {
		if _, err := amqpsub.New(nowhere, "q", amqpsub.HandlerFunc(func(context.Context, *amqpsub.Delivery) error { return nil }), o); !errors.Is(err, amqpsub.ErrInvalidOption) {
			t.Errorf("option accepted: %v", err)
		}
	}
}

// A link that dies as soon as it is attached, every time (go-amqp closes
// the link on a message it cannot decode, which the broker sends first
// again), is reattached with growing waits, not in a tight loop.
func TestLinksLostAtOnceAreReattachedWithBackoff(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var attaches atomic.Int64
		s, _ := amqpsub.New(amqpsub.SourcesOf(func(context.Context) (driver.Source, error) {
			attaches.Add(1)
			src := fake.New(false)
			src.Fail(errors.New("amqp: link closed: char not implemented"))
			return src, nil
		}), "q", amqpsub.HandlerFunc(func(context.Context, *amqpsub.Delivery) error { return nil }),
			amqpsub.Backoff(100*time.Millisecond, time.Second))
		cancel, errc := run(t, s)
		time.Sleep(10 * time.Second)
		cancel()
		if err := <-errc; err != nil {
			t.Fatal(err)
		}
		// Waits up to 0.1, 0.2, 0.4, 0.8, then 1 s each: at least ~10 in 10 s
		// with full jitter, far from the thousands a tight loop makes.
		if n := attaches.Load(); n < 10 || n > 60 {
			t.Fatalf("%d attaches in 10 s", n)
		}
		t.Logf("%d attaches in 10 s", attaches.Load())
	})
}

// A Budget retries in the lane until it runs out, then the Retry goes to
// the broker; a batch's failed deliveries are retried as a batch of their
// own, its good ones settled at once.
func TestLocalRetryBudgetAndBatches(t *testing.T) {
	t.Run("budget", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			src := fake.New(true, fake.Messages(1)...)
			start := time.Now()
			var calls []time.Duration
			s, _ := amqpsub.New(amqpsub.SourceOf(src), "q", amqpsub.HandlerFunc(func(context.Context, *amqpsub.Delivery) error {
				calls = append(calls, time.Since(start))
				if time.Since(start) < 10*time.Second {
					return errors.New("store down")
				}
				return nil
			}), amqpsub.LocalRetry(amqpsub.RetryPolicy{Budget: 2 * time.Second, Initial: 500 * time.Millisecond, Max: time.Second}))
			cancel, errc := run(t, s)
			synctest.Wait()
			time.Sleep(3 * time.Second)
			synctest.Wait()
			cancel()
			<-errc
			// 0, 0.5, 1.5, then 2.0 (the budget cuts the 1 s wait short);
			// then the broker gets the Retry and redelivers at once, with a
			// budget of its own.
			if got := fmt.Sprint(calls[:5]); got != "[0s 500ms 1.5s 2s 2s]" || src.Count(fake.Modified) < 1 {
				t.Fatalf("calls %v, modified %d", calls, src.Count(fake.Modified))
			}
			if st := s.Stats(); st.Results.LocalRetries < 3 {
				t.Fatalf("stats %v", st)
			}
		})
	})
	t.Run("batch", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			src := fake.New(true, fake.Messages(4)...)
			var mu sync.Mutex
			var batches []string
			failed := map[int]int{}
			s, _ := amqpsub.NewBatch(amqpsub.SourceOf(src), "q", amqpsub.BatchHandlerFunc(func(_ context.Context, b []*amqpsub.Delivery) []error {
				mu.Lock()
				defer mu.Unlock()
				res := make([]error, len(b))
				var ids []int
				for i, d := range b {
					ids = append(ids, index(d))
					if index(d)%2 == 1 && failed[index(d)] < 2 {
						failed[index(d)]++
						res[i] = errors.New("row locked")
					}
				}
				batches = append(batches, fmt.Sprint(ids))
				return res
			}), amqpsub.Batch(4, time.Millisecond),
				amqpsub.LocalRetry(amqpsub.RetryPolicy{Attempts: 3, Initial: 10 * time.Millisecond}))
			cancel, errc := run(t, s)
			synctest.Wait()
			time.Sleep(time.Second)
			cancel()
			<-errc
			if fmt.Sprint(batches) != "[[0 1 2 3] [1 3] [1 3]]" || src.Count(fake.Accepted) != 4 || src.Count(fake.Modified) != 0 {
				t.Fatalf("batches %v, accepted %d, modified %d", batches, src.Count(fake.Accepted), src.Count(fake.Modified))
			}
		})
	})
}

// An OnReconnect that does not return holds the attaching goroutine: a stop
// still returns within GracePeriod + CloseTimeout, with an error wrapping
// ErrAbandoned that says so (before, Run returned nil and said nothing).
func TestBlockingOnReconnectIsReportedAtTheStop(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		first := fake.New(true, fake.Messages(1)...)
		second := fake.New(true)
		unblock := make(chan struct{})
		s, _ := amqpsub.New(amqpsub.SourcesOf(sources(first, second)), "q", amqpsub.HandlerFunc(func(context.Context, *amqpsub.Delivery) error { return nil }),
			amqpsub.GracePeriod(time.Second), amqpsub.CloseTimeout(time.Second),
			amqpsub.OnReconnect(func(int, error) { <-unblock }))
		cancel, errc := run(t, s)
		synctest.Wait()
		first.Fail(fake.ErrLinkLost)
		time.Sleep(time.Minute) // reattached; OnReconnect blocks
		began := time.Now()
		cancel()
		err := <-errc
		if took := time.Since(began); !errors.Is(err, amqpsub.ErrAbandoned) || took > 2*time.Second {
			t.Fatalf("Run = %v after %v, want ErrAbandoned within 2s", err, took)
		}
		close(unblock)
		synctest.Wait()
	})
}

// A reconnect the service refuses as busy (com.microsoft:server-busy) is
// tried again no sooner than 10 s later, whatever Backoff says, as
// Microsoft's clients wait; another transient error keeps the backoff.
// A healthy link the service ends as busy is also reattached 10 s later.
// The wait is the condition's, on every profile, not only Service Bus's.
func TestServerBusyWaitsTenSecondsBeforeTheNextAttempt(t *testing.T) {
	for _, tc := range []struct {
		name    string
		connect func(func(context.Context) (driver.Source, error)) amqpsub.Connector
		opts    []amqpsub.Option
		// waits: the profile's driver takes server-busy as throttling
		// (Service Bus's); elsewhere the condition is an error like any
		// other, retried after the backoff.
		waits bool
	}{
		{"servicebus", amqpsub.ServiceBusSourcesOf, nil, true},
		{"artemis", amqpsub.SourcesOf, nil, false},
		{"generic", amqpsub.SourcesOf, []amqpsub.Option{amqpsub.WithProfile(amqpsub.Generic)}, false},
	} {
		t.Run(tc.name, func(t *testing.T) { serverBusyWaits(t, tc.connect, tc.opts, tc.waits) })
	}
}

func serverBusyWaits(t *testing.T, connect func(func(context.Context) (driver.Source, error)) amqpsub.Connector, opts []amqpsub.Option, waits bool) {
	synctest.Test(t, func(t *testing.T) {
		first := fake.New(true, fake.Messages(1)...)
		second := fake.New(true, fake.Messages(1)...)
		third := fake.New(true, fake.Messages(1)...)
		busy := &amqp.Error{Condition: "com.microsoft:server-busy", Description: "throttled"}
		var mu sync.Mutex
		var attempts []time.Time
		src := sources(first, busy, &amqp.ConnError{}, second, third)
		s, err := amqpsub.New(connect(func(ctx context.Context) (driver.Source, error) {
			mu.Lock()
			attempts = append(attempts, time.Now())
			mu.Unlock()
			return src(ctx)
		}), "q", amqpsub.HandlerFunc(func(context.Context, *amqpsub.Delivery) error { return nil }),
			append(opts, amqpsub.Backoff(time.Millisecond, 10*time.Millisecond))...)
		if err != nil {
			t.Fatal(err)
		}
		cancel, errc := run(t, s)
		synctest.Wait()
		time.Sleep(time.Minute) // the first link is healthy by now
		first.Fail(&amqp.LinkError{RemoteErr: &amqp.Error{Condition: "com.microsoft:connection-forced"}})
		synctest.Wait()
		time.Sleep(time.Minute)
		lostAt := time.Now()
		second.Fail(&amqp.LinkError{RemoteErr: busy})
		time.Sleep(time.Minute)
		cancel()
		if err := <-errc; err != nil {
			t.Fatal(err)
		}
		mu.Lock()
		defer mu.Unlock()
		if len(attempts) != 5 {
			t.Fatalf("%d attempts", len(attempts))
		}
		// attempts: first, busy, ConnError, second, third.
		if gap := attempts[2].Sub(attempts[1]); waits && (gap < 10*time.Second || gap > 11*time.Second) {
			t.Errorf("the attempt after server-busy came %v later, want 10 s", gap)
		} else if !waits && gap > 10*time.Millisecond {
			t.Errorf("the attempt after server-busy came %v later, want ≤ the 10 ms backoff", gap)
		}
		if gap := attempts[3].Sub(attempts[2]); gap > 10*time.Millisecond {
			t.Errorf("the attempt after a ConnError came %v later, want ≤ the 10 ms backoff", gap)
		}
		if gap := attempts[4].Sub(lostAt); waits && (gap < 10*time.Second || gap > 11*time.Second) {
			t.Errorf("a link lost as busy was reattached %v after the loss, want 10 s", gap)
		} else if !waits && gap >= 10*time.Second {
			t.Errorf("a link lost as busy was reattached %v after the loss, want no throttling wait", gap)
		}
	})
}

// A session slot that has never held a session, but whose attaches the
// service has answered (no session free), reconnects when its next attach
// fails for another reason (a lost connection), as after a lost link: Run
// does not end as if the first attach had failed.
func TestSessionSlotWithoutASessionReconnects(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		src := fake.New(true, fake.Messages(1, "s1")...)
		noSession := &amqp.Error{Condition: "com.microsoft:timeout", Description: "no session available"}
		connLost := &amqp.ConnError{}
		handled := make(chan struct{})
		s, err := amqpsub.New(amqpsub.SourcesOf(sources(noSession, noSession, connLost, src)), "q", amqpsub.HandlerFunc(func(context.Context, *amqpsub.Delivery) error {
			close(handled)
			return nil
		}), amqpsub.WithProfile(amqpsub.AzureServiceBus), amqpsub.Sessions(1), amqpsub.MaxLockRenewal(0),
			amqpsub.Backoff(time.Millisecond, time.Millisecond))
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithCancel(t.Context())
		errc := make(chan error, 1)
		go func() { errc <- s.Run(ctx) }()
		select {
		case <-handled:
		case err := <-errc:
			t.Fatalf("Run ended before a session was held: %v", err)
		}
		cancel()
		if err := <-errc; err != nil {
			t.Fatal(err)
		}
	})
}

// A session slot whose "no session free" answer comes at once (not after
// the service's wait) does not ask again in a tight loop: it waits the
// backoff's floor between asks.
func TestSessionSlotDoesNotSpinOnAnImmediateTimeout(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var asks atomic.Int32
		noSession := &amqp.Error{Condition: "com.microsoft:timeout", Description: "no session available"}
		s, err := amqpsub.New(amqpsub.SourcesOf(func(context.Context) (driver.Source, error) { asks.Add(1); return nil, noSession }), "q",
			amqpsub.HandlerFunc(func(context.Context, *amqpsub.Delivery) error { return nil }),
			amqpsub.WithProfile(amqpsub.AzureServiceBus), amqpsub.Sessions(1), amqpsub.MaxLockRenewal(0),
			amqpsub.Backoff(100*time.Millisecond, time.Second))
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithCancel(t.Context())
		errc := make(chan error, 1)
		go func() { errc <- s.Run(ctx) }()
		time.Sleep(time.Second)
		cancel()
		if err := <-errc; err != nil {
			t.Fatal(err)
		}
		if n := asks.Load(); n > 11 {
			t.Fatalf("%d asks for a session in 1 s with a 100 ms backoff floor", n)
		}
	})
}

// A named session another receiver holds is asked for again after waits
// that grow up to 30 s, for as long as Run runs: not in a loop, and not the
// end of Run.
func TestSessionCannotBeLockedBacksOff(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		start := time.Now()
		var calls []time.Duration
		refused := &amqp.Error{Condition: servicebus.CondSessionCannotBeLocked, Description: "held by another receiver"}
		s, err := amqpsub.New(amqpsub.SourcesOf(func(context.Context) (driver.Source, error) {
			calls = append(calls, time.Since(start))
			return nil, fmt.Errorf("amqpsub: attach receiver: %w", refused)
		}), "q", amqpsub.HandlerFunc(func(context.Context, *amqpsub.Delivery) error { return nil }),
			amqpsub.WithProfile(amqpsub.AzureServiceBus), amqpsub.SessionIDs("a"))
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() { done <- s.Run(ctx) }()
		time.Sleep(3 * time.Minute)
		cancel()
		if err := <-done; err != nil {
			t.Fatalf("Run: %v", err)
		}
		t.Logf("requests at %v", calls)
		// 1, 2, 4, 8, 16 s, then 30 s: from 0.5 + 1 + 2 + 4 + 8 + 15 s
		// = 30.5 s to 61 s for the first six waits, then 15-30 s each.
		if len(calls) < 7 || len(calls) > 17 {
			t.Fatalf("%d requests in 3 minutes", len(calls))
		}
		for k := 1; k < len(calls); k++ {
			ceiling := backoff.Ceiling(k-1, time.Second, 30*time.Second) // servicebus.SessionLockedWait's
			if gap := calls[k] - calls[k-1]; gap < ceiling/2 || gap > ceiling {
				t.Fatalf("request %d came %v after the one before, want between %v and %v", k+1, gap, ceiling/2, ceiling)
			}
		}
	})
}

// Under the AzureServiceBus profile a reconnect refused with
// amqp:not-allowed ends Run (azservicebus takes it as fatal, .NET as an
// InvalidOperationException: what the entity will not do, retrying does
// not change), while amqp:resource-limit-exceeded, a quota of receivers or
// connections that frees as others close, is tried again. Elsewhere
// not-allowed is retried, as before; a FatalErrors the user gives has the
// last word.
func TestServiceBusAttachErrorsOnAReconnect(t *testing.T) {
	notAllowed := &amqp.Error{Condition: amqp.ErrCondNotAllowed, Description: "not allowed"}
	quota := &amqp.Error{Condition: amqp.ErrCondResourceLimitExceeded, Description: "too many receivers"}
	for _, tc := range []struct {
		name    string
		connect func(func(context.Context) (driver.Source, error)) amqpsub.Connector
		refusal error
		opts    []amqpsub.Option
		fatal   bool
	}{
		{"servicebus/not-allowed", amqpsub.ServiceBusSourcesOf, notAllowed, nil, true},
		{"servicebus/not-allowed, linked", amqpsub.ServiceBusSourcesOf, &amqp.LinkError{RemoteErr: notAllowed}, nil, true},
		{"servicebus/resource-limit-exceeded", amqpsub.ServiceBusSourcesOf, quota, nil, false},
		{"servicebus/not-allowed under FatalErrors(nil)", amqpsub.ServiceBusSourcesOf, notAllowed, []amqpsub.Option{amqpsub.FatalErrors(nil)}, false},
		{"servicebus/unauthorized-access", amqpsub.ServiceBusSourcesOf, &amqp.Error{Condition: amqp.ErrCondUnauthorizedAccess}, nil, true},
		{"artemis/not-allowed", amqpsub.SourcesOf, notAllowed, nil, false},
		{"artemis/resource-limit-exceeded", amqpsub.SourcesOf, quota, nil, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				first := fake.New(true, fake.Messages(1)...)
				second := fake.New(true, fake.Messages(1)...)
				s, err := amqpsub.New(tc.connect(sources(first, tc.refusal, tc.refusal, second)), "q",
					amqpsub.HandlerFunc(func(context.Context, *amqpsub.Delivery) error { return nil }),
					append(tc.opts, amqpsub.Backoff(time.Millisecond, 10*time.Millisecond))...)
				if err != nil {
					t.Fatal(err)
				}
				cancel, errc := run(t, s)
				defer cancel()
				synctest.Wait()
				first.Fail(fake.ErrLinkLost)
				time.Sleep(time.Minute)
				select {
				case err := <-errc:
					if !tc.fatal || !errors.Is(err, amqpsub.ErrLinkLost) || !errors.Is(err, tc.refusal) {
						t.Fatalf("Run = %v; want it running (fatal %v)", err, tc.fatal)
					}
					return
				default:
				}
				if tc.fatal {
					t.Fatal("Run goes on after a fatal refusal")
				}
				if st := s.Stats(); st.Reconnects != 1 {
					t.Fatalf("%d reconnects, want 1 after two refusals", st.Reconnects)
				}
				cancel()
				if err := <-errc; err != nil {
					t.Fatal(err)
				}
			})
		})
	}
}
