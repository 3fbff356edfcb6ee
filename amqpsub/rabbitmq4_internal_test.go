package amqpsub

import (
	"testing"

	"github.com/Azure/go-amqp"

	"github.com/amqpsub/amqpsub/internal/driver"
)

func TestRabbit4Address(t *testing.T) {
	for q, want := range map[string]string{
		"orders":            "/queues/orders",
		"a.b-c_d~e":         "/queues/a.b-c_d~e",
		"a b/c?d#e%f":       "/queues/a%20b%2Fc%3Fd%23e%25f",
		"ümlaut":            "/queues/%C3%BCmlaut",
		"x:y@z+&=$!*'(),;":  "/queues/x%3Ay%40z%2B%26%3D%24%21%2A%27%28%29%2C%3B",
		"/queues/as%20sent": "/queues/as%20sent",
		"/amq/queue/q":      "/queues/%2Famq%2Fqueue%2Fq",
		"":                  "/queues/",
	} {
		if got := rabbit4Address(q); got != want {
			t.Errorf("rabbit4Address(%q) = %q, want %q", q, got, want)
		}
	}
}

func TestParseRabbitQueue(t *testing.T) {
	answer := func(id, code string, v any) *amqp.Message {
		return &amqp.Message{Properties: &amqp.MessageProperties{CorrelationID: id, Subject: &code}, Value: v}
	}
	q, err := parseRabbitQueue(answer("1", "200", map[string]any{
		"type": "quorum", "arguments": map[string]any{"x-delivery-limit": int64(7), "x-queue-type": "quorum"},
	}), "1")
	if err != nil || q != (rabbitQueue{typ: "quorum", limit: 7}) {
		t.Fatalf("quorum answer read as %+v, %v", q, err)
	}
	q, err = parseRabbitQueue(answer("1", "200", map[string]any{"type": "classic", "arguments": map[string]any{}}), "1")
	if err != nil || q != (rabbitQueue{typ: "classic"}) {
		t.Fatalf("classic answer read as %+v, %v", q, err)
	}
	for name, m := range map[string]*amqp.Message{
		"another request's answer": answer("2", "200", map[string]any{"type": "quorum"}),
		"not found":                answer("1", "404", "not found"),
		"no map":                   answer("1", "200", "quorum"),
		"no properties":            {Value: map[string]any{"type": "quorum"}},
	} {
		if q, err := parseRabbitQueue(m, "1"); err == nil {
			t.Errorf("%s: read as %+v, want an error", name, q)
		}
	}
}

// A Reject on a quorum queue keeps its reason, description and condition
// in annotations whose keys all start with x- (RabbitMQ ends the session
// on any other).
func TestQuorumRejectKeepsTheReason(t *testing.T) {
	e := (&OutcomeError{kind: ResultReject, reason: "bad total", description: "line 3"}).rejectError(RejectCondition)
	o := quorumReject(e)
	if o.Kind != driver.Modify || !o.DeliveryFailed || !o.UndeliverableHere {
		t.Fatalf("outcome %+v, want modified{delivery-failed, undeliverable-here}", o)
	}
	want := amqp.Annotations{
		AnnotationDeadLetterReason:      "bad total",
		AnnotationDeadLetterDescription: "line 3",
		AnnotationDeadLetterCondition:   string(RejectCondition),
	}
	if len(o.Annotations) != len(want) {
		t.Fatalf("annotations %v, want %v", o.Annotations, want)
	}
	for k, v := range want {
		if o.Annotations[k] != v {
			t.Errorf("annotation %v = %v, want %v", k, o.Annotations[k], v)
		}
		if k.(string)[:2] != "x-" {
			t.Errorf("annotation key %v does not start with x-", k)
		}
	}
	if o := quorumReject(nil); len(o.Annotations) != 0 || !o.UndeliverableHere {
		t.Fatalf("a Reject without an error: %+v", o)
	}
}

func TestProfileFor(t *testing.T) {
	for _, tc := range []struct{ product, version, want string }{
		{"RabbitMQ", "4.0.5", "rabbitmq4"},
		{"RabbitMQ", "4.1.0-rc.1", "rabbitmq4"},
		{"RabbitMQ", "10.0.0", "rabbitmq4"},
		{"RabbitMQ", "3.10.8", "rabbitmq3"},
		{"RabbitMQ", "", "rabbitmq3"},
		{"apache-activemq-artemis", "2.40.0", "artemis"},
		{"ActiveMQ Artemis", "2.40.0", "artemis"},
		{"", "", ""},
		{"qpid-dispatch-router", "1.19", ""},
	} {
		if got := profileFor(tc.product, tc.version); got != tc.want {
			t.Errorf("profileFor(%q, %q) = %q, want %q", tc.product, tc.version, got, tc.want)
		}
	}
}
