package integration

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/amqpsub/amqpsub/amqpsub"
)

// Service Bus message locks: renewal, loss, and idle links that hold
// locks.

// Lock duration 2 s, Credit(256), Workers(4), 50 ms per message: past the
// first 160 or so, each of the 1,000 deliveries waits about 3.2 s behind
// the 256 held, longer than a lock lasts, yet none is redelivered, and the
// renewals share requests.
func TestServiceBusRenewalUnderBacklog(t *testing.T) {
	const n = 1000
	p := serviceBusPeer(t)
	q := p.entity(t, map[string]any{"lock_duration_ms": 2000})
	p.send(t, q, n)
	before := p.counters(t)
	seen := make([]atomic.Int32, n)
	s, _ := amqpsub.New(sbConnector(t, p), q, amqpsub.HandlerFunc(func(ctx context.Context, d *amqpsub.Delivery) error {
		seen[sbIndex(d)].Add(1)
		time.Sleep(50 * time.Millisecond)
		return nil
	}), amqpsub.Credit(256), amqpsub.FixedCredit(), amqpsub.Workers(4), amqpsub.Logger(logger(t)))
	stop, wait := runSub(t, s)
	waitFor(t, 2*time.Minute, "1,000 completed", func() bool { return p.info(t, q).Stats["completed"] == n })
	stop()
	if err := wait(); err != nil {
		t.Fatal(err)
	}
	after := p.counters(t)
	e := p.info(t, q)
	st := s.Stats()
	requests, tokens := after["renew_lock_requests"]-before["renew_lock_requests"], after["renew_lock_tokens"]-before["renew_lock_tokens"]
	t.Logf("%d locks renewed in %d requests; entity %+v; stats %v", tokens, requests, e, st)
	for i := range seen {
		if c := seen[i].Load(); c != 1 {
			t.Fatalf("message %d handled %d times", i, c)
		}
	}
	if e.Stats["lock_expired"] != 0 || e.Stats["delivered"] != n || st.Locks.Lost != 0 || st.Locks.Held != 0 {
		t.Fatalf("locks expired or deliveries repeated: entity %+v, stats %v", e, st)
	}
	if tokens < n || requests*10 > tokens {
		t.Fatalf("%d tokens renewed in %d requests: want batched renewals of every waiting lock", tokens, requests)
	}
}

// The peer refuses to renew one message's lock: that handler's context is
// cancelled with ErrLockLost, no settlement is sent for it, the message is
// delivered again, and no other message is disturbed.
func TestServiceBusLostLock(t *testing.T) {
	p := serviceBusPeer(t)
	q := p.entity(t, map[string]any{"lock_duration_ms": 2000})
	const n = 10
	p.send(t, q, n)
	p.call(t, "POST", "/faults/renew", map[string]any{"message_ids": []string{"m-3"}, "mode": "lost", "times": 1}, nil)
	t.Cleanup(func() { p.call(t, "POST", "/faults/renew/clear", nil, nil) })
	var mu sync.Mutex
	counts := map[int][]uint32{}
	var cause atomic.Value
	s, _ := amqpsub.New(sbConnector(t, p), q, amqpsub.HandlerFunc(func(ctx context.Context, d *amqpsub.Delivery) error {
		i := sbIndex(d)
		mu.Lock()
		counts[i] = append(counts[i], d.DeliveryCount())
		mu.Unlock()
		if i == 3 && d.DeliveryCount() == 0 {
			select {
			case <-ctx.Done():
				cause.Store(context.Cause(ctx))
				return context.Cause(ctx)
			case <-time.After(30 * time.Second):
				return errors.New("the lost lock never cancelled the handler")
			}
		}
		time.Sleep(300 * time.Millisecond) // long enough to need a renewal
		return nil
	}), amqpsub.Workers(n), amqpsub.Logger(logger(t)))
	stop, wait := runSub(t, s)
	waitFor(t, time.Minute, "10 completed", func() bool { return p.info(t, q).Stats["completed"] == n })
	stop()
	if err := wait(); err != nil {
		t.Fatal(err)
	}
	st := s.Stats()
	e := p.info(t, q)
	t.Logf("deliveries %v; stats %v; entity %+v", counts, st, e)
	if c, _ := cause.Load().(error); !errors.Is(c, amqpsub.ErrLockLost) {
		t.Fatalf("the handler's ctx cause: %v, want ErrLockLost", c)
	}
	if fmt.Sprint(counts[3]) != "[0 1]" || st.Locks.Skipped != 1 || st.Locks.Lost != 1 {
		t.Fatalf("message 3 delivered %v (want [0 1]), stats %v", counts[3], st)
	}
	for i := range n {
		if i != 3 && fmt.Sprint(counts[i]) != "[0]" {
			t.Fatalf("message %d disturbed: deliveries %v", i, counts[i])
		}
	}
	if e.Stats["delivered"] != n+1 || st.Settled.Accepted != n {
		t.Fatalf("entity %+v, stats %v", e, st)
	}
}

// BenchmarkServiceBusRenewalCost measures what renewing costs: 256
// deliveries held for two minutes at a 30 s lock (the handlers never
// return until the end), once arriving together and once spread over the
// first 20 s. It reports renew-lock requests and locks renewed per second.
//
//	go test -run '^$' -bench ServiceBusRenewalCost -benchtime 1x ./integration/
func BenchmarkServiceBusRenewalCost(b *testing.B) {
	p := serviceBusPeer(b)
	for _, spread := range []time.Duration{0, 20 * time.Second} {
		b.Run(fmt.Sprintf("arrivals-over-%v", spread), func(b *testing.B) {
			for range b.N {
				q := p.entity(b, map[string]any{"lock_duration_ms": 30000})
				release := make(chan struct{})
				var got atomic.Int32
				s, _ := amqpsub.New(sbConnector(b, p), q, amqpsub.HandlerFunc(func(ctx context.Context, d *amqpsub.Delivery) error {
					got.Add(1)
					<-release
					return nil
				}), amqpsub.Workers(256), amqpsub.Logger(logger(b)))
				stop, wait := runSub(b, s)
				if spread == 0 {
					p.send(b, q, 256)
				} else {
					for i := range 16 {
						p.send(b, q, 16, "-start", fmt.Sprint(16*i))
						time.Sleep(spread / 16)
					}
				}
				waitFor(b, time.Minute, "256 held", func() bool { return got.Load() == 256 })
				before := p.counters(b)
				const window = 2 * time.Minute
				time.Sleep(window)
				after := p.counters(b)
				close(release)
				stop()
				if err := wait(); err != nil {
					b.Fatal(err)
				}
				req := after["renew_lock_requests"] - before["renew_lock_requests"]
				tok := after["renew_lock_tokens"] - before["renew_lock_tokens"]
				if e := p.info(b, q); e.Stats["lock_expired"] != 0 {
					b.Fatalf("%d locks expired", e.Stats["lock_expired"])
				}
				b.ReportMetric(float64(req)/window.Seconds(), "requests/s")
				b.ReportMetric(float64(tok)/window.Seconds(), "locks-renewed/s")
			}
		})
	}
}

// 256 locks renewed in batches; one of them is lost, and the peer answers
// the batch that holds it each way a service could (410 or 400 for the
// whole request, or 200 with the other locks' expirations only). Only
// that lock is lost: the other 255 stay renewed, none expires. The test
// logs what the round cost: requests and tokens sent, and the time from
// the round's first request until the other 255 were renewed and until
// it ended.
func TestServiceBusMixedRenewBatchLosesOnlyTheLostLock(t *testing.T) {
	p := serviceBusPeer(t)
	for _, mode := range []string{"reject-all-410", "reject-all-400", "partial-200"} {
		t.Run(mode, func(t *testing.T) {
			t.Cleanup(func() { p.call(t, "POST", "/faults/renew-batch", map[string]any{"mode": "reject-all-410"}, nil) })
			const lock = 4 * time.Second
			q := p.entity(t, map[string]any{"lock_duration_ms": lock.Milliseconds(), "max_delivery_count": 100})
			p.call(t, "POST", "/messages", map[string]any{"entity": q, "count": 256, "message_id_prefix": "m"}, nil)
			gate := make(chan struct{})
			s, err := amqpsub.New(sbConnector(t, p), q, amqpsub.HandlerFunc(func(ctx context.Context, _ *amqpsub.Delivery) error {
				select {
				case <-gate:
				case <-ctx.Done():
				}
				return nil
			}), amqpsub.Credit(256), amqpsub.FixedCredit(), amqpsub.Workers(1), amqpsub.Logger(logger(t)))
			if err != nil {
				t.Fatal(err)
			}
			stop, wait := runSub(t, s)
			defer func() {
				close(gate)
				stop()
				if err := wait(); err != nil {
					t.Error(err)
				}
			}()
			waitFor(t, 30*time.Second, "256 locked", func() bool { return p.info(t, q).Locked == 256 })
			// A round renewing all 256 first, so that the next one holds
			// the lost lock with all the others.
			p.call(t, "POST", "/counters/reset", nil, nil)
			waitFor(t, 30*time.Second, "a round of 256", func() bool { return p.counters(t)["renew_lock_tokens"] >= 256 })
			time.Sleep(100 * time.Millisecond)
			p.call(t, "POST", "/counters/reset", nil, nil)
			var set struct{ Expired int }
			p.call(t, "POST", "/faults/renew-batch", map[string]any{"mode": mode, "expire_message_ids": []string{"m-100"}}, &set)
			if set.Expired != 1 {
				t.Fatalf("expired %d locks, want 1", set.Expired)
			}
			var first, others, done time.Time
			var c map[string]int
			deadline := time.Now().Add(30 * time.Second)
			for done.IsZero() && time.Now().Before(deadline) {
				c = p.counters(t)
				now := time.Now()
				if first.IsZero() && c["renew_lock_requests"] > 0 {
					first = now
				}
				if others.IsZero() && c["renew_lock_tokens"] >= 255 {
					others = now
				}
				// The split ends with the lost lock's own 410.
				if c["lock_lost_answers"]+c["renew_lock_failed_requests"] > 0 && c["renew_lock_requests"] >= 257 {
					done = now
				}
				time.Sleep(2 * time.Millisecond)
			}
			if done.IsZero() {
				t.Fatalf("the round did not end: counters %v", c)
			}
			t.Logf("%s: the round's first request to the other 255 renewed: %v; to the round's end: %v; %d requests, %d tokens sent, %d renewed",
				mode, others.Sub(first).Round(time.Millisecond), done.Sub(first).Round(time.Millisecond),
				c["renew_lock_requests"], c["renew_lock_tokens_asked"], c["renew_lock_tokens"])
			// Two more lock durations: no other lock expires.
			time.Sleep(2 * lock)
			c = p.counters(t)
			st := s.Stats()
			if c["lock_expirations"] != 1 || st.Locks.Lost != 1 {
				t.Fatalf("%d locks expired on the peer (want only the one made to), %d lost in amqpsub (want 1); counters %v",
					c["lock_expirations"], st.Locks.Lost, c)
			}
		})
	}
}

// The service detaches a receive link that has been idle for 10 minutes
// (Microsoft's AMQP troubleshooting guide); the peer does it after 800 ms
// here. Four handlers run 3 s on 10 s locks, so the link carries nothing
// meanwhile (no transfer, flow, disposition, nor a renewal naming it) and
// is detached under them. Their locks outlive the link: the handlers are
// not cut short, and their results are settled by lock token; nothing is
// delivered twice.
func TestServiceBusIdleDetachKeepsHeldLocks(t *testing.T) {
	p := serviceBusPeer(t)
	q := p.entity(t, map[string]any{"lock_duration_ms": 10000})
	p.send(t, q, 4)
	p.call(t, "POST", "/faults/idle-detach", map[string]any{"idle_ms": 800}, nil)
	t.Cleanup(func() { p.call(t, "POST", "/faults/idle-detach", map[string]any{"idle_ms": 0}, nil) })
	before := p.counters(t)
	var cut atomic.Int32
	s, err := amqpsub.New(sbConnector(t, p), q, amqpsub.HandlerFunc(func(ctx context.Context, d *amqpsub.Delivery) error {
		select {
		case <-time.After(3 * time.Second):
		case <-ctx.Done():
			cut.Add(1)
			return ctx.Err()
		}
		return nil
	}), amqpsub.Workers(4), amqpsub.Logger(logger(t)))
	if err != nil {
		t.Fatal(err)
	}
	stop, wait := runSub(t, s)
	waitFor(t, time.Minute, "4 completed", func() bool { return p.info(t, q).Stats["completed"] == 4 })
	stop()
	if err := wait(); err != nil {
		t.Fatal(err)
	}
	after := p.counters(t)
	e := p.info(t, q)
	st := s.Stats()
	idle := after["links_detached_idle"] - before["links_detached_idle"]
	t.Logf("idle detaches %d; entity %+v; stats %v", idle, e, st)
	if idle < 1 || st.LinksLost < 1 {
		t.Fatalf("idle detaches %d, links lost %d: the link was not detached under the handlers", idle, st.LinksLost)
	}
	if cut.Load() != 0 || e.Stats["delivered"] != 4 || e.Stats["lock_expired"] != 0 || st.Locks.SettledByToken != 4 {
		t.Fatalf("cut short %d, delivered %d, locks expired %d, settled by token %d: want 0, 4, 0, 4",
			cut.Load(), e.Stats["delivered"], e.Stats["lock_expired"], st.Locks.SettledByToken)
	}
}
