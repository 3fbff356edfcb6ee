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
