package integration

import (
	"context"
	"testing"
	"time"

	"github.com/amqpsub/amqpsub/amqpsub"
)

// 256 locks renewed in batches; one of them is lost, and the peer answers
// the batch that holds it each way a service could (410 or 400 for the
// whole request, or 200 with the other locks' expirations only). Only
// that lock is lost: the other 255 stay renewed, none expires. The test
// logs what the round cost: requests and tokens sent, and the time from
// the round's first request until the other 255 were renewed and until
// it ended.
func TestServiceBusMixedRenewBatchLosesOnlyTheLostLock(t *testing.T) {
	p := serviceBusPeer(t)
	for _, mode := range []string{"reject-all-410", "reject-all-400", "partial-200"} {
		t.Run(mode, func(t *testing.T) {
			t.Cleanup(func() { p.call(t, "POST", "/faults/renew-batch", map[string]any{"mode": "reject-all-410"}, nil) })
			const lock = 4 * time.Second
			q := p.entity(t, map[string]any{"lock_duration_ms": lock.Milliseconds(), "max_delivery_count": 100})
			p.call(t, "POST", "/messages", map[string]any{"entity": q, "count": 256, "message_id_prefix": "m"}, nil)
			gate := make(chan struct{})
			s, err := amqpsub.New(sbConnector(t, p), q, amqpsub.HandlerFunc(func(ctx context.Context, _ *amqpsub.Delivery) error {
				select {
				case <-gate:
				case <-ctx.Done():
				}
				return nil
			}), amqpsub.Credit(256), amqpsub.FixedCredit(), amqpsub.Workers(1), amqpsub.Logger(logger(t)))
			if err != nil {
				t.Fatal(err)
			}
			stop, wait := runSub(t, s)
			defer func() {
				close(gate)
				stop()
				if err := wait(); err != nil {
					t.Error(err)
				}
			}()
			waitFor(t, 30*time.Second, "256 locked", func() bool { return p.info(t, q).Locked == 256 })
			// A round renewing all 256 first, so that the next one holds
			// the lost lock with all the others.
			p.call(t, "POST", "/counters/reset", nil, nil)
			waitFor(t, 30*time.Second, "a round of 256", func() bool { return p.counters(t)["renew_lock_tokens"] >= 256 })
			time.Sleep(100 * time.Millisecond)
			p.call(t, "POST", "/counters/reset", nil, nil)
			var set struct{ Expired int }
			p.call(t, "POST", "/faults/renew-batch", map[string]any{"mode": mode, "expire_message_ids": []string{"m-100"}}, &set)
			if set.Expired != 1 {
				t.Fatalf("expired %d locks, want 1", set.Expired)
			}
			var first, others, done time.Time
			var c map[string]int
			deadline := time.Now().Add(30 * time.Second)
			for done.IsZero() && time.Now().Before(deadline) {
				c = p.counters(t)
				now := time.Now()
				if first.IsZero() && c["renew_lock_requests"] > 0 {
					first = now
				}
				if others.IsZero() && c["renew_lock_tokens"] >= 255 {
					others = now
				}
				// The split ends with the lost lock's own 410.
				if c["lock_lost_answers"]+c["renew_lock_failed_requests"] > 0 && c["renew_lock_requests"] >= 257 {
					done = now
				}
				time.Sleep(2 * time.Millisecond)
			}
			if done.IsZero() {
				t.Fatalf("the round did not end: counters %v", c)
			}
			t.Logf("%s: the round's first request to the other 255 renewed: %v; to the round's end: %v; %d requests, %d tokens sent, %d renewed",
				mode, others.Sub(first).Round(time.Millisecond), done.Sub(first).Round(time.Millisecond),
				c["renew_lock_requests"], c["renew_lock_tokens_asked"], c["renew_lock_tokens"])
			// Two more lock durations: no other lock expires.
			time.Sleep(2 * lock)
			c = p.counters(t)
			st := s.Stats()
			if c["lock_expirations"] != 1 || st.Locks.Lost != 1 {
				t.Fatalf("%d locks expired on the peer (want only the one made to), %d lost in amqpsub (want 1); counters %v",
					c["lock_expirations"], st.Locks.Lost, c)
			}
		})
	}
}
