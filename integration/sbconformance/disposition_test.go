package sbconformance

import (
	"testing"
	"time"
)

// TestDispositionFaults: the peer answers a link disposition as busy or
// timed out (POST /faults/disposition) in a form azservicebus reads as
// transient: CompleteMessage retries it (internal/errors.go: server-busy
// and timeout are RecoveryKindNone) instead of failing. The retry writes no
// frame, since go-amqp took the answer as the delivery's settlement
// (receiver.go), and returns nil: the message stays locked, not completed.
// That is the gap amqpsub closes by sending the settlement again by lock
// token.
func TestDispositionFaults(t *testing.T) {
	p := needPeer(t)
	for _, mode := range []string{"server-busy", "timeout"} {
		t.Run(mode, func(t *testing.T) {
			t.Parallel()
			q := p.entity(t, map[string]any{"lock_duration_ms": 30000})
			c := newClient(t, p.conn)
			send(t, c, q, textMsg("busy-1", "x"))
			r, err := c.NewReceiverForQueue(q, nil)
			if err != nil {
				t.Fatal(err)
			}
			m := receiveN(t, r, 1, 10*time.Second)[0]
			t.Cleanup(func() { _ = p.call("POST", "/faults/disposition/clear", map[string]any{"entity": q}, nil) })
			p.must(t, "POST", "/faults/disposition", map[string]any{"entity": q, "mode": mode, "count": 1}, nil)
			if err := r.CompleteMessage(ctxFor(t, 10*time.Second), m, nil); err != nil {
				t.Fatalf("CompleteMessage: %v (azservicebus retries %s, and its retry writes nothing)", err, mode)
			}
			var f struct {
				Hits, Remaining int
				Requests        int `json:"update_disposition_requests"`
			}
			p.must(t, "GET", "/faults/disposition?entity="+q, nil, &f)
			e := p.info(t, q)
			if f.Hits != 1 || f.Remaining != 0 || f.Requests != 0 || e.Locked != 1 || e.Stats["completed"] != 0 {
				t.Fatalf("fault hits %d, remaining %d, update-disposition requests %d; entity %+v: "+
					"want 1 hit, nothing by lock token, and the message still locked", f.Hits, f.Remaining, f.Requests, e)
			}
		})
	}
}
