//go:build unix

package artemistest_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/Azure/go-amqp"

	"github.com/amqpsub/amqpsub/amqpsub"
	"github.com/amqpsub/amqpsub/artemistest"
	"github.com/amqpsub/amqpsub/examples/producer"
)

// On a fresh broker, with the dead-letter queue declared ahead
// (WithDeadLetterQueues), DeadLetterCopy keeps the reason of every
// rejection, the first ones too, though 16 lanes reject at once: Publish
// puts 400 messages on the queue, 20 of them malformed; the subscriber
// rejects those 20, and Receive finds all 20 on the dead-letter queue,
// each with its reason.
func TestDeadLetterQueuesKeepEveryReason(t *testing.T) {
	b := artemistest.Start(t, artemistest.WithMode(artemistest.Local),
		artemistest.WithQueues("shipments"), artemistest.WithDeadLetterQueues("shipments"))
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	const n, bad = 400, 20
	err := b.Publish(ctx, "shipments", n, func(i int) *amqp.Message {
		body := fmt.Appendf(nil, `{"n":%d}`, i)
		if i%(n/bad) == 0 {
			body = []byte("{malformed")
		}
		return producer.NewMessage(fmt.Sprintf("shipment-%d", i), fmt.Sprintf("s%02d", i%40), body)
	})
	if err != nil {
		t.Fatal(err)
	}
	h := amqpsub.HandlerFunc(func(_ context.Context, d *amqpsub.Delivery) error {
		if body, _ := d.Body(); strings.HasPrefix(string(body), "{malformed") {
			return amqpsub.Reject("malformed JSON")
		}
		return nil
	})
	s, err := amqpsub.New(amqpsub.Dial(b.URL(), nil), "shipments", h, amqpsub.WorkersByKey(16),
		amqpsub.DeadLetterCopy("DLQ::DLQ.{queue}"))
	if err != nil {
		t.Fatal(err)
	}
	rctx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- s.Run(rctx) }()
	dead, err := b.Receive(ctx, "DLQ::DLQ.shipments", bad)
	if err != nil {
		t.Fatal(err)
	}
	for s.Stats().Settled.Accepted < n {
		select {
		case <-ctx.Done():
			t.Fatalf("stats %v", s.Stats())
		case <-time.After(10 * time.Millisecond):
		}
	}
	stop()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	st := s.Stats()
	if st.DeadLetterCopies != bad || st.DeadLetterCopyFailures != 0 || st.Settled.Accepted != n {
		t.Fatalf("copies %d, failures %d, accepted %d; want %d, 0, %d", st.DeadLetterCopies, st.DeadLetterCopyFailures,
			st.Settled.Accepted, bad, n)
	}
	for _, m := range dead {
		if r, _ := m.ApplicationProperties["DeadLetterReason"].(string); r != "malformed JSON" {
			t.Errorf("dead letter %v has reason %q", m.Properties.MessageID, r)
		}
	}
}
