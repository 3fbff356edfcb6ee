package integration

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/amqpsub/amqpsub/amqpsub"
)

// MaxMessageSize on Service Bus dead-letters through
// com.microsoft:dead-letter: the message in the dead-letter sub-queue
// carries amqpsub's DeadLetterReason and DeadLetterErrorDescription.
func TestServiceBusMaxMessageSizeDeadLettersWithAReason(t *testing.T) {
	p := serviceBusPeer(t)
	q := p.entity(t, map[string]any{"lock_duration_ms": 5000})
	p.call(t, "POST", "/messages", map[string]any{"entity": q, "messages": []map[string]any{
		{"message_id": "big", "body": strings.Repeat("x", 2000)},
		{"message_id": "small", "body": "ok"},
	}}, nil)
	var handled sync.Map
	s, err := amqpsub.New(sbConnector(t, p), q, amqpsub.HandlerFunc(func(_ context.Context, d *amqpsub.Delivery) error {
		handled.Store(fmt.Sprint(d.MessageID()), true)
		return nil
	}), amqpsub.MaxMessageSize(1000), amqpsub.Logger(logger(t)))
	if err != nil {
		t.Fatal(err)
	}
	stop, wait := runSub(t, s)
	waitFor(t, 30*time.Second, "1 dead letter and 1 handled", func() bool {
		_, ok := handled.Load("small")
		return ok && p.info(t, q).DeadLetter == 1
	})
	stop()
	if err := wait(); err != nil {
		t.Fatal(err)
	}
	if _, ok := handled.Load("big"); ok {
		t.Fatal("the oversized message reached the handler")
	}
	dead := p.messages(t, q+"/$DeadLetterQueue")
	if len(dead) != 1 || dead[0].MessageID != "big" {
		t.Fatalf("dead letters %+v", dead)
	}
	reason, desc := dead[0].AppProps["DeadLetterReason"], dead[0].AppProps["DeadLetterErrorDescription"]
	t.Logf("dead-lettered with reason %v, description %v", reason, desc)
	if reason != "MaxMessageSizeExceeded" || !strings.Contains(fmt.Sprint(desc), "2000 bytes") {
		t.Fatalf("dead-lettered with reason %v, description %v", reason, desc)
	}
	if st := s.Stats(); st.Results.Oversize != 1 {
		t.Fatalf("Oversize = %d, want 1", st.Results.Oversize)
	}
}

// MaxDeliveryCount(n) on Service Bus handles the n-th delivery and
// dead-letters the next, as an entity's MaxDeliveryCount of n does: here
// the entity's limit is far above, so only amqpsub's acts.
func TestServiceBusMaxDeliveryCountHandlesTheNthDelivery(t *testing.T) {
	p := serviceBusPeer(t)
	q := p.entity(t, map[string]any{"lock_duration_ms": 5000, "max_delivery_count": 50})
	p.send(t, q, 1)
	var calls atomic.Int32
	s, err := amqpsub.New(sbConnector(t, p), q, amqpsub.HandlerFunc(func(context.Context, *amqpsub.Delivery) error {
		calls.Add(1)
		return amqpsub.Retry(errors.New("store down"))
	}), amqpsub.MaxDeliveryCount(3), amqpsub.Logger(logger(t)))
	if err != nil {
		t.Fatal(err)
	}
	stop, wait := runSub(t, s)
	waitFor(t, 30*time.Second, "1 dead letter", func() bool { return p.info(t, q).DeadLetter == 1 })
	stop()
	if err := wait(); err != nil {
		t.Fatal(err)
	}
	dead := p.messages(t, q+"/$DeadLetterQueue")
	if len(dead) != 1 {
		t.Fatalf("dead letters %+v", dead)
	}
	t.Logf("handler calls %d; dead letter: delivery count %d, reason %v", calls.Load(), dead[0].DeliveryCount, dead[0].AppProps["DeadLetterReason"])
	if calls.Load() != 3 || dead[0].AppProps["DeadLetterReason"] != "MaxDeliveryCountExceeded" {
		t.Fatalf("handler called %d times (want 3); dead letter %+v", calls.Load(), dead[0])
	}
}
