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
	"github.com/amqpsub/amqpsub/internal/lanes"
	"github.com/amqpsub/amqpsub/internal/shapes"
)

// The adaptive credit (the default) through the whole pipeline, on the
// fake clock, on every profile and lane mode: with handler calls that take
// 10 ms, then 0.1 ms, then 10 ms again, the credit stays within its bound
// while they are slow (floor + in-flight + allowance, see creditBound:
// with Workers(4), 4 + ⌈4 × 420/s × 2 ms⌉ = 8), grows past it while they
// are fast, and is back within it by the end, once they are slow again; Stats shows
// the credit now and its bound. FixedCredit holds the whole credit
// throughout. A skewed workload is left out: there a hot group's backlog
// is held on top of the bound by design, and hides the rate's part; so is
// one group per message, which parks nothing, as keyless does, and which
// TestShapeMatrix runs.
func TestAdaptiveCreditFollowsHandlersWhoseSpeedChanges(t *testing.T) {
	for _, p := range shapes.Profiles() {
		t.Run(p.Name, func(t *testing.T) {
			for _, l := range shapes.Lanes() {
				t.Run(l.Name, func(t *testing.T) {
					for _, w := range shapes.Workloads() {
						if !w.Skewed && w.Repeats || w.Name == "keyless" {
							t.Run(w.Name, func(t *testing.T) { followsHandlers(t, p, l, w, false) })
						}
					}
					t.Run("FixedCredit", func(t *testing.T) { followsHandlers(t, p, l, shapes.Workloads()[0], true) })
				})
			}
		})
	}
}

func followsHandlers(t *testing.T, p shapes.Profile, l shapes.Lane, w shapes.Workload, fixed bool) {
	synctest.Test(t, func(t *testing.T) {
		q := amqpsubtest.NewQueue(p.QueueOptions...)
		// Each third lasts about half a second at the slow pace, five
		// times the drain rate's time constant.
		n := 3 * 50 * l.Floor()
		for i, g := range w.Groups(n) {
			q.Publish(amqpsubtest.Message(g, fmt.Sprintf("%0*d", shapes.BodySize, i)))
		}
		var handled atomic.Int64
		opts := []amqpsub.Option{amqpsub.Credit(64)}
		if fixed {
			opts = append(opts, amqpsub.FixedCredit())
		}
		sub := shapeSub(t, q, p, l, func() time.Duration {
			if k := handled.Load(); k < int64(n/3) || k >= int64(2*n/3) {
				return matrixHandling
			}
			return 100 * time.Microsecond
		}, func(context.Context, *amqpsub.Delivery) error {
			handled.Add(1)
			return nil
		}, opts...)
		stop := start(sub)
		var most [3]int  // the highest credit seen in each third
		slowBound := 0   // the highest bound seen in the first third
		var first string // the first credit past its bound in the first third
		last, lastBound := 0, 0
		parked := 0 // Stats.Parked in the sample before
		least := min(64, l.Floor())
		if l.MaxHeldBytes > 0 {
			least = 1 // one at a time until a size is seen
		}
		for handled.Load() < int64(n) {
			st := sub.Stats()
			if st.CreditLimit != 64 || st.Credit < least || st.Credit > 64 {
				t.Errorf("credit %d, limit %d", st.Credit, st.CreditLimit)
				break
			}
			phase := min(2, int(handled.Load())*3/n)
			most[phase] = max(most[phase], st.Credit)
			last = st.Credit
			prevParked := parked
			parked = st.Parked
			if phase != 1 {
				bound, inFlight, allowance := creditBound(p, l, st, parkedBound(l, w, prevParked, st.Parked))
				lastBound = bound
				if phase == 0 {
					slowBound = max(slowBound, bound)
				}
				if phase == 0 && st.Credit > bound && first == "" {
					first = fmt.Sprintf("third %d: credit %d > %d = min(limit %d, floor %d + in-flight %d + allowance %d)",
						phase+1, st.Credit, bound, st.CreditLimit, l.Floor(), inFlight, allowance)
				}
			}
			time.Sleep(time.Millisecond)
		}
		if err := q.Wait(t.Context()); err != nil {
			t.Fatal(err)
		}
		if err := stop(); err != nil {
			t.Fatal(err)
		}
		st := sub.Stats()
		if st.Settled.Accepted != uint64(n) {
			t.Fatalf("%v; want %d accepted", st, n)
		}
		t.Logf("highest credit by third %v, last %d (bound %d), bound while slow at most %d, max held %d", most, last, lastBound, slowBound, st.MaxHeld)
		if fixed {
			if most != [3]int{64, 64, 64} || st.MaxHeld != 64 {
				t.Fatalf("FixedCredit: credit by third %v, max held %d; want 64 throughout", most, st.MaxHeld)
			}
			return
		}
		if first != "" {
			t.Errorf("credit past its bound while slow: %s", first)
		}
		if last > lastBound {
			t.Errorf("credit %d at the end, slow again; want ≤ %d", last, lastBound)
		}
		if most[1] <= slowBound {
			t.Errorf("credit by third %v: want more than %d while fast", most, slowBound)
		}
	})
}

// A handler stuck on one delivery: its lane's backlog is held on top of
// the adaptive credit (parked), so the other lanes go on as far as with a
// fixed credit, until the stuck lane's backlog alone fills the ceiling.
// Before, the backlog took the whole adaptive credit and every lane
// stopped once 64 were parked.
//
// What waits behind a stalled call is held in full on every profile, so
// it runs on each, with the hash placement and with BalanceKeys (which
// promises that a stuck group holds back no other), each with the
// workloads that send the stuck lane or group a backlog. Under
// BalanceKeys only the stuck group waits: the held backlog is its own,
// far from the ceiling.
func TestAdaptiveCreditAStuckLaneDoesNotStarveTheOthers(t *testing.T) {
	run := func(t *testing.T, p shapes.Profile, groups []string, opts ...amqpsub.Option) (handled int64, st amqpsub.Stats) {
		synctest.Test(t, func(t *testing.T) {
			q := amqpsubtest.NewQueue(p.QueueOptions...)
			for i, g := range groups {
				q.Publish(amqpsubtest.Message(g, fmt.Sprint(i)))
			}
			var n atomic.Int64
			sub := newSub(t, q, func(ctx context.Context, d *amqpsub.Delivery) error {
				if text(d) == "1000" {
					<-ctx.Done() // stuck until the stop
					return ctx.Err()
				}
				time.Sleep(time.Millisecond)
				n.Add(1)
				return nil
			}, append(append([]amqpsub.Option{amqpsub.GracePeriod(0)}, p.Options...), opts...)...)
			stop := start(sub)
			time.Sleep(4 * time.Second)
			synctest.Wait()
			handled, st = n.Load(), sub.Stats()
			if err := stop(); err != nil {
				t.Fatal(err)
			}
		})
		return handled, st
	}
	for _, p := range shapes.Profiles() {
		for _, l := range []struct {
			name    string
			opts    []amqpsub.Option
			ceiling bool // the stuck lane's backlog reaches the ceiling
		}{
			{"WorkersByKey(8)", []amqpsub.Option{amqpsub.WorkersByKey(8)}, true},
			{"WorkersByKey(8)+BalanceKeys", []amqpsub.Option{amqpsub.WorkersByKey(8), amqpsub.BalanceKeys()}, false},
		} {
			for _, w := range shapes.Workloads() {
				if w.Name != "uniform100" && w.Name != "keyless" {
					continue // one group per message: nothing waits behind the stuck one
				}
				if !l.ceiling && w.Name == "keyless" {
					continue // nothing waits under BalanceKeys
				}
				t.Run(p.Name+"/"+l.name+"/"+w.Name, func(t *testing.T) {
					groups := w.Groups(5000)
					adaptive, ast := run(t, p, groups, l.opts...)
					fixed, fst := run(t, p, groups, append(l.opts, amqpsub.FixedCredit())...)
					t.Logf("adaptive: %d handled, %v; fixed: %d handled, %v", adaptive, ast, fixed, fst)
					// Past the stuck delivery the hash lanes go on until the
					// stuck lane holds the ceiling, about 7 × 256 more.
					if adaptive < fixed*95/100 || adaptive < 2500 {
						t.Errorf("adaptive credit: %d handled past a stuck lane, fixed %d", adaptive, fixed)
					}
					if l.ceiling && (ast.Held != 256 || ast.Credit != 256) {
						t.Errorf("adaptive credit: held %d, credit %d; want the stuck lane's backlog at the ceiling, 256", ast.Held, ast.Credit)
					}
				})
			}
		}
	}
}

// Group a's first delivery stuck, then group b on another lane: the free
// lanes should handle b's deliveries, on every profile and keyed lane
// mode, with the adaptive credit and with FixedCredit.
func TestAdaptiveCreditAStuckGroupLeavesTheFreeLaneCredit(t *testing.T) {
	for _, p := range shapes.Profiles() {
		for _, l := range shapes.Lanes() {
			if !l.ByKey || l.Balanced && l.Batch > 0 {
				// Workers: no lane is a's. BalanceKeys with batches: b
				// joins a's open batch, which a handler stuck on a0
				// holds with it; under the hash, b is on another lane.
				continue
			}
			// find a key b on another hash lane from a
			b := ""
			for i := range 100 {
				k := fmt.Sprintf("b%d", i)
				if lanes.LaneOf(k, l.Workers) != lanes.LaneOf("a", l.Workers) {
					b = k
					break
				}
			}
			for _, fixed := range []bool{false, true} {
				for _, na := range []int{2, 3, 5} {
					name := fmt.Sprintf("%s/%s/a=%d", p.Name, l.Name, na)
					opts := []amqpsub.Option{amqpsub.GracePeriod(0)}
					if fixed {
						name = fmt.Sprintf("%s/%s+FixedCredit/a=%d", p.Name, l.Name, na)
						opts = append(opts, amqpsub.FixedCredit())
					}
					t.Run(name, func(t *testing.T) {
						synctest.Test(t, func(t *testing.T) {
							q := amqpsubtest.NewQueue(p.QueueOptions...)
							for i := range na {
								q.Publish(amqpsubtest.Message("a", fmt.Sprint("a", i)))
							}
							for i := range 10 {
								q.Publish(amqpsubtest.Message(b, fmt.Sprint("b", i)))
							}
							var nb atomic.Int64
							sub := shapeSub(t, q, p, l, func() time.Duration { return 0 }, func(ctx context.Context, d *amqpsub.Delivery) error {
								if text(d) == "a0" {
									<-ctx.Done()
									return ctx.Err()
								}
								if text(d)[0] == 'b' {
									nb.Add(1)
								}
								return nil
							}, opts...)
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
	}
}

// A burst of one slow group (10 s a delivery) ahead of 100 fast groups,
// 8 lanes, on every profile: the fast ones are done after 5 s, as with a
// fixed credit. The slow group's backlog took the whole floor; the
// pump's tick re-reads the parked count, so the free lanes get credit
// although nothing settles. Under the hash placement the fast groups that
// hash to the slow group's lane wait behind it either way (86 of 100 done
// here).
func TestAdaptiveCreditASlowGroupLeavesTheOtherLanesCredit(t *testing.T) {
	for _, p := range shapes.Profiles() {
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
			o := append(append([]amqpsub.Option{amqpsub.GracePeriod(0)}, p.Options...), c.o...)
			t.Run(p.Name+"/"+c.name, func(t *testing.T) {
				synctest.Test(t, func(t *testing.T) {
					q := amqpsubtest.NewQueue(p.QueueOptions...)
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
					}, o...)
					stop := start(sub)
					time.Sleep(5 * time.Second)
					f5 := fast.Load()
					time.Sleep(50 * time.Second)
					f55 := fast.Load()
					_ = stop()
					t.Logf("fast done after 5 s: %d, after 55 s: %d", f5, f55)
					if f5 < c.want {
						t.Errorf("fast handled %d of 100 after 5 s with 7 lanes free, want %d", f5, c.want)
					}
				})
			})
		}
	}
}

// Edge shapes (a credit of 1, byte budgets below a message, batches
// larger than the credit, LocalRetry, lost links), on every profile: the
// queue drains and nothing stays held after the stop.
func TestAdaptiveCreditDrainsInEveryShape(t *testing.T) {
	type tc struct {
		name   string
		opts   []amqpsub.Option
		batch  bool
		groups int
		lose   bool
		fail   bool // first attempt of every 7th fails
	}
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
	}
	for _, p := range shapes.Profiles() {
		for _, c := range cases {
			drainsInShape(t, p, c.name, append(append([]amqpsub.Option(nil), p.Options...), c.opts...), c.batch, c.groups, c.lose, c.fail)
		}
	}
}

func drainsInShape(t *testing.T, p shapes.Profile, name string, opts []amqpsub.Option, batch bool, groups int, lose, fail bool) {
	t.Run(p.Name+"/"+name, func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			q := amqpsubtest.NewQueue(p.QueueOptions...)
			const n = 300
			for i := range n {
				g := ""
				if groups > 0 {
					g = fmt.Sprint("g", i%groups)
				}
				q.Publish(amqpsubtest.Message(g, fmt.Sprint(i)))
			}
			var tries sync_map
			h := func(d *amqpsub.Delivery) error {
				time.Sleep(time.Millisecond)
				if fail && tries.first(text(d)) && len(text(d))%2 == 0 {
					return errors.New("once")
				}
				return nil
			}
			var sub *amqpsub.Subscriber
			var err error
			if batch {
				sub, err = amqpsub.NewBatch(q.Connector(), "orders", amqpsub.BatchHandlerFunc(func(ctx context.Context, b []*amqpsub.Delivery) []error {
					r := make([]error, len(b))
					for i, d := range b {
						r[i] = h(d)
					}
					return r
				}), opts...)
			} else {
				sub, err = amqpsub.New(q.Connector(), "orders", amqpsub.HandlerFunc(func(ctx context.Context, d *amqpsub.Delivery) error { return h(d) }), opts...)
			}
			if err != nil {
				t.Fatal(err)
			}
			stop := start(sub)
			if lose {
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

// A burst with fast handlers raises the credit; the queue then empties,
// and a trickle of one message a second follows. What the broker holds
// runs down toward the limit, one a delivery but for the first few flows
// owed after a last settlement: each waits longer once a delivery has
// followed one. Before, each added back, 250 ms later, what its delivery
// took, and the broker kept the burst's credit (233 against a limit of 4).
func TestAdaptiveCreditASlowTrickleRunsABurstsCreditDown(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		q := amqpsubtest.NewQueue()
		sub := newSub(t, q, func(context.Context, *amqpsub.Delivery) error {
			time.Sleep(100 * time.Microsecond)
			return nil
		}, amqpsub.Workers(4))
		stop := start(sub)
		for i := range 5000 {
			q.Publish(amqpsubtest.Message("", fmt.Sprint(i)))
		}
		if err := q.Wait(t.Context()); err != nil {
			t.Fatal(err)
		}
		time.Sleep(time.Second)
		after := q.Credit()
		for i := range 300 {
			q.Publish(amqpsubtest.Message("", fmt.Sprint("t", i)))
			time.Sleep(time.Second)
		}
		st := sub.Stats()
		end := q.Credit()
		t.Logf("broker's credit after the burst %d; after 300 s of 1/s %d; Stats().Credit %d", after, end, st.Credit)
		if err := stop(); err != nil {
			t.Fatal(err)
		}
		if after < 100 || end > st.Credit+1 {
			t.Errorf("the broker holds %d credit after the burst, %d after 300 deliveries at 1/s; the limit is %d: want more than 100, then the limit", after, end, st.Credit)
		}
	})
}

// WorkersByKey(2) on a RabbitMQ 4 classic queue: one handler call of
// 10 min (say a call that waited for its ctx) counts for at most four
// times the calls' mean, so a later stuck call is still seen as stalled
// and the other groups queued behind it in its hash lane are parked: the
// free lane goes on as without the long call. That holds with the long
// call on the lane that is stuck later, and as the first call of the lane
// that is free later (a lane's first timed call, which sets its own mean).
// Before, the long call raised the mean to 37 s, and the free lane
// handled 4 of 1000 in 60 s; as a lane's first call, 2 of 1000.
func TestAdaptiveCreditALongCallDoesNotHideALaterStall(t *testing.T) {
	for _, tc := range []struct {
		name  string
		long  bool
		lane  int  // the long call's lane: 0 is stuck later, 1 is free
		first bool // the long call is its lane's first
	}{
		{name: "no long call"},
		{name: "on the stuck lane", long: true, lane: 0},
		{name: "the free lane's first call", long: true, lane: 1, first: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				q := amqpsubtest.NewQueue(amqpsubtest.WithProfile(amqpsub.RabbitMQ4), amqpsubtest.WithQueueType(amqpsubtest.Classic))
				// Groups by lane.
				var on [2][]string
				for i := 0; len(on[0]) < 50 || len(on[1]) < 50; i++ {
					g := fmt.Sprint("g", i)
					l := lanes.LaneOf(g, 2)
					on[l] = append(on[l], g)
				}
				var free atomic.Int64
				sub := newSub(t, q, func(ctx context.Context, d *amqpsub.Delivery) error {
					switch text(d) {
					case "long":
						time.Sleep(10 * time.Minute)
					case "stuck":
						<-ctx.Done()
						return ctx.Err()
					default:
						time.Sleep(time.Millisecond)
						if lanes.LaneOf(d.GroupID(), 2) == 1 {
							free.Add(1)
						}
					}
					return nil
				}, amqpsub.WorkersByKey(2), amqpsub.WithProfile(amqpsub.RabbitMQ4), amqpsub.GracePeriod(0))
				stop := start(sub)
				if tc.long && tc.first {
					q.Publish(amqpsubtest.Message(on[tc.lane][0], "long"))
				}
				for i := range 100 {
					q.Publish(amqpsubtest.Message(on[i%2][i%50], fmt.Sprint(i)))
				}
				if tc.long && !tc.first {
					q.Publish(amqpsubtest.Message(on[tc.lane][0], "long"))
				}
				time.Sleep(11 * time.Minute)
				synctest.Wait()
				q.Publish(amqpsubtest.Message(on[0][1], "stuck"))
				for i := range 2000 { // half behind the stuck lane, half for the free one
					q.Publish(amqpsubtest.Message(on[i%2][i%50], fmt.Sprint("x", i)))
				}
				before := free.Load()
				time.Sleep(60 * time.Second)
				synctest.Wait()
				got := free.Load() - before
				st := sub.Stats()
				_ = stop()
				t.Logf("%s: the free lane handled %d of 1000 in 60 s; held %d, parked %d, credit %d", tc.name, got, st.Held, st.Parked, st.Credit)
				if got < 200 { // without the long call: 254, until the stuck lane's backlog fills the ceiling (256)
					t.Errorf("the free lane handled %d of its 1000 in 60 s behind another lane's stuck call (held %d, parked %d, credit %d)", got, st.Held, st.Parked, st.Credit)
				}
			})
		})
	}
}
