package integration

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/Azure/go-amqp"
)

// TestRabbitMQ4Smoke checks the RabbitMQ 4 broker of integration/rabbitmq4.sh
// and its declare command end to end, with plain go-amqp links on the
// broker's v2 addresses (/queues/NAME): for a classic and a quorum queue,
// 100 messages sent arrive once each, and a rejected one is dead-lettered
// to NAME.dlq.
func TestRabbitMQ4Smoke(t *testing.T) {
	u := rabbit4URL(t)
	for _, kind := range []string{"classic", "quorum"} {
		t.Run(kind, func(t *testing.T) {
			q := declareRabbit4(t, kind)
			conn := dialPlain(t, u)
			addr := "/queues/" + q
			s := rawSender(t, conn, addr)

			const n = 100
			want := make(map[string]bool, n)
			for i := range n {
				body := fmt.Sprintf("%s-%03d", kind, i)
				want[body] = true
				sendBody(t, s, body)
			}
			r := rawReceiver(t, conn, addr, n)
			got := receiveN(t, r, n, 30*time.Second)
			seen := make(map[string]bool, len(got))
			for _, m := range got {
				b := string(m.GetData())
				if !want[b] {
					t.Errorf("unexpected body %q", b)
				}
				if seen[b] {
					t.Errorf("body %q received twice", b)
				}
				seen[b] = true
			}
			if len(got) != n || len(seen) != n {
				t.Fatalf("received %d messages, %d distinct; want %d", len(got), len(seen), n)
			}

			sendBody(t, s, "reject-me")
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			m, err := r.Receive(ctx, nil)
			if err != nil {
				t.Fatalf("receive the message to reject: %v", err)
			}
			if b := string(m.GetData()); b != "reject-me" {
				t.Fatalf("received %q, want reject-me", b)
			}
			if err := r.RejectMessage(ctx, m, &amqp.Error{Condition: "amqpsub:smoke", Description: "rejected by the smoke test"}); err != nil {
				t.Fatalf("reject: %v", err)
			}
			waitFor(t, 30*time.Second, "the rejected message in "+q+".dlq", func() bool {
				return rabbit4Count(t, q+".dlq") == 1
			})
			if c := rabbit4Count(t, q); c != 0 {
				t.Errorf("%d messages ready in %s after the reject, want 0", c, q)
			}
			dl := receiveN(t, rawReceiver(t, conn, "/queues/"+q+".dlq", 1), 1, 30*time.Second)
			if len(dl) != 1 || string(dl[0].GetData()) != "reject-me" {
				t.Fatalf("from %s.dlq: %d messages, want the rejected one", q, len(dl))
			}
		})
	}
}
