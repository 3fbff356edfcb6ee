package amqpsubtest_test

import (
	"context"
	"fmt"
	"testing"
	"testing/synctest"
	"time"

	"github.com/Azure/go-amqp"

	"github.com/amqpsub/amqpsub/amqpsub"
	"github.com/amqpsub/amqpsub/amqpsubtest"
)

// A graceful stop while the link is down (the broker went away and every
// reconnect is refused) returns at once on either queue type: there is
// nothing buffered to finish, and no link to finish it on.
func TestRabbitMQ4ShutdownDuringOutageIsQuick(t *testing.T) {
	for _, typ := range []amqpsubtest.QueueType{amqpsubtest.Classic, amqpsubtest.Quorum} {
		t.Run(typ.String(), func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				q := rabbit4Queue(amqpsubtest.WithQueueType(typ))
				q.Publish(amqpsubtest.Message("", "a"))
				sub := rabbit4Sub(t, q, func(context.Context, *amqpsub.Delivery) error { return nil })
				ran := make(chan error, 1)
				go func() { ran <- sub.Run(context.Background()) }()
				if err := q.Wait(t.Context()); err != nil {
					t.Fatal(err)
				}
				q.RefuseAttach(&amqp.ConnError{}) // not fatal: retried with backoff
				q.LoseLinks(nil)
				time.Sleep(time.Second)
				began := time.Now()
				if err := sub.Shutdown(t.Context()); err != nil {
					t.Fatal(err)
				}
				err := <-ran
				if took := time.Since(began); took > time.Second {
					t.Errorf("%s queue: Shutdown with no link took %v (Run = %v); want it at once", typ, took, err)
				}
			})
		})
	}
}

// A batch consumer whose BatchWait is longer than half the grace period: at
// a graceful stop on a quorum queue nothing more comes (Hold), so the open
// batch is handed over at once rather than wait for its BatchWait and be
// released, every one of its deliveries a counted return.
func TestRabbitMQ4StopHandsOverTheOpenBatch(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		q := rabbit4Queue()
		for i := range 5 {
			q.Publish(amqpsubtest.Message("", fmt.Sprint(i)))
		}
		handled := 0
		sub, err := amqpsub.NewBatch(q.Connector(), "orders", amqpsub.BatchHandlerFunc(func(_ context.Context, b []*amqpsub.Delivery) []error {
			handled += len(b)
			return make([]error, len(b))
		}), amqpsub.WithProfile(amqpsub.RabbitMQ4), amqpsub.Batch(100, 20*time.Second), amqpsub.GracePeriod(30*time.Second))
		if err != nil {
			t.Fatal(err)
		}
		stop := start(sub)
		time.Sleep(time.Second) // 5 wait in the open batch
		if err := stop(); err != nil {
			t.Fatal(err)
		}
		st := sub.Stats()
		if handled != 5 || st.Settled.Released != 0 {
			t.Errorf("%d handled, %d released (%s); want the open batch handled at the stop rather than released", handled, st.Settled.Released, history(q.Records()))
		}
	})
}
