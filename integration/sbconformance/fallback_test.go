package sbconformance

// The SDK's own fallback path: azservicebus settles on the receive link
// and, when that fails with an *amqp.LinkError, sends the settlement as
// com.microsoft:update-disposition on $management (messageSettler.go,
// shouldSettleOnMgmtLink; internal/mgmt.go SettleOnMgmtLink). These tests
// detach the receiver's link on the peer and settle afterwards.

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/Azure/azure-sdk-for-go/sdk/messaging/azservicebus"
)

// detach has the peer force-detach the entity's receive links and checks
// how many went.
func (p *peer) detach(t *testing.T, entity string, want int) {
	t.Helper()
	var res struct {
		Detached int `json:"detached"`
	}
	p.must(t, "POST", "/faults/detach", map[string]any{"entity": entity}, &res)
	if res.Detached != want {
		t.Fatalf("detached %d links, want %d", res.Detached, want)
	}
}

// grew checks how much each counter grew between two snapshots.
func grew(t *testing.T, before, after map[string]int, want map[string]int) {
	t.Helper()
	for name, w := range want {
		if got := after[name] - before[name]; got != w {
			t.Errorf("counter %s grew by %d, want %d", name, got, w)
		}
	}
}

// TestSettleAfterDetach: with the receive link gone, Complete, Abandon,
// DeadLetter (reason and description), Defer and RenewMessageLock all
// succeed through $management, and only the abandoned message comes back
// (count + 1).
func TestSettleAfterDetach(t *testing.T) {
	p := needPeer(t)
	q := p.entity(t, map[string]any{"lock_duration_ms": 5000})
	c := newClient(t, p.conn)
	ids := []string{"complete", "abandon", "deadletter", "defer", "renew"}
	for _, id := range ids {
		send(t, c, q, textMsg(id, "x"))
	}
	r, err := c.NewReceiverForQueue(q, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close(context.Background())
	byID := map[string]*azservicebus.ReceivedMessage{}
	for _, m := range receiveN(t, r, len(ids), 10*time.Second) {
		byID[m.MessageID] = m
	}
	before := p.counters(t)
	p.detach(t, q, 1)

	ctx := ctxFor(t, 20*time.Second)
	if err := r.CompleteMessage(ctx, byID["complete"], nil); err != nil {
		t.Fatalf("complete: %v", err)
	}
	if err := r.AbandonMessage(ctx, byID["abandon"], &azservicebus.AbandonMessageOptions{
		PropertiesToModify: map[string]any{"retried-by": "conformance"}}); err != nil {
		t.Fatalf("abandon: %v", err)
	}
	reason, desc := "poison", "the handler gave up"
	if err := r.DeadLetterMessage(ctx, byID["deadletter"], &azservicebus.DeadLetterOptions{
		Reason: &reason, ErrorDescription: &desc}); err != nil {
		t.Fatalf("dead-letter: %v", err)
	}
	if err := r.DeferMessage(ctx, byID["defer"], nil); err != nil {
		t.Fatalf("defer: %v", err)
	}
	old := byID["renew"].LockedUntil
	if err := r.RenewMessageLock(ctx, byID["renew"], nil); err != nil {
		t.Fatalf("renew after the detach: %v", err)
	}
	if !byID["renew"].LockedUntil.After(*old) {
		t.Errorf("renewal did not move LockedUntil: %v -> %v", *old, *byID["renew"].LockedUntil)
	}
	if err := r.CompleteMessage(ctx, byID["renew"], nil); err != nil {
		t.Fatalf("complete of the renewed message: %v", err)
	}
	after := p.counters(t)
	grew(t, before, after, map[string]int{
		"locks_orphaned":               5,
		"update_disposition_requests":  5,
		"update_disposition_tokens":    5,
		"update_disposition_lock_lost": 0,
		"completed":                    2,
		"abandoned":                    1,
		"dead_lettered":                1,
		"deferred":                     1,
		"renew_lock_tokens":            1,
		"redeliveries_link_closed":     0,
		"lock_lost_answers":            0,
	})

	// Only "abandon" is available again, with its count raised and the
	// property set; the SDK reattaches for this receive.
	m := receiveN(t, r, 1, 10*time.Second)[0]
	if m.MessageID != "abandon" || m.DeliveryCount != 2 || m.ApplicationProperties["retried-by"] != "conformance" {
		t.Fatalf("after the fallback settlements got %s count %d props %v, want abandon count 2 retried-by=conformance",
			m.MessageID, m.DeliveryCount, m.ApplicationProperties)
	}
	if err := r.CompleteMessage(ctx, m, nil); err != nil {
		t.Fatal(err)
	}
	short, cancel := context.WithTimeout(context.Background(), 1500*time.Millisecond)
	defer cancel()
	if more, err := r.ReceiveMessages(short, 5, nil); len(more) != 0 {
		t.Fatalf("a settled message came back: %d messages (%v), first %s", len(more), err, more[0].MessageID)
	}

	dlq, err := c.NewReceiverForQueue(q, &azservicebus.ReceiverOptions{SubQueue: azservicebus.SubQueueDeadLetter})
	if err != nil {
		t.Fatal(err)
	}
	defer dlq.Close(context.Background())
	d := receiveN(t, dlq, 1, 10*time.Second)[0]
	if d.MessageID != "deadletter" || str(d.DeadLetterReason) != reason || str(d.DeadLetterErrorDescription) != desc {
		t.Fatalf("DLQ message %s reason %q description %q", d.MessageID, str(d.DeadLetterReason), str(d.DeadLetterErrorDescription))
	}
	var deferred []peerMessage
	for _, pm := range p.messages(t, q) {
		if pm.State == "deferred" {
			deferred = append(deferred, pm)
		}
	}
	if len(deferred) != 1 || deferred[0].MessageID != "defer" {
		t.Fatalf("deferred messages on the peer: %+v, want defer", deferred)
	}
}

// TestLockExpiresAfterDetach: a lock whose link went and which then ran
// out is gone: update-disposition and renew-lock get 410, which the SDK
// reports as CodeLockLost, and the message comes back with count + 1.
func TestLockExpiresAfterDetach(t *testing.T) {
	p := needPeer(t)
	q := p.entity(t, map[string]any{"lock_duration_ms": 1000})
	c := newClient(t, p.conn)
	send(t, c, q, textMsg("late", "x"))
	r, err := c.NewReceiverForQueue(q, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close(context.Background())
	m := receiveN(t, r, 1, 10*time.Second)[0]
	before := p.counters(t)
	p.detach(t, q, 1)
	p.waitCounter(t, before, "lock_expirations", 1, 10*time.Second)

	if err := r.CompleteMessage(ctxFor(t, 10*time.Second), m, nil); sbCode(err) != azservicebus.CodeLockLost {
		t.Fatalf("complete after expiry: %v (code %q), want CodeLockLost", err, sbCode(err))
	}
	if err := r.RenewMessageLock(ctxFor(t, 10*time.Second), m, nil); sbCode(err) != azservicebus.CodeLockLost {
		t.Fatalf("renew after expiry: %v (code %q), want CodeLockLost", err, sbCode(err))
	}
	after := p.counters(t)
	if n := after["update_disposition_lock_lost"] - before["update_disposition_lock_lost"]; n != 1 {
		t.Errorf("update_disposition_lock_lost grew by %d, want 1", n)
	}
	again := receiveN(t, r, 1, 10*time.Second)[0]
	if again.MessageID != "late" || again.DeliveryCount != 2 {
		t.Fatalf("after expiry got %s count %d, want late count 2", again.MessageID, again.DeliveryCount)
	}
	if err := r.CompleteMessage(ctxFor(t, 5*time.Second), again, nil); err != nil {
		t.Fatal(err)
	}
}

// TestSessionSettleAfterDetach: a session message's lock is the session's
// (the SDK sends no session-id in its update-disposition, and .NET throws
// lock-lost for sessions instead of falling back), so once the session
// link is gone its settlement fails. azservicebus treats a lost lock on a
// session receiver as recoverable (internal/errors.go
// GetRecoveryKindForSession: RecoveryKindLink), so it re-accepts the same
// session and tries again, with its default settlement retries (3, from
// 4 s): a caller whose deadline ends first gets the deadline; the retries
// end in CodeLockLost. The message was given back without a raised count
// (the session was closed, its lock did not expire).
func TestSessionSettleAfterDetach(t *testing.T) {
	p := needPeer(t)
	q := p.entity(t, map[string]any{"lock_duration_ms": 30000, "requires_session": true})
	c := newClient(t, p.conn)
	sid := "s1"
	m0 := textMsg("s-1", "x")
	m0.SessionID = &sid
	send(t, c, q, m0)
	s, err := c.AcceptSessionForQueue(ctxFor(t, 10*time.Second), q, sid, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close(context.Background())
	m := receiveN(t, s, 1, 10*time.Second)[0]
	before := p.counters(t)
	p.detach(t, q, 1)

	start := time.Now()
	err = s.CompleteMessage(ctxFor(t, 8*time.Second), m, nil)
	took := time.Since(start)
	if !errors.Is(err, context.DeadlineExceeded) && sbCode(err) != azservicebus.CodeLockLost {
		t.Fatalf("complete after the session link went: %v (code %q), want the deadline or CodeLockLost", err, sbCode(err))
	}
	after := p.counters(t)
	ud := after["update_disposition_requests"] - before["update_disposition_requests"]
	lost := after["update_disposition_lock_lost"] - before["update_disposition_lock_lost"]
	t.Logf("CompleteMessage: %v after %v; update-disposition %d (410: %d), session accepts +%d",
		err, took.Round(time.Millisecond), ud, lost, after["session_accepts"]-before["session_accepts"])
	if ud < 2 || lost != ud {
		t.Errorf("update-disposition requests %d, answered 410 %d: want at least 2 (one per attempt), all 410", ud, lost)
	}
	if n := after["session_accepts"] - before["session_accepts"]; n < 1 {
		t.Errorf("the SDK did not re-accept the session between attempts (session_accepts +%d)", n)
	}
	grew(t, before, after, map[string]int{"completed": 0, "locks_orphaned": 0})
	if n := after["redeliveries_link_closed"] - before["redeliveries_link_closed"]; n < 1 {
		t.Errorf("redeliveries_link_closed grew by %d, want >= 1", n)
	}
	msgs := p.messages(t, q)
	if len(msgs) != 1 || msgs[0].MessageID != "s-1" || msgs[0].DeliveryCount != 0 {
		t.Fatalf("peer messages after the failed settlement: %+v, want s-1 with count 0", msgs)
	}
}

// TestIdleDetach: a receive link with no transfer, flow or disposition
// for the idle time is detached with amqp:link:detach-forced; management
// requests naming the link in associated-link-name keep it alive; the SDK
// reattaches on its next receive.
func TestIdleDetach(t *testing.T) {
	p := needPeer(t)
	q := p.entity(t, map[string]any{"lock_duration_ms": 30000})
	t.Cleanup(func() { _ = p.call("POST", "/faults/idle-detach", map[string]any{"idle_ms": 0}, nil) })
	c := newClient(t, p.conn)
	send(t, c, q, textMsg("i-1", "x"))
	r, err := c.NewReceiverForQueue(q, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close(context.Background())
	m := receiveN(t, r, 1, 10*time.Second)[0]
	before := p.counters(t)
	const idle = 2 * time.Second
	p.must(t, "POST", "/faults/idle-detach", map[string]any{"idle_ms": idle.Milliseconds()}, nil)

	// Renewals every 200 ms for longer than the idle time carry
	// associated-link-name: no detach. (The pause paces the renewals; the
	// check is that none is detached while they flow.)
	for range 15 {
		if err := r.RenewMessageLock(ctxFor(t, 5*time.Second), m, nil); err != nil {
			t.Fatalf("renew: %v", err)
		}
		time.Sleep(200 * time.Millisecond)
	}
	mid := p.counters(t)
	grew(t, before, mid, map[string]int{"links_detached_idle": 0})
	if n := mid["associated_link_activity"] - before["associated_link_activity"]; n < 15 {
		t.Errorf("associated_link_activity grew by %d, want >= 15", n)
	}
	// Then silence: the peer detaches the link; the lock survives it.
	p.waitCounter(t, before, "links_detached_idle", 1, 10*time.Second)
	if err := r.CompleteMessage(ctxFor(t, 10*time.Second), m, nil); err != nil {
		t.Fatalf("complete after the idle detach: %v", err)
	}
	send(t, c, q, textMsg("i-2", "x"))
	if again := receiveN(t, r, 1, 10*time.Second)[0]; again.MessageID != "i-2" {
		t.Fatalf("after the idle detach got %s, want i-2", again.MessageID)
	}
	grew(t, before, p.counters(t), map[string]int{"update_disposition_requests": 1, "completed": 1})
}

// TestSettlementsOutstanding: the peer counts the most settling
// dispositions it holds unanswered at once.
func TestSettlementsOutstanding(t *testing.T) {
	p := needPeer(t)
	q := p.entity(t, map[string]any{"lock_duration_ms": 30000})
	const n = 16
	p.must(t, "POST", "/messages", map[string]any{"entity": q, "count": n}, nil)
	p.must(t, "POST", "/faults/settle-delay", map[string]any{"ms": 1500}, nil)
	t.Cleanup(func() { _ = p.call("POST", "/faults/settle-delay", map[string]any{"ms": 0}, nil) })
	c := newClient(t, p.conn)
	r, err := c.NewReceiverForQueue(q, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close(context.Background())
	ms := receiveN(t, r, n, 10*time.Second)
	p.must(t, "POST", "/counters/reset", nil, nil)
	var wg sync.WaitGroup
	errs := make(chan error, n)
	for _, m := range ms {
		wg.Go(func() { errs <- r.CompleteMessage(ctxFor(t, 20*time.Second), m, nil) })
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	got := p.counters(t)
	if got["settlements_outstanding_max"] != n || got["settlements_outstanding"] != 0 || got["completed"] != n {
		t.Fatalf("settlements_outstanding_max %d (want %d), outstanding now %d (want 0), completed %d",
			got["settlements_outstanding_max"], n, got["settlements_outstanding"], got["completed"])
	}
}
