package integration

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/amqpsub/amqpsub/amqpsub"
	"github.com/amqpsub/amqpsub/internal/shapes"
)

// The peer answers the first link dispositions of an entity as busy
// (com.microsoft:server-busy) or timed out (com.microsoft:timeout); go-amqp
// takes either answer as the delivery's settlement, so a settlement sent
// again on the link would write nothing. Each of those settlements goes
// out again by lock token (update-disposition), once, keeping its outcome:
// none is redelivered, none expires, and Stats count them. Timed-out
// answers in each lane mode of shapes.Lanes with a Handler (under
// WorkersByKey the settlements of a group go out one after the other, a
// resend included; a BatchHandler's settle through the same path).
func TestServiceBusSettlementAnsweredBusyIsSentByLockToken(t *testing.T) {
	t.Parallel() // its entities, faults and counters are its own
	p := serviceBusPeer(t)
	type row struct {
		mode   string
		lane   shapes.Lane
		lockMs int
	}
	// Locks outlive the 10 s wait after a server-busy answer, or, at 4 s,
	// are renewed through it: nothing is out for the message meanwhile.
	rows := []row{{"server-busy", shapes.Lanes()[0], 30000}, {"server-busy", shapes.Lanes()[0], 4000}}
	for _, l := range shapes.Lanes() {
		if l.Batch == 0 {
			rows = append(rows, row{"timeout", l, 30000})
		}
	}
	for _, r := range rows {
		mode := r.mode
		// A "+" in an entity's name would need escaping in the control API.
		t.Run(fmt.Sprintf("%s/%s/lock-%ds", mode, strings.ReplaceAll(r.lane.Name, "+", "-"), r.lockMs/1000), func(t *testing.T) {
			t.Parallel()
			const n, faults = 12, 5
			q := p.entity(t, map[string]any{"lock_duration_ms": r.lockMs, "max_delivery_count": 10})
			msgs := map[string]any{"entity": q, "count": n, "message_id_prefix": "m"}
			if mode != "server-busy" {
				// In 3 groups. Not after server-busy, where a group's
				// second resend would wait for its first, 10 s.
				msgs["sessions"] = []string{"a", "b", "c"}
			}
			p.call(t, "POST", "/messages", msgs, nil)
			t.Cleanup(func() { p.call(t, "POST", "/faults/disposition/clear", map[string]any{"entity": q}, nil) })
			var armed struct{ Remaining int }
			p.call(t, "POST", "/faults/disposition", map[string]any{"entity": q, "mode": mode, "count": faults}, &armed)
			if armed.Remaining != faults {
				t.Fatalf("fault armed for %d dispositions, want %d", armed.Remaining, faults)
			}
			// Odd messages are dead-lettered: a resend keeps the outcome
			// and its reason. The credit takes all at once, so that the
			// faults hit settlements in flight together.
			s, err := amqpsub.New(sbConnector(t, p), q, amqpsub.HandlerFunc(func(_ context.Context, d *amqpsub.Delivery) error {
				if id, _ := d.MessageID().(string); strings.IndexAny(id[len(id)-1:], "13579") == 0 {
					return amqpsub.RejectWith("poison", "odd")
				}
				return nil
			}), append(r.lane.Options(), amqpsub.Credit(n), amqpsub.FixedCredit(), amqpsub.Logger(logger(t)))...)
			if err != nil {
				t.Fatal(err)
			}
			stop, wait := runSub(t, s)
			waitFor(t, 30*time.Second, "every message settled", func() bool {
				e := p.info(t, q)
				return e.Stats["completed"]+e.DeadLetter == n && e.Locked == 0 && e.Available == 0
			})
			stop()
			if err := wait(); err != nil {
				t.Fatal(err)
			}
			var f struct {
				Hits     int
				Requests int `json:"update_disposition_requests"`
				Tokens   int `json:"update_disposition_tokens"`
			}
			p.call(t, "GET", "/faults/disposition?entity="+q, nil, &f)
			e := p.info(t, q)
			st := s.Stats()
			requests, tokens := f.Requests, f.Tokens
			t.Logf("faults hit %d; update-disposition: %d requests, %d tokens; entity %+v; settled %+v, settle errors %d, by token %d in %d requests",
				f.Hits, requests, tokens, e, st.Settled, st.SettleErrors, st.Locks.SettledByToken, st.Locks.DispositionRequests)
			if f.Hits != faults || tokens != faults || e.Stats["disposition_faults"] != faults {
				t.Fatalf("%d dispositions answered %s, %d settled by lock token: want %d each", f.Hits, mode, tokens, faults)
			}
			if e.Stats["delivered"] != n || e.Stats["lock_expired"] != 0 || e.Stats["completed"] != n/2 || e.DeadLetter != n/2 {
				t.Fatalf("entity %+v: want %d delivered once, %d completed, %d dead-lettered, no lock expired", e, n, n/2, n/2)
			}
			for _, m := range p.messages(t, q+"/$DeadLetterQueue") {
				if m.AppProps["DeadLetterReason"] != "poison" {
					t.Fatalf("dead letter %s has reason %v, want poison", m.MessageID, m.AppProps["DeadLetterReason"])
				}
			}
			if st.Settled.Accepted != n/2 || st.Settled.Rejected != n/2 || st.SettleErrors != 0 ||
				st.Locks.SettledByToken != faults || st.Locks.DispositionRequests != uint64(requests) ||
				mode == "server-busy" && r.lockMs < 10000 && st.Locks.Renewed < faults {
				t.Fatalf("stats: settled %+v, settle errors %d, by token %d in %d requests, %d locks renewed: want %d accepted and rejected, no error, %d by token in the peer's %d requests (and, on locks shorter than the wait, each renewed)",
					st.Settled, st.SettleErrors, st.Locks.SettledByToken, st.Locks.DispositionRequests, st.Locks.Renewed, n/2, faults, requests)
			}
		})
	}
}
