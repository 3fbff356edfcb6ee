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
	"github.com/amqpsub/amqpsub/lanes"
)

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
