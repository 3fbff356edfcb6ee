package rabbitmq4

import (
	"testing"

	"github.com/Azure/go-amqp"
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
		if got := address(q); got != want {
			t.Errorf("address(%q) = %q, want %q", q, got, want)
		}
	}
}

func TestParseRabbitQueue(t *testing.T) {
	answer := func(id, code string, v any) *amqp.Message {
		return &amqp.Message{Properties: &amqp.MessageProperties{CorrelationID: id, Subject: &code}, Value: v}
	}
	q, err := parseQueue(answer("1", "200", map[string]any{
		"type": "quorum", "arguments": map[string]any{"x-delivery-limit": int64(7), "x-queue-type": "quorum"},
	}), "1")
	if err != nil || q != (queueInfo{typ: "quorum", limit: 7}) {
		t.Fatalf("quorum answer read as %+v, %v", q, err)
	}
	q, err = parseQueue(answer("1", "200", map[string]any{"type": "classic", "arguments": map[string]any{}}), "1")
	if err != nil || q != (queueInfo{typ: "classic"}) {
		t.Fatalf("classic answer read as %+v, %v", q, err)
	}
	for name, m := range map[string]*amqp.Message{
		"another request's answer": answer("2", "200", map[string]any{"type": "quorum"}),
		"not found":                answer("1", "404", "not found"),
		"no map":                   answer("1", "200", "quorum"),
		"no properties":            {Value: map[string]any{"type": "quorum"}},
	} {
		if q, err := parseQueue(m, "1"); err == nil {
			t.Errorf("%s: read as %+v, want an error", name, q)
		}
	}
}
