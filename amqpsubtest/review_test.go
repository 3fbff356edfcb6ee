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
	"github.com/amqpsub/amqpsub/internal/lanes"
)

// Review: TestAdaptiveCreditALongCallDoesNotHideALaterStall with the
// long call as the first call of the lane that is free later. At 1983476
// a lane's first timed call sets its own mean uncapped, and the lanes'
// mean of means keeps minutes of it: the later stuck call on the other
// lane is not seen as stalled, what waits behind it takes the floor, and
// the free lane starves. At 8f824fe one mean capped it at four times the
// other lane's calls.
func TestReviewAdaptiveCreditALaneFirstLongCallDoesNotHideALaterStall(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		q := amqpsubtest.NewQueue(amqpsubtest.WithProfile(amqpsub.RabbitMQ4), amqpsubtest.WithQueueType(amqpsubtest.Classic))
		var on [2][]string // groups by lane
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
		q.Publish(amqpsubtest.Message(on[1][0], "long")) // lane 1's first call
		for i := range 100 {
			q.Publish(amqpsubtest.Message(on[i%2][i%50], fmt.Sprint(i)))
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
		t.Logf("the free lane handled %d of 1000 in 60 s; held %d, parked %d, credit %d", got, st.Held, st.Parked, st.Credit)
		if got < 200 {
			t.Errorf("the free lane handled %d of its 1000 in 60 s behind another lane's stuck call, after its own first call of 10 min (held %d, parked %d, credit %d)", got, st.Held, st.Parked, st.Credit)
		}
	})
}
