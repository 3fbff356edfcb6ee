package amqpsubtest_test

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/amqpsub/amqpsub/amqpsub"
	"github.com/amqpsub/amqpsub/amqpsubtest"
	"github.com/amqpsub/amqpsub/lanes"
)

// The adaptive credit (the default) through the whole pipeline, on the
// fake clock: with handlers that take 10 ms, then 0.1 ms, then 10 ms
// again, the credit stays near the 4 lanes while they are slow (4 + ⌈4 ×
// 400/s × 2 ms⌉ = 8), grows while they are fast, and comes back down once
// they are slow again; Stats shows the credit now and its bound. FixedCredit
// holds the whole credit throughout.
func TestAdaptiveCreditFollowsHandlersWhoseSpeedChanges(t *testing.T) {
	for _, fixed := range []bool{false, true} {
		t.Run(fmt.Sprintf("fixed=%v", fixed), func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				q := amqpsubtest.NewQueue()
				const n = 600
				for range n {
					q.Publish(amqpsubtest.Message("", "x"))
				}
				var handled atomic.Int64
				opts := []amqpsub.Option{amqpsub.Workers(4), amqpsub.Credit(64)}
				if fixed {
					opts = append(opts, amqpsub.FixedCredit())
				}
				sub := newSub(t, q, func(context.Context, *amqpsub.Delivery) error {
					if k := handled.Add(1); k <= n/3 || k > 2*n/3 {
						time.Sleep(10 * time.Millisecond)
					} else {
						time.Sleep(100 * time.Microsecond)
					}
					return nil
				}, opts...)
				stop := start(sub)
				var most [3]int // the highest credit seen in each third
				last := 0
				for handled.Load() < n {
					st := sub.Stats()
					if st.CreditLimit != 64 || st.Credit < 4 || st.Credit > 64 {
						t.Fatalf("credit %d, limit %d", st.Credit, st.CreditLimit)
					}
					phase := min(2, int(handled.Load())*3/n)
					most[phase] = max(most[phase], st.Credit)
					last = st.Credit
					time.Sleep(time.Millisecond)
				}
				if err := q.Wait(t.Context()); err != nil {
					t.Fatal(err)
				}
				if err := stop(); err != nil {
					t.Fatal(err)
				}
				st := sub.Stats()
				if st.Settled.Accepted != n {
					t.Fatalf("%v; want %d accepted", st, n)
				}
				t.Logf("highest credit by third %v, last %d, max held %d", most, last, st.MaxHeld)
				if fixed {
					if most != [3]int{64, 64, 64} || st.MaxHeld != 64 {
						t.Fatalf("FixedCredit: credit by third %v, max held %d; want 64 throughout", most, st.MaxHeld)
					}
					return
				}
				if most[0] > 8 || most[1] <= 8 || last > 8 {
					t.Fatalf("credit by third %v, last %d: want ≤ 8 while slow, more while fast, ≤ 8 again at the end", most, last)
				}
			})
		})
	}
}

// A handler stuck on one delivery: its lane's backlog is held on top of
// the adaptive credit (parked), so the other lanes go on as far as with a
// fixed credit, until the stuck lane's backlog alone fills the ceiling.
// Before, the backlog took the whole adaptive credit and every lane
// stopped once 64 were parked.
func TestAdaptiveCreditAStuckLaneDoesNotStarveTheOthers(t *testing.T) {
	run := func(t *testing.T, opts ...amqpsub.Option) (handled int64, st amqpsub.Stats) {
		synctest.Test(t, func(t *testing.T) {
			q := amqpsubtest.NewQueue()
			for i := range 20000 {
				q.Publish(amqpsubtest.Message(fmt.Sprintf("g%03d", i%100), fmt.Sprint(i)))
			}
			var n atomic.Int64
			sub := newSub(t, q, func(ctx context.Context, d *amqpsub.Delivery) error {
				if text(d) == "5000" {
					<-ctx.Done() // stuck until the stop
					return ctx.Err()
				}
				time.Sleep(time.Millisecond)
				n.Add(1)
				return nil
			}, append([]amqpsub.Option{amqpsub.WorkersByKey(8), amqpsub.GracePeriod(0)}, opts...)...)
			stop := start(sub)
			time.Sleep(20 * time.Second)
			synctest.Wait()
			handled, st = n.Load(), sub.Stats()
			if err := stop(); err != nil {
				t.Fatal(err)
			}
		})
		return handled, st
	}
	adaptive, ast := run(t)
	fixed, fst := run(t, amqpsub.FixedCredit())
	t.Logf("adaptive: %d handled, %v; fixed: %d handled, %v", adaptive, ast, fixed, fst)
	if adaptive < fixed*95/100 || adaptive < 6000 {
		t.Fatalf("adaptive credit: %d handled past a stuck lane, fixed %d", adaptive, fixed)
	}
	if ast.Held != 256 || ast.Credit != 256 {
		t.Fatalf("adaptive credit: held %d, credit %d; want the stuck lane's backlog at the ceiling, 256", ast.Held, ast.Credit)
	}
}

// Two lanes, group a's first delivery stuck, then group b: the free lane
// should handle b's deliveries.
func TestAdaptiveCreditAStuckGroupLeavesTheFreeLaneCredit(t *testing.T) {
	// find a key b on the other hash lane from a
	b := ""
	for i := range 100 {
		k := fmt.Sprintf("b%d", i)
		if lanes.LaneOf(k, 2) != lanes.LaneOf("a", 2) {
			b = k
			break
		}
	}
	for _, tc := range []struct {
		name string
		opts []amqpsub.Option
	}{
		{"balanced", []amqpsub.Option{amqpsub.WorkersByKey(2), amqpsub.BalanceKeys()}},
		{"balanced-fixed", []amqpsub.Option{amqpsub.WorkersByKey(2), amqpsub.BalanceKeys(), amqpsub.FixedCredit()}},
		{"hash", []amqpsub.Option{amqpsub.WorkersByKey(2)}},
		{"hash-fixed", []amqpsub.Option{amqpsub.WorkersByKey(2), amqpsub.FixedCredit()}},
	} {
		for _, na := range []int{2, 3, 5} {
			t.Run(fmt.Sprintf("%s/a=%d", tc.name, na), func(t *testing.T) {
				synctest.Test(t, func(t *testing.T) {
					q := amqpsubtest.NewQueue()
					for i := range na {
						q.Publish(amqpsubtest.Message("a", fmt.Sprint("a", i)))
					}
					for i := range 10 {
						q.Publish(amqpsubtest.Message(b, fmt.Sprint("b", i)))
					}
					var nb atomic.Int64
					sub := newSub(t, q, func(ctx context.Context, d *amqpsub.Delivery) error {
						if text(d) == "a0" {
							<-ctx.Done()
							return ctx.Err()
						}
						if text(d)[0] == 'b' {
							nb.Add(1)
						}
						return nil
					}, append([]amqpsub.Option{amqpsub.GracePeriod(0)}, tc.opts...)...)
					stop := start(sub)
					time.Sleep(10 * time.Second)
					synctest.Wait()
					st := sub.Stats()
					_ = stop()
					if nb.Load() != 10 {
						t.Errorf("b handled %d of 10 with a free lane; held %d credit %d/%d", nb.Load(), st.Held, st.Credit, st.CreditLimit)
					}
				})
			})
		}
	}
}

// A burst of one slow group (10 s a delivery) ahead of 100 fast groups,
// 8 lanes: the fast ones are done after 5 s, as with a fixed credit. The
// slow group's backlog took the whole floor; the pump's tick re-reads the
// parked count, so the free lanes get credit although nothing settles.
// Under the hash placement the fast groups that hash to the slow group's
// lane wait behind it either way (86 of 100 done here).
func TestAdaptiveCreditASlowGroupLeavesTheOtherLanesCredit(t *testing.T) {
	for _, c := range []struct {
		name string
		o    []amqpsub.Option
		want int64 // fast groups done after 5 s
	}{
		{"balanced", []amqpsub.Option{amqpsub.WorkersByKey(8), amqpsub.BalanceKeys()}, 100},
		{"balanced, fixed", []amqpsub.Option{amqpsub.WorkersByKey(8), amqpsub.BalanceKeys(), amqpsub.FixedCredit()}, 100},
		{"hash", []amqpsub.Option{amqpsub.WorkersByKey(8)}, 86},
		{"hash, fixed", []amqpsub.Option{amqpsub.WorkersByKey(8), amqpsub.FixedCredit()}, 86},
	} {
		o := c.o
		t.Run(c.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				q := amqpsubtest.NewQueue()
				for i := range 8 {
					q.Publish(amqpsubtest.Message("slow", fmt.Sprint("s", i)))
				}
				for i := range 100 {
					q.Publish(amqpsubtest.Message(fmt.Sprint("f", i), fmt.Sprint("f", i)))
				}
				var fast atomic.Int64
				sub := newSub(t, q, func(ctx context.Context, d *amqpsub.Delivery) error {
					if text(d)[0] == 's' {
						time.Sleep(10 * time.Second)
						return nil
					}
					time.Sleep(time.Millisecond)
					fast.Add(1)
					return nil
				}, append([]amqpsub.Option{amqpsub.GracePeriod(0)}, o...)...)
				stop := start(sub)
				time.Sleep(5 * time.Second)
				f5 := fast.Load()
				time.Sleep(50 * time.Second)
				f55 := fast.Load()
				_ = stop()
				t.Logf("%d options: fast done after 5 s: %d, after 55 s: %d", len(o), f5, f55)
				want := c.want
				if f5 < want {
					t.Errorf("fast handled %d of 100 after 5 s with 7 lanes free, want %d", f5, want)
				}
			})
		})
	}
}

func TestAdaptiveCreditDrainsInEveryShape(t *testing.T) {
	type tc struct {
		name    string
		opts    []amqpsub.Option
		batch   bool
		profile *amqpsub.Profile
		groups  int
		lose    bool
		fail    bool // first attempt of every 7th fails
	}
	rmq := amqpsub.RabbitMQ3
	cases := []tc{
		{name: "credit1-w4", opts: []amqpsub.Option{amqpsub.Credit(1), amqpsub.Workers(4)}},
		{name: "credit1-byKey4", opts: []amqpsub.Option{amqpsub.Credit(1), amqpsub.WorkersByKey(4)}, groups: 3},
		{name: "credit1-bal4", opts: []amqpsub.Option{amqpsub.Credit(1), amqpsub.WorkersByKey(4), amqpsub.BalanceKeys()}, groups: 3},
		{name: "bytes-tiny", opts: []amqpsub.Option{amqpsub.MaxHeldBytes(1), amqpsub.Workers(4)}},
		{name: "bytes-tiny-bal", opts: []amqpsub.Option{amqpsub.MaxHeldBytes(3), amqpsub.WorkersByKey(4), amqpsub.BalanceKeys()}, groups: 2},
		{name: "batch>credit", opts: []amqpsub.Option{amqpsub.Credit(3), amqpsub.Workers(2), amqpsub.Batch(10, 0)}, batch: true},
		{name: "batch>credit-wait", opts: []amqpsub.Option{amqpsub.Credit(3), amqpsub.Workers(2), amqpsub.Batch(10, time.Second)}, batch: true},
		{name: "batch-bal", opts: []amqpsub.Option{amqpsub.Credit(16), amqpsub.WorkersByKey(3), amqpsub.BalanceKeys(), amqpsub.Batch(5, 10*time.Millisecond)}, batch: true, groups: 2},
		{name: "batch-byKey", opts: []amqpsub.Option{amqpsub.Credit(16), amqpsub.WorkersByKey(3), amqpsub.Batch(5, 10*time.Millisecond)}, batch: true, groups: 2},
		{name: "batch-bal-keyless", opts: []amqpsub.Option{amqpsub.Credit(16), amqpsub.WorkersByKey(3), amqpsub.BalanceKeys(), amqpsub.Batch(5, 0)}, batch: true},
		{name: "localretry-bal", opts: []amqpsub.Option{amqpsub.WorkersByKey(4), amqpsub.BalanceKeys(), amqpsub.LocalRetry(amqpsub.RetryPolicy{Attempts: 3, Initial: 10 * time.Millisecond})}, groups: 2, fail: true},
		{name: "localretry-byKey", opts: []amqpsub.Option{amqpsub.WorkersByKey(4), amqpsub.LocalRetry(amqpsub.RetryPolicy{Attempts: 3, Initial: 10 * time.Millisecond})}, groups: 2, fail: true},
		{name: "lose", opts: []amqpsub.Option{amqpsub.Workers(4)}, lose: true},
		{name: "lose-bal", opts: []amqpsub.Option{amqpsub.WorkersByKey(4), amqpsub.BalanceKeys()}, lose: true, groups: 3},
		{name: "rmq3", opts: []amqpsub.Option{amqpsub.Workers(4), amqpsub.WithProfile(amqpsub.RabbitMQ3)}, profile: &rmq},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				var qo []amqpsubtest.Option
				if c.profile != nil {
					qo = append(qo, amqpsubtest.WithProfile(*c.profile))
				}
				q := amqpsubtest.NewQueue(qo...)
				const n = 300
				for i := range n {
					g := ""
					if c.groups > 0 {
						g = fmt.Sprint("g", i%c.groups)
					}
					q.Publish(amqpsubtest.Message(g, fmt.Sprint(i)))
				}
				var tries sync_map
				h := func(d *amqpsub.Delivery) error {
					time.Sleep(time.Millisecond)
					if c.fail && tries.first(text(d)) && len(text(d))%2 == 0 {
						return errors.New("once")
					}
					return nil
				}
				var sub *amqpsub.Subscriber
				var err error
				if c.batch {
					sub, err = amqpsub.NewBatch(q.Connector(), "orders", amqpsub.BatchHandlerFunc(func(ctx context.Context, b []*amqpsub.Delivery) []error {
						r := make([]error, len(b))
						for i, d := range b {
							r[i] = h(d)
						}
						return r
					}), c.opts...)
				} else {
					sub, err = amqpsub.New(q.Connector(), "orders", amqpsub.HandlerFunc(func(ctx context.Context, d *amqpsub.Delivery) error { return h(d) }), c.opts...)
				}
				if err != nil {
					t.Fatal(err)
				}
				stop := start(sub)
				if c.lose {
					go func() {
						for range 5 {
							time.Sleep(20 * time.Millisecond)
							q.LoseLinks(nil)
						}
					}()
				}
				ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
				defer cancel()
				err = q.Wait(ctx)
				st := sub.Stats()
				if err != nil {
					t.Errorf("not drained: %v; held %d credit %d/%d accepted %d", err, st.Held, st.Credit, st.CreditLimit, st.Settled.Accepted)
				}
				if err := stop(); err != nil && !errors.Is(err, context.Canceled) {
					t.Logf("stop: %v", err)
				}
				st = sub.Stats()
				if st.Held != 0 {
					t.Errorf("held %d after stop", st.Held)
				}
			})
		})
	}
}

type sync_map struct {
	m atomic.Pointer[map[string]bool]
}

func (s *sync_map) first(k string) bool {
	for {
		old := s.m.Load()
		nm := map[string]bool{}
		if old != nil {
			if (*old)[k] {
				return false
			}
			for kk, v := range *old {
				nm[kk] = v
			}
		}
		nm[k] = true
		if s.m.CompareAndSwap(old, &nm) {
			return true
		}
	}
}

// A subscriber started before its producer, then a trickle (100 msgs/s,
// 1 ms handlers): within a second of the trickle the round trip is at
// most 10 ms, and the credit, and what the broker holds of it, is at most
// the floor + 2, in every lane mode on every profile; the floor + 5
// under RabbitMQ3, whose windowed credit times every grant, so that the
// trickle's gap (10 ms) is its round trip: floor + ⌈4 × 105/s × 10 ms⌉ (the
// rate, a count decaying over 100 ms, reads 105/s). Before, the first
// grant's round trip was the 3 s the queue stood empty (capped at 1 s), no
// later grant corrected it, and the trickle held the ceiling: a burst
// would have landed 256 deliveries on this one replica.
func TestAdaptiveCreditAnIdleStartDoesNotPinIt(t *testing.T) {
	profiles := []struct {
		name  string
		q     []amqpsubtest.Option
		sub   []amqpsub.Option
		above int // the bound's excess over the floor
	}{
		{"artemis", nil, nil, 2},
		{"rabbitmq3", []amqpsubtest.Option{amqpsubtest.WithProfile(amqpsub.RabbitMQ3)}, []amqpsub.Option{amqpsub.WithProfile(amqpsub.RabbitMQ3)}, 5},
		{"rabbitmq4-quorum", []amqpsubtest.Option{amqpsubtest.WithProfile(amqpsub.RabbitMQ4)}, []amqpsub.Option{amqpsub.WithProfile(amqpsub.RabbitMQ4)}, 2},
		{"rabbitmq4-classic", []amqpsubtest.Option{amqpsubtest.WithProfile(amqpsub.RabbitMQ4), amqpsubtest.WithQueueType(amqpsubtest.Classic)}, []amqpsub.Option{amqpsub.WithProfile(amqpsub.RabbitMQ4)}, 2},
		{"servicebus", []amqpsubtest.Option{amqpsubtest.WithProfile(amqpsub.AzureServiceBus)}, nil, 2},
	}
	modes := []struct {
		name  string
		opts  []amqpsub.Option
		floor int
	}{
		{"Workers(4)", []amqpsub.Option{amqpsub.Workers(4)}, 4},
		{"WorkersByKey(4)", []amqpsub.Option{amqpsub.WorkersByKey(4)}, 4},
		{"BalanceKeys", []amqpsub.Option{amqpsub.WorkersByKey(4), amqpsub.BalanceKeys()}, 4},
	}
	for _, p := range profiles {
		for _, m := range modes {
			t.Run(p.name+"/"+m.name, func(t *testing.T) {
				synctest.Test(t, func(t *testing.T) {
					q := amqpsubtest.NewQueue(p.q...)
					sub := newSub(t, q, func(context.Context, *amqpsub.Delivery) error {
						time.Sleep(time.Millisecond)
						return nil
					}, append(append([]amqpsub.Option{}, p.sub...), m.opts...)...)
					stop := start(sub)
					time.Sleep(3 * time.Second)
					done := make(chan struct{})
					go func() { // the producer: 100 msgs/s over 10 groups
						defer close(done)
						for i := range 150 {
							q.Publish(amqpsubtest.Message(fmt.Sprint("g", i%10), fmt.Sprint(i)))
							time.Sleep(10 * time.Millisecond)
						}
					}()
					most, mostBroker := 0, 0
					var rtt time.Duration
					for range 150 {
						time.Sleep(10 * time.Millisecond)
						st := sub.Stats()
						most = max(most, st.Credit)
						mostBroker = max(mostBroker, q.Credit()+st.Held)
						rtt = max(rtt, st.RoundTrip)
					}
					<-done
					if err := q.Wait(t.Context()); err != nil {
						t.Fatal(err)
					}
					if err := stop(); err != nil {
						t.Fatal(err)
					}
					if n := len(q.Accepted()); n != 150 {
						t.Fatalf("%d accepted, want 150", n)
					}
					t.Logf("credit up to %d, at the broker and held up to %d, round trip up to %v", most, mostBroker, rtt)
					if want := m.floor + p.above; rtt > 10*time.Millisecond || most > want || mostBroker > want {
						t.Fatalf("under a trickle after an idle start: round trip up to %v, credit up to %d, at the broker and held up to %d; want ≤ 10 ms and ≤ %d",
							rtt, most, mostBroker, want)
					}
				})
			})
		}
	}
}
