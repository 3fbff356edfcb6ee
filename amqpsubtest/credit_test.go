package amqpsubtest_test

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/amqpsub/amqpsub/amqpsub"
	"github.com/amqpsub/amqpsub/amqpsubtest"
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
