package amqpsub

import (
	"testing"

	"github.com/Azure/go-amqp"

	"github.com/amqpsub/amqpsub/internal/driver"
	"github.com/amqpsub/amqpsub/internal/driver/rabbitmq4"
)

// A Reject on a quorum queue keeps its reason, description and condition
// in annotations whose keys all start with x- (RabbitMQ ends the session
// on any other).
func TestQuorumRejectKeepsTheReason(t *testing.T) {
	e := (&OutcomeError{kind: ResultReject, reason: "bad total", description: "line 3"}).rejectError(RejectCondition)
	o := rabbitmq4.QuorumReject(e)
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
	if o := rabbitmq4.QuorumReject(nil); len(o.Annotations) != 0 || !o.UndeliverableHere {
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
