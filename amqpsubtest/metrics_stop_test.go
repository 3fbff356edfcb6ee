package amqpsubtest_test

import (
	"context"
	"testing"

	"github.com/amqpsub/amqpsub/amqpsub"
	"github.com/amqpsub/amqpsub/amqpsubtest"
)

// After a stop that cuts handlers short (GracePeriod(0)), the deliveries
// still held when Run returns reach the Recorder as dropped, so that
// received = settled + dropped, as Recorder.Dropped says. (Found by an
// outside review.)
func TestRecorderCountsAfterAStopWithoutGrace(t *testing.T) {
	q := amqpsubtest.NewQueue()
	for range 4 {
		q.Publish(amqpsubtest.Message("", "x"))
	}
	rec := &countRec{}
	began := make(chan struct{}, 4)
	h := amqpsub.HandlerFunc(func(ctx context.Context, _ *amqpsub.Delivery) error {
		began <- struct{}{}
		<-ctx.Done()
		return ctx.Err()
	})
	sub, err := amqpsub.New(q.Connector(), "orders", h, amqpsub.WithMetrics(rec), amqpsub.Workers(2), amqpsub.GracePeriod(0))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(t.Context())
	errc := make(chan error, 1)
	go func() { errc <- sub.Run(ctx) }()
	<-began
	<-began
	cancel()
	if err := <-errc; err != nil {
		t.Fatal(err)
	}
	st := sub.Stats()
	rec.mu.Lock()
	defer rec.mu.Unlock()
	t.Logf("Recorder: received %d settled %d dropped %d; Stats: received %d held %d", rec.received, rec.settled, rec.dropped, st.Received, st.Held)
	if rec.received != rec.settled+rec.dropped {
		t.Errorf("after a stop the Recorder heard %d received, %d settled, %d dropped: %d deliveries unaccounted for",
			rec.received, rec.settled, rec.dropped, rec.received-rec.settled-rec.dropped)
	}
}
