package sbconformance

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/Azure/azure-sdk-for-go/sdk/messaging/azservicebus"
)

// TestDeadLetterQueueManagement: azservicebus reads a dead-letter queue, a
// queue's and a subscription's, in peek-lock as an entity of its own: it
// claims <entity>/$DeadLetterQueue and <entity>/$DeadLetterQueue/$management
// and attaches its $management pair to the latter (receiver.go builds the
// path, internal/amqpLinks.go appends /$management to it for the node and
// both claims). On that node it renews a lock (RenewMessageLock) and, once
// its receive link is detached, completes the message by lock token
// (update-disposition). The parent's node does not know the dead-letter
// queue's locks: a renewal of one sent there, by the parent's receiver, is
// refused with 410 (CodeLockLost).
func TestDeadLetterQueueManagement(t *testing.T) {
	p := needPeer(t)
	type receiverFor func(c *azservicebus.Client, o *azservicebus.ReceiverOptions) (*azservicebus.Receiver, error)
	for _, kind := range []string{"queue", "subscription"} {
		t.Run(kind, func(t *testing.T) {
			var entity, sendTo string
			var newReceiver receiverFor
			if kind == "queue" {
				entity = p.entity(t, map[string]any{"lock_duration_ms": 5000})
				sendTo = entity
				newReceiver = func(c *azservicebus.Client, o *azservicebus.ReceiverOptions) (*azservicebus.Receiver, error) {
					return c.NewReceiverForQueue(entity, o)
				}
			} else {
				sendTo = p.entity(t, map[string]any{"kind": "topic"})
				entity = sendTo + "/Subscriptions/dlq"
				p.must(t, "POST", "/entities", map[string]any{"name": entity, "lock_duration_ms": 5000}, nil)
				newReceiver = func(c *azservicebus.Client, o *azservicebus.ReceiverOptions) (*azservicebus.Receiver, error) {
					return c.NewReceiverForSubscription(sendTo, "dlq", o)
				}
			}
			dlqPath := entity + "/$DeadLetterQueue"
			c := newClient(t, p.conn)
			send(t, c, sendTo, textMsg("dl-"+kind, "x"))
			r, err := newReceiver(c, nil)
			if err != nil {
				t.Fatal(err)
			}
			defer r.Close(context.Background())
			ctx := ctxFor(t, 20*time.Second)
			if err := r.DeadLetterMessage(ctx, receiveN(t, r, 1, 10*time.Second)[0], nil); err != nil {
				t.Fatalf("DeadLetterMessage: %v", err)
			}
			dlq, err := newReceiver(c, &azservicebus.ReceiverOptions{SubQueue: azservicebus.SubQueueDeadLetter})
			if err != nil {
				t.Fatal(err)
			}
			defer dlq.Close(context.Background())
			d := receiveN(t, dlq, 1, 10*time.Second)[0]
			before := p.counters(t)
			old := *d.LockedUntil
			time.Sleep(10 * time.Millisecond) // a renewal that moves the lock by the peer's clock, in ms
			if err := dlq.RenewMessageLock(ctx, d, nil); err != nil {
				t.Fatalf("RenewMessageLock on the dead-letter queue: %v", err)
			}
			if !d.LockedUntil.After(old) {
				t.Errorf("renewal did not move LockedUntil: %v -> %v", old, *d.LockedUntil)
			}
			checkDeadLetterNode(t, p, dlqPath)

			// The same lock, renewed through the parent's $management node.
			if err := r.RenewMessageLock(ctx, d, nil); sbCode(err) != azservicebus.CodeLockLost {
				t.Fatalf("renewal of a dead-letter lock at the parent's node: %v (code %q), want CodeLockLost", err, sbCode(err))
			}

			p.detach(t, dlqPath, 1)
			if err := dlq.CompleteMessage(ctx, d, nil); err != nil {
				t.Fatalf("complete after the detach: %v", err)
			}
			grew(t, before, p.counters(t), map[string]int{
				"renew_lock_tokens":            1,
				"renew_lock_failed_requests":   1,
				"update_disposition_requests":  1,
				"update_disposition_tokens":    1,
				"update_disposition_lock_lost": 0,
				"completed":                    1,
				"redeliveries":                 0,
			})
			if e := p.info(t, dlqPath); e.Available != 0 || e.Locked != 0 {
				t.Fatalf("the dead-letter queue after the complete: %+v", e)
			}
		})
	}
}

// checkDeadLetterNode checks that a connection of the peer holds claims for
// the dead-letter queue at dlqPath and for its $management node, and a
// $management link pair attached to the latter.
func checkDeadLetterNode(t *testing.T, p *peer, dlqPath string) {
	t.Helper()
	var out struct {
		Connections []struct {
			Claims map[string]float64 `json:"claims"`
			Links  []struct {
				Address string `json:"address"`
				Node    string `json:"node"`
				Role    string `json:"role"`
			} `json:"links"`
		} `json:"connections"`
	}
	p.must(t, "GET", "/connections", nil, &out)
	node := strings.ToLower(dlqPath + "/$management")
	for _, c := range out.Connections {
		_, entityClaim := c.Claims[strings.ToLower(dlqPath)]
		_, nodeClaim := c.Claims[node]
		roles := map[string]bool{}
		for _, l := range c.Links {
			if l.Node == "mgmt" && strings.ToLower(l.Address) == node {
				roles[l.Role] = true
			}
		}
		if entityClaim && nodeClaim && roles["sender"] && roles["receiver"] {
			return
		}
	}
	t.Fatalf("no connection claims %s and its $management node and has a link pair to the node: %+v", dlqPath, out.Connections)
}
