package amqpsub

import (
	"strings"
	"testing"
	"time"

	"github.com/Azure/go-amqp"
)

// The copy DeadLetterCopy sends: every section but the TTL and the expiry,
// what Artemis adds to a dead letter itself, the reason, and a duplicate
// id that tells apart a message dead-lettered again after a retry from the
// dead-letter queue.
func TestDeadLetterCopyOfAMessage(t *testing.T) {
	id := "m-1"
	exp := time.Now().Add(time.Hour)
	m := &amqp.Message{
		Header:                &amqp.MessageHeader{Durable: true, TTL: time.Minute, DeliveryCount: 3},
		Properties:            &amqp.MessageProperties{MessageID: id, AbsoluteExpiryTime: &exp},
		Annotations:           amqp.Annotations{"x-opt-jms-msg-type": int8(5)},
		ApplicationProperties: map[string]any{"seq": int64(7)},
		Data:                  [][]byte{[]byte("body")},
		Footer:                amqp.Annotations{"f": "v"},
	}
	c := deadLetterCopy(m, "orders", "orders", &OutcomeError{reason: "bad", description: "no customer"})
	if c.Header.TTL != 0 || !c.Header.Durable || c.Properties.AbsoluteExpiryTime != nil || c.Properties.MessageID != id {
		t.Fatalf("header %+v properties %+v", c.Header, c.Properties)
	}
	if m.Header.TTL != time.Minute || m.Properties.AbsoluteExpiryTime == nil {
		t.Fatal("the original was changed")
	}
	ap := c.ApplicationProperties
	if ap["seq"] != int64(7) || ap["_AMQ_ORIG_ADDRESS"] != "orders" || ap["_AMQ_ORIG_QUEUE"] != "orders" ||
		ap["DeadLetterReason"] != "bad" || ap["DeadLetterErrorDescription"] != "no customer" ||
		!strings.HasPrefix(ap["_AMQ_DUPL_ID"].(string), "amqpsub-dlq:orders:m-1:") {
		t.Fatalf("application properties %v", ap)
	}
	// The same message again (a redelivery) gets the same id; another
	// message with the same message-id, another.
	if again := deadLetterCopy(m, "orders", "orders", &OutcomeError{reason: "bad"}); again.ApplicationProperties["_AMQ_DUPL_ID"] != ap["_AMQ_DUPL_ID"] {
		t.Fatalf("a redelivery's copy has id %v, the first %v", again.ApplicationProperties["_AMQ_DUPL_ID"], ap["_AMQ_DUPL_ID"])
	}
	other := *m
	other.Data = [][]byte{[]byte("another body")}
	if o := deadLetterCopy(&other, "orders", "orders", &OutcomeError{reason: "bad"}); o.ApplicationProperties["_AMQ_DUPL_ID"] == ap["_AMQ_DUPL_ID"] {
		t.Fatal("two messages sharing a message-id share a duplicate id: the second copy would be dropped")
	}
	// Retried from the DLQ: it carries its first copy's id; its second copy
	// must not be taken for the first.
	retried := *c
	if r := deadLetterCopy(&retried, "orders", "orders", &OutcomeError{reason: "bad"}); r.ApplicationProperties["_AMQ_DUPL_ID"] == ap["_AMQ_DUPL_ID"] {
		t.Fatal("a copy retried from the DLQ gets its first copy's id again")
	}
	if c.Annotations["x-opt-ORIG-QUEUE"] != "orders" || c.Annotations["x-opt-ORIG-ADDRESS"] != "orders" || c.Annotations["x-opt-jms-msg-type"] != int8(5) {
		t.Fatalf("annotations %v", c.Annotations)
	}
	if string(c.Data[0]) != "body" || c.Footer["f"] != "v" {
		t.Fatal("body or footer lost")
	}
	m.Annotations["x-opt-ORIG-MESSAGE-ID"] = int64(593)
	if c := deadLetterCopy(m, "orders", "orders", &OutcomeError{reason: "bad"}); c.ApplicationProperties["_AMQ_DUPL_ID"] == ap["_AMQ_DUPL_ID"] {
		t.Fatalf("duplicate id after a retry from the DLQ: %v", c.ApplicationProperties["_AMQ_DUPL_ID"])
	}
}
