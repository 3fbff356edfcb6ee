package integration

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/amqpsub/amqpsub/amqpsub"
)

// The broker detaches a link while the connection stays (the Service Bus
// peer): finished work is not lost, settlements go by lock token.

// The link is detached during a stop's grace, while 8 handlers run: its
// connection is open, so its $management node settles their results by
// lock token, and no connection is opened.
func TestServiceBusLinkDetachedDuringTheGrace(t *testing.T) {
	p := serviceBusPeer(t)
	q := p.entity(t, map[string]any{"lock_duration_ms": 5000})
	st, d := stopDuringGrace(t, p, sbConnector(t, p), q, func() {
		p.call(t, "POST", "/faults/detach", map[string]any{"entity": q}, nil)
	})
	e := p.info(t, q)
	t.Logf("connections opened for the entity %d (on the whole peer %d); entity %+v; stats %v", e.Stats["connections"], d["connections_opened"], e, st)
	if e.Stats["completed"] != 8 || st.Locks.SettledByToken != 8 || st.SettleErrors != 0 || st.LinksLost != 1 {
		t.Fatalf("completed %d, settled by token %d, settle errors %d, links lost %d: want 8, 8, 0, 1",
			e.Stats["completed"], st.Locks.SettledByToken, st.SettleErrors, st.LinksLost)
	}
	if e.Stats["connections"] != 1 {
		t.Fatalf("%d connections opened: want the first only", e.Stats["connections"])
	}
}

// The peer detaches the receive link 3 times while 2,000 messages are
// handled by 8 lanes at 50 ms each. A message lock outlives its link on a
// queue without sessions (the peer plays what the official clients show):
// the subscriber keeps what the lost link held, renews it from the next
// link, and settles it by lock token (update-disposition). No message whose
// handler had finished is handled again, and nothing is lost. Each link is
// attached again on the connection it was lost on: no new connection.
func TestServiceBusLostLinksLoseNoFinishedWork(t *testing.T) {
	p := serviceBusPeer(t)
	q := p.entity(t, map[string]any{"lock_duration_ms": 5000})
	const n = 2000
	p.send(t, q, n)
	before := p.counters(t)
	var mu sync.Mutex
	finished := make([]bool, n) // its handler had returned
	calls := make([]int, n)
	again, againFinished := 0, 0
	done := 0
	detach := make(chan struct{}, 3)
	s, err := amqpsub.New(sbConnector(t, p), q, amqpsub.HandlerFunc(func(ctx context.Context, d *amqpsub.Delivery) error {
		i := sbIndex(d)
		mu.Lock()
		calls[i]++
		if calls[i] > 1 {
			again++
			if finished[i] {
				againFinished++
			}
		}
		mu.Unlock()
		time.Sleep(50 * time.Millisecond)
		mu.Lock()
		finished[i] = true
		if done++; done == n/4 || done == n/2 || done == 3*n/4 {
			detach <- struct{}{}
		}
		mu.Unlock()
		return nil
	}), amqpsub.WorkersByKey(8), amqpsub.Backoff(50*time.Millisecond, 200*time.Millisecond), amqpsub.Logger(logger(t)))
	if err != nil {
		t.Fatal(err)
	}
	stop, wait := runSub(t, s)
	detached := 0
	waitFor(t, 3*time.Minute, "2,000 completed", func() bool {
		select {
		case <-detach:
			var out map[string]any
			p.call(t, "POST", "/faults/detach", map[string]any{"entity": q, "condition": "amqp:link:detach-forced"}, &out)
			detached++
		default:
		}
		return p.info(t, q).Stats["completed"] == n
	})
	stop()
	if err := wait(); err != nil {
		t.Fatal(err)
	}
	after := p.counters(t)
	e := p.info(t, q)
	st := s.Stats()
	mu.Lock()
	defer mu.Unlock()
	conns := p.info(t, q).Stats["connections"] // this entity's: other tests connect too
	t.Logf("detached %d times; handled again %d (of which their handler had finished: %d); update-disposition requests %d; connections opened %d; dispositions after a detach %d; entity %+v; stats %v",
		detached, again, againFinished, after["update_disposition_requests"]-before["update_disposition_requests"], conns,
		after["dispositions_after_detach"]-before["dispositions_after_detach"], e, st)
	if detached != 3 || st.LinksLost < 3 {
		t.Fatalf("detached %d, links lost %d: want 3", detached, st.LinksLost)
	}
	if conns != 1 {
		// A lost link is attached again on its live connection (Learn:
		// locks do not survive on a different connection).
		t.Fatalf("%d connections opened for 3 detaches: want the first one only", conns)
	}
	if againFinished != 0 {
		t.Fatalf("%d messages whose handler had finished were handled again", againFinished)
	}
	if st.Locks.SettledByToken == 0 || e.Stats["lock_expired"] != 0 {
		t.Fatalf("settled by token %d, locks expired %d: want what the lost links held settled by lock token, none expired",
			st.Locks.SettledByToken, e.Stats["lock_expired"])
	}
	for i, c := range calls {
		if c == 0 {
			t.Fatalf("message %d never handled", i)
		}
	}
	if e.Stats["completed"] != n || e.Available != 0 || e.DeadLetter != 0 {
		t.Fatalf("entity %+v: want %d completed, nothing left", e, n)
	}
}

// The service detaches a link with amqp:unauthorized-access when the token
// it was attached under expired or was revoked. The peer drops the
// connection's claims for the entity and detaches so: the subscriber puts
// fresh tokens on the same connection and attaches again there, rather
// than closing a connection whose other locks are still held.
func TestServiceBusUnauthorizedDetachReclaimsOnTheConnection(t *testing.T) {
	p := serviceBusPeer(t)
	q := p.entity(t, map[string]any{"lock_duration_ms": 5000})
	const n = 200
	p.send(t, q, n)
	var mu sync.Mutex
	calls := make([]int, n)
	var done atomic.Int32
	s, err := amqpsub.New(sbConnector(t, p), q, amqpsub.HandlerFunc(func(ctx context.Context, d *amqpsub.Delivery) error {
		mu.Lock()
		calls[sbIndex(d)]++
		mu.Unlock()
		time.Sleep(10 * time.Millisecond)
		done.Add(1)
		return nil
	}), amqpsub.Workers(4), amqpsub.Backoff(50*time.Millisecond, 200*time.Millisecond), amqpsub.Logger(logger(t)))
	if err != nil {
		t.Fatal(err)
	}
	stop, wait := runSub(t, s)
	waitFor(t, time.Minute, "50 handled", func() bool { return done.Load() >= 50 })
	mid := p.counters(t)
	var out map[string]any
	p.call(t, "POST", "/faults/detach", map[string]any{"entity": q, "condition": "amqp:unauthorized-access",
		"description": "The token has expired.", "revoke_claims": true}, &out)
	waitFor(t, time.Minute, "200 completed", func() bool { return p.info(t, q).Stats["completed"] == n })
	stop()
	if err := wait(); err != nil {
		t.Fatal(err)
	}
	after := p.counters(t)
	st := s.Stats()
	conns := p.info(t, q).Stats["connections"] // this entity's: other tests connect too
	puts := after["put_token_ok"] - mid["put_token_ok"]
	t.Logf("detached %v; connections opened %d; tokens put after the detach %d; stats %v", out["detached"], conns, puts, st)
	if out["detached"] != float64(1) || st.LinksLost != 1 {
		t.Fatalf("detached %v, links lost %d: want 1", out["detached"], st.LinksLost)
	}
	if conns != 1 || puts < 2 {
		t.Fatalf("%d connections opened, %d tokens put after the detach: want 1 connection, fresh tokens on it", conns, puts)
	}
	mu.Lock()
	defer mu.Unlock()
	for i, c := range calls {
		if c != 1 {
			t.Fatalf("message %d handled %d times", i, c)
		}
	}
}

// While a lost link waits for its reattach (here the peer refuses the
// entity's receivers for 2 s), the lost link's $management node still
// serves: the results of the 4 handlers that finish meanwhile are settled
// by lock token at once, not once the next link is up; the refused
// attaches are asked again on the same connection.
func TestServiceBusSettlesByTokenWhileTheLinkIsReattached(t *testing.T) {
	p := serviceBusPeer(t)
	q := p.entity(t, map[string]any{"lock_duration_ms": 30000})
	p.send(t, q, 4)
	gate := make(chan struct{})
	var running sync.WaitGroup
	running.Add(4)
	s, err := amqpsub.New(sbConnector(t, p), q, amqpsub.HandlerFunc(func(ctx context.Context, d *amqpsub.Delivery) error {
		running.Done()
		<-gate
		return nil
	}), amqpsub.Workers(4), amqpsub.Backoff(50*time.Millisecond, 200*time.Millisecond), amqpsub.Logger(logger(t)))
	if err != nil {
		t.Fatal(err)
	}
	before := p.counters(t)
	stop, wait := runSub(t, s)
	running.Wait()
	p.call(t, "POST", "/faults/detach", map[string]any{"entity": q, "refuse_attach_ms": 2000}, nil)
	waitFor(t, 5*time.Second, "the link lost", func() bool { return s.Stats().LinksLost == 1 })
	close(gate)
	start := time.Now()
	waitFor(t, 10*time.Second, "4 completed", func() bool { return p.info(t, q).Stats["completed"] == 4 })
	took := time.Since(start)
	st := s.Stats()
	waitFor(t, 10*time.Second, "reattached", func() bool { return s.Stats().Reconnects == 1 })
	stop()
	if err := wait(); err != nil {
		t.Fatal(err)
	}
	after := p.counters(t)
	refused, conns := after["links_refused"]-before["links_refused"], p.info(t, q).Stats["connections"]
	t.Logf("completed %v after the handlers returned; reconnects then %d; attaches refused %d; connections opened %d; stats %v",
		took.Round(time.Millisecond), st.Reconnects, refused, conns, st)
	if st.Reconnects != 0 || took > time.Second || st.Locks.SettledByToken != 4 {
		t.Fatalf("completed after %v with %d reconnects, %d settled by token: want within 1 s, before the reattach, by token",
			took, st.Reconnects, st.Locks.SettledByToken)
	}
	if refused == 0 || conns != 1 {
		t.Fatalf("%d attaches refused, %d connections opened: want some refused, all on the first connection", refused, conns)
	}
}
