package integration

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/amqpsub/amqpsub/amqpsub"
)

// A dead-letter queue is read as an entity of its own: its locks are
// renewed, and settled by lock token, on its own $management node
// (<entity>/$DeadLetterQueue/$management), which the peer alone knows them
// at. Handlers of 3 s on 2 s locks, a queue's dead-letter queue and a
// subscription's, and one whose receive link the peer detaches while the
// handlers run: every message is handled once and finished, its lock
// renewed, none lost, and after the detach each is settled by lock token.
// The claims are the dead-letter queue's own.
func TestServiceBusDeadLetterQueueLocksAreRenewed(t *testing.T) {
	t.Parallel() // its entities and counters are its own
	p := serviceBusPeer(t)
	for _, row := range []struct {
		name         string
		subscription bool
		detach       bool
	}{
		{"queue", false, false},
		{"subscription", true, false},
		{"queue after a forced detach", false, true},
	} {
		t.Run(row.name, func(t *testing.T) {
			t.Parallel()
			const lock = 2 * time.Second
			spec := map[string]any{"lock_duration_ms": lock.Milliseconds(), "max_delivery_count": 10}
			var entity, sendTo string
			if row.subscription {
				sendTo = strings.ToLower(queueName(t))
				p.call(t, "POST", "/entities", map[string]any{"name": sendTo, "kind": "topic"}, nil)
				entity = sendTo + "/Subscriptions/sub"
				spec["name"] = entity
				p.call(t, "POST", "/entities", spec, nil)
			} else {
				entity = p.entity(t, spec)
				sendTo = entity
			}
			const n = 6
			deadLetter(t, p, sendTo, entity, n)
			dlq := entity + "/$DeadLetterQueue"

			var mu sync.Mutex
			calls := map[string]int{}
			finished := map[string]bool{}
			running := 0
			allRunning := make(chan struct{})
			s, err := amqpsub.New(sbConnector(t, p), dlq, amqpsub.HandlerFunc(func(ctx context.Context, d *amqpsub.Delivery) error {
				id := fmt.Sprint(d.MessageID())
				mu.Lock()
				calls[id]++
				if running++; running == n {
					close(allRunning)
				}
				mu.Unlock()
				select {
				case <-time.After(lock + lock/2):
				case <-ctx.Done():
					return context.Cause(ctx)
				}
				mu.Lock()
				finished[id] = true
				mu.Unlock()
				return nil
			}), amqpsub.Workers(n), amqpsub.Backoff(50*time.Millisecond, 200*time.Millisecond), amqpsub.Logger(logger(t)))
			if err != nil {
				t.Fatal(err)
			}
			stop, wait := runSub(t, s)
			select {
			case <-allRunning:
			case <-time.After(30 * time.Second):
				t.Fatal("the handlers did not all start")
			}
			claimsDeadLetterQueue(t, p, dlq)
			if row.detach {
				var out struct{ Detached int }
				p.call(t, "POST", "/faults/detach", map[string]any{"entity": dlq}, &out)
				if out.Detached != 1 {
					t.Fatalf("detached %d links, want 1", out.Detached)
				}
			}
			waitFor(t, 30*time.Second, "the dead letters completed", func() bool {
				e := p.info(t, dlq)
				return e.Stats["completed"] == n && e.Available == 0 && e.Locked == 0
			})
			stop()
			if err := wait(); err != nil {
				t.Fatal(err)
			}
			st := s.Stats()
			e := p.info(t, dlq)
			mu.Lock()
			defer mu.Unlock()
			t.Logf("handler calls %v; locks %+v; dead-letter queue %+v", calls, st.Locks, e)
			if len(calls) != n || len(finished) != n {
				t.Fatalf("%d messages handled, %d finished, want %d", len(calls), len(finished), n)
			}
			for id, c := range calls {
				if c != 1 {
					t.Fatalf("%s handled %d times, want once", id, c)
				}
			}
			if st.Locks.Renewed == 0 || st.Locks.Lost != 0 || e.Stats["lock_expired"] != 0 {
				t.Fatalf("locks renewed %d, lost %d, expired on the peer %d: want renewed, none lost",
					st.Locks.Renewed, st.Locks.Lost, e.Stats["lock_expired"])
			}
			if row.detach && st.Locks.SettledByToken != n {
				t.Fatalf("settled by lock token %d, want all %d (their link was detached)", st.Locks.SettledByToken, n)
			}
		})
	}
}

// claimsDeadLetterQueue checks that a connection of the peer holds claims
// for the dead-letter queue dlq and for its own $management node, as
// azservicebus puts them (internal/amqpLinks.go).
func claimsDeadLetterQueue(t *testing.T, p *sbPeer, dlq string) {
	t.Helper()
	var out struct {
		Connections []struct {
			Claims map[string]float64 `json:"claims"`
		} `json:"connections"`
	}
	p.call(t, "GET", "/connections", nil, &out)
	for _, c := range out.Connections {
		_, entity := c.Claims[strings.ToLower(dlq)]
		_, node := c.Claims[strings.ToLower(dlq+"/$management")]
		if entity && node {
			return
		}
	}
	t.Fatalf("no connection claims %s and %s/$management: %+v", dlq, dlq, out.Connections)
}

// deadLetter sends n messages to sendTo and dead-letters them from entity
// (sendTo, or a subscription of it).
func deadLetter(t *testing.T, p *sbPeer, sendTo, entity string, n int) {
	t.Helper()
	p.call(t, "POST", "/messages", map[string]any{"entity": sendTo, "count": n, "message_id_prefix": "m"}, nil)
	s, err := amqpsub.New(sbConnector(t, p), entity, amqpsub.HandlerFunc(func(context.Context, *amqpsub.Delivery) error {
		return amqpsub.RejectWith("poison", "sent to the dead-letter queue by the test")
	}), amqpsub.Logger(logger(t)))
	if err != nil {
		t.Fatal(err)
	}
	stop, wait := runSub(t, s)
	waitFor(t, 30*time.Second, "the messages dead-lettered", func() bool { return p.info(t, entity).DeadLetter == n })
	stop()
	if err := wait(); err != nil {
		t.Fatal(err)
	}
}
