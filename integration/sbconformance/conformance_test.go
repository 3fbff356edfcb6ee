package sbconformance

import (
	"bytes"
	"context"
	"fmt"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/Azure/azure-sdk-for-go/sdk/messaging/azservicebus"
)

// TestSendPeekLockComplete: send, peek-lock receive (annotations, lock
// token, delivery count), complete.
func TestSendPeekLockComplete(t *testing.T) {
	p := needPeer(t)
	q := p.entity(t, map[string]any{"lock_duration_ms": 3000})
	c := newClient(t, p.conn)

	var sent []*azservicebus.Message
	for i := range 3 {
		m := textMsg(fmt.Sprintf("id-%d", i), fmt.Sprintf("body-%d", i))
		m.ApplicationProperties = map[string]any{"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", "n": int64(i)}
		sent = append(sent, m)
	}
	before := time.Now()
	send(t, c, q, sent...)
	if e := p.info(t, q); e.Available != 3 {
		t.Fatalf("peer holds %d available messages, want 3", e.Available)
	}

	r, err := c.NewReceiverForQueue(q, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close(context.Background())
	got := receiveN(t, r, 3, 10*time.Second)
	held := map[string]peerMessage{}
	for _, pm := range p.messages(t, q) {
		held[pm.MessageID] = pm
	}
	for i, m := range got {
		if m.MessageID != fmt.Sprintf("id-%d", i) || string(m.Body) != fmt.Sprintf("body-%d", i) {
			t.Errorf("message %d: id %q body %q", i, m.MessageID, m.Body)
		}
		if m.DeliveryCount != 1 {
			t.Errorf("message %d: DeliveryCount %d, want 1", i, m.DeliveryCount)
		}
		if m.SequenceNumber == nil || *m.SequenceNumber != int64(i+1) {
			t.Errorf("message %d: SequenceNumber %v, want %d", i, m.SequenceNumber, i+1)
		}
		if m.EnqueuedTime == nil || m.EnqueuedTime.Before(before.Add(-time.Second)) || m.EnqueuedTime.After(time.Now()) {
			t.Errorf("message %d: EnqueuedTime %v", i, m.EnqueuedTime)
		}
		if m.LockedUntil == nil || time.Until(*m.LockedUntil) < time.Second || time.Until(*m.LockedUntil) > 3*time.Second {
			t.Errorf("message %d: LockedUntil %v, want about now+3s", i, m.LockedUntil)
		}
		if m.ApplicationProperties["traceparent"] != sent[i].ApplicationProperties["traceparent"] || m.ApplicationProperties["n"] != int64(i) {
			t.Errorf("message %d: application properties %v", i, m.ApplicationProperties)
		}
		// The SDK turns the .NET-layout delivery tag into an RFC UUID; the
		// peer reports the RFC form of the lock it holds: they must match.
		pm, ok := held[m.MessageID]
		if !ok || pm.State != "locked" {
			t.Fatalf("message %s is not locked at the peer: %+v", m.MessageID, pm)
		}
		if tok := fmt.Sprintf("%x-%x-%x-%x-%x", m.LockToken[0:4], m.LockToken[4:6], m.LockToken[6:8], m.LockToken[8:10], m.LockToken[10:]); tok != pm.LockToken {
			t.Errorf("message %d: SDK lock token %s, peer lock %s", i, tok, pm.LockToken)
		}
		if m.LockedUntil != nil && m.LockedUntil.UnixMilli() != pm.LockedUntilMS {
			t.Errorf("message %d: LockedUntil %d ms, peer %d ms", i, m.LockedUntil.UnixMilli(), pm.LockedUntilMS)
		}
	}
	for _, m := range got {
		if err := r.CompleteMessage(ctxFor(t, 10*time.Second), m, nil); err != nil {
			t.Fatalf("complete %s: %v", m.MessageID, err)
		}
	}
	if e := p.info(t, q); e.Available != 0 || e.Locked != 0 || e.Stats["completed"] != 3 {
		t.Fatalf("after completing: %+v", e)
	}
}

// TestRenewMessageLock: the renewed lock outlives the first one; the SDK
// and the peer agree on the new expiry.
func TestRenewMessageLock(t *testing.T) {
	p := needPeer(t)
	q := p.entity(t, map[string]any{"lock_duration_ms": 1500})
	c := newClient(t, p.conn)
	send(t, c, q, textMsg("renew-1", "x"))
	r, err := c.NewReceiverForQueue(q, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close(context.Background())
	before := p.counters(t)
	m := receiveN(t, r, 1, 10*time.Second)[0]
	first := *m.LockedUntil
	// Renew with 1 s of the lock left, then again just after the first lock
	// would have expired: the message outlives its first lock.
	for _, at := range []time.Time{first.Add(-time.Second), first.Add(100 * time.Millisecond)} {
		time.Sleep(time.Until(at))
		if err := r.RenewMessageLock(ctxFor(t, 5*time.Second), m, nil); err != nil {
			t.Fatalf("RenewMessageLock: %v", err)
		}
	}
	if !m.LockedUntil.After(first) {
		t.Fatalf("LockedUntil %v not after the first lock %v", m.LockedUntil, first)
	}
	pm := p.messages(t, q)
	if len(pm) != 1 || pm[0].LockedUntilMS != m.LockedUntil.UnixMilli() {
		t.Fatalf("peer lock %+v, SDK LockedUntil %d", pm, m.LockedUntil.UnixMilli())
	}
	if time.Now().Before(first) {
		t.Fatalf("test bug: the first lock has not expired yet")
	}
	if err := r.CompleteMessage(ctxFor(t, 5*time.Second), m, nil); err != nil {
		t.Fatalf("complete after renewal: %v", err)
	}
	after := p.counters(t)
	if n := after["renew_lock_requests"] - before["renew_lock_requests"]; n != 2 {
		t.Errorf("renew_lock_requests grew by %d, want 2", n)
	}
	if n := after["renew_lock_tokens"] - before["renew_lock_tokens"]; n != 2 {
		t.Errorf("renew_lock_tokens grew by %d, want 2", n)
	}
	if n := after["redeliveries_lock_expired"] - before["redeliveries_lock_expired"]; n != 0 {
		t.Errorf("%d lock expiries despite renewal", n)
	}
}

// TestAbandonRaisesDeliveryCount: abandon redelivers with DeliveryCount+1.
func TestAbandonRaisesDeliveryCount(t *testing.T) {
	p := needPeer(t)
	q := p.entity(t, map[string]any{"lock_duration_ms": 5000})
	c := newClient(t, p.conn)
	send(t, c, q, textMsg("abandon-1", "x"))
	r, err := c.NewReceiverForQueue(q, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close(context.Background())
	for want := uint32(1); want <= 3; want++ {
		m := receiveN(t, r, 1, 10*time.Second)[0]
		if m.MessageID != "abandon-1" || m.DeliveryCount != want {
			t.Fatalf("got %s with DeliveryCount %d, want %d", m.MessageID, m.DeliveryCount, want)
		}
		if want < 3 {
			if err := r.AbandonMessage(ctxFor(t, 5*time.Second), m, &azservicebus.AbandonMessageOptions{
				PropertiesToModify: map[string]any{"attempt": int64(want)},
			}); err != nil {
				t.Fatalf("abandon: %v", err)
			}
			continue
		}
		if m.ApplicationProperties["attempt"] != int64(2) {
			t.Errorf("PropertiesToModify not applied: %v", m.ApplicationProperties)
		}
		if err := r.CompleteMessage(ctxFor(t, 5*time.Second), m, nil); err != nil {
			t.Fatal(err)
		}
	}
}

// TestDeadLetterMessage: reason and description read back from the DLQ.
func TestDeadLetterMessage(t *testing.T) {
	p := needPeer(t)
	q := p.entity(t, map[string]any{"lock_duration_ms": 5000})
	c := newClient(t, p.conn)
	send(t, c, q, textMsg("dl-1", "poison"))
	r, err := c.NewReceiverForQueue(q, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close(context.Background())
	m := receiveN(t, r, 1, 10*time.Second)[0]
	reason, desc := "BadPayload", "field x is missing"
	if err := r.DeadLetterMessage(ctxFor(t, 5*time.Second), m, &azservicebus.DeadLetterOptions{
		Reason: &reason, ErrorDescription: &desc, PropertiesToModify: map[string]any{"handler": "test"},
	}); err != nil {
		t.Fatalf("DeadLetterMessage: %v", err)
	}
	if e := p.info(t, q); e.Available != 0 || e.Locked != 0 || e.DeadLetter != 1 {
		t.Fatalf("after dead-lettering: %+v", e)
	}
	pm := p.messages(t, q+"/$DeadLetterQueue")
	if len(pm) != 1 || pm[0].ApplicationProperties["DeadLetterReason"] != reason ||
		pm[0].ApplicationProperties["DeadLetterErrorDescription"] != desc {
		t.Fatalf("peer DLQ: %+v", pm)
	}
	dlq, err := c.NewReceiverForQueue(q, &azservicebus.ReceiverOptions{SubQueue: azservicebus.SubQueueDeadLetter})
	if err != nil {
		t.Fatal(err)
	}
	defer dlq.Close(context.Background())
	d := receiveN(t, dlq, 1, 10*time.Second)[0]
	if d.MessageID != "dl-1" || str(d.DeadLetterReason) != reason || str(d.DeadLetterErrorDescription) != desc ||
		d.ApplicationProperties["handler"] != "test" || string(d.Body) != "poison" {
		t.Fatalf("from the DLQ: id %s reason %s description %s props %v body %q",
			d.MessageID, str(d.DeadLetterReason), str(d.DeadLetterErrorDescription), d.ApplicationProperties, d.Body)
	}
	if err := dlq.CompleteMessage(ctxFor(t, 5*time.Second), d, nil); err != nil {
		t.Fatal(err)
	}
}

// TestLockExpiryRedelivers: an unsettled message comes back after its
// lock expires, with DeliveryCount+1; settling the first copy then fails
// with the SDK's lock-lost code.
func TestLockExpiryRedelivers(t *testing.T) {
	p := needPeer(t)
	q := p.entity(t, map[string]any{"lock_duration_ms": 1000})
	c := newClient(t, p.conn)
	send(t, c, q, textMsg("exp-1", "x"))
	r, err := c.NewReceiverForQueue(q, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close(context.Background())
	before := p.counters(t)
	first := receiveN(t, r, 1, 10*time.Second)[0]
	start := time.Now()
	second := receiveN(t, r, 1, 10*time.Second)[0]
	if wait := time.Since(start); wait < 500*time.Millisecond {
		t.Errorf("redelivered after %v, before the 1 s lock could expire", wait)
	}
	if second.MessageID != "exp-1" || second.DeliveryCount != 2 {
		t.Fatalf("redelivery: %s DeliveryCount %d, want exp-1 with 2", second.MessageID, second.DeliveryCount)
	}
	if second.LockToken == first.LockToken {
		t.Fatalf("redelivery reuses the lock token")
	}
	err = r.CompleteMessage(ctxFor(t, 5*time.Second), first, nil)
	if sbCode(err) != azservicebus.CodeLockLost {
		t.Fatalf("completing the expired copy: %v (code %q), want CodeLockLost", err, sbCode(err))
	}
	if err := r.CompleteMessage(ctxFor(t, 5*time.Second), second, nil); err != nil {
		t.Fatalf("completing the redelivery: %v", err)
	}
	after := p.counters(t)
	if after["redeliveries_lock_expired"]-before["redeliveries_lock_expired"] != 1 ||
		after["lock_lost_answers"]-before["lock_lost_answers"] != 1 {
		t.Errorf("counters: redeliveries_lock_expired +%d, lock_lost_answers +%d; want +1 each",
			after["redeliveries_lock_expired"]-before["redeliveries_lock_expired"],
			after["lock_lost_answers"]-before["lock_lost_answers"])
	}
}

// TestSettleAfterLockExpiry: every settlement of an expired lock fails with
// CodeLockLost, and a renewal of it too.
func TestSettleAfterLockExpiry(t *testing.T) {
	p := needPeer(t)
	q := p.entity(t, map[string]any{"lock_duration_ms": 1000})
	c := newClient(t, p.conn)
	send(t, c, q, textMsg("late-1", "x"), textMsg("late-2", "x"), textMsg("late-3", "x"), textMsg("late-4", "x"))
	r, err := c.NewReceiverForQueue(q, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close(context.Background())
	before := p.counters(t)
	ms := receiveN(t, r, 4, 10*time.Second)
	p.waitCounter(t, before, "lock_expirations", 4, 10*time.Second)
	reason := "late"
	ctx := ctxFor(t, 10*time.Second)
	errs := map[string]error{
		"complete":   r.CompleteMessage(ctx, ms[0], nil),
		"abandon":    r.AbandonMessage(ctx, ms[1], nil),
		"deadletter": r.DeadLetterMessage(ctx, ms[2], &azservicebus.DeadLetterOptions{Reason: &reason}),
		"renew":      r.RenewMessageLock(ctx, ms[3], nil),
	}
	for op, err := range errs {
		if sbCode(err) != azservicebus.CodeLockLost {
			t.Errorf("%s after lock expiry: %v (code %q), want CodeLockLost", op, err, sbCode(err))
		}
	}
	// The four went back to the queue, each with its count raised.
	for _, pm := range p.messages(t, q) {
		if pm.DeliveryCount != 1 || pm.State != "available" {
			t.Errorf("after expiry: %+v", pm)
		}
	}
}

// TestMaxDeliveryCount: the abandon that reaches MaxDeliveryCount moves the
// message to the DLQ with reason MaxDeliveryCountExceeded.
func TestMaxDeliveryCount(t *testing.T) {
	p := needPeer(t)
	q := p.entity(t, map[string]any{"lock_duration_ms": 5000, "max_delivery_count": 2})
	c := newClient(t, p.conn)
	send(t, c, q, textMsg("mdc-1", "x"))
	r, err := c.NewReceiverForQueue(q, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close(context.Background())
	for i := range 2 {
		m := receiveN(t, r, 1, 10*time.Second)[0]
		if m.DeliveryCount != uint32(i+1) {
			t.Fatalf("attempt %d: DeliveryCount %d", i+1, m.DeliveryCount)
		}
		if err := r.AbandonMessage(ctxFor(t, 5*time.Second), m, nil); err != nil {
			t.Fatal(err)
		}
	}
	if e := p.info(t, q); e.Available != 0 || e.DeadLetter != 1 {
		t.Fatalf("after %d abandons: %+v", 2, e)
	}
	dlq, err := c.NewReceiverForQueue(q, &azservicebus.ReceiverOptions{SubQueue: azservicebus.SubQueueDeadLetter})
	if err != nil {
		t.Fatal(err)
	}
	defer dlq.Close(context.Background())
	d := receiveN(t, dlq, 1, 10*time.Second)[0]
	if d.MessageID != "mdc-1" || str(d.DeadLetterReason) != "MaxDeliveryCountExceeded" || d.DeadLetterErrorDescription == nil {
		t.Fatalf("DLQ message %s reason %s description %s", d.MessageID, str(d.DeadLetterReason), str(d.DeadLetterErrorDescription))
	}
	if d.DeliveryCount != 3 {
		t.Errorf("DLQ message DeliveryCount %d, want 3 (two attempts, then this one)", d.DeliveryCount)
	}
	if err := dlq.CompleteMessage(ctxFor(t, 5*time.Second), d, nil); err != nil {
		t.Fatal(err)
	}
}

// TestLockExpiryToDeadLetter: lock expiries count towards MaxDeliveryCount.
func TestLockExpiryToDeadLetter(t *testing.T) {
	p := needPeer(t)
	q := p.entity(t, map[string]any{"lock_duration_ms": 1000, "max_delivery_count": 1})
	c := newClient(t, p.conn)
	send(t, c, q, textMsg("exp-dl", "x"))
	r, err := c.NewReceiverForQueue(q, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close(context.Background())
	before := p.counters(t)
	receiveN(t, r, 1, 10*time.Second)
	p.waitCounter(t, before, "dead_lettered_max_delivery", 1, 10*time.Second)
	pm := p.messages(t, q+"/$DeadLetterQueue")
	if len(pm) != 1 || pm[0].ApplicationProperties["DeadLetterReason"] != "MaxDeliveryCountExceeded" {
		t.Fatalf("DLQ: %+v", pm)
	}
}

// TestSubscription: a message sent to a topic reaches each subscription.
func TestSubscription(t *testing.T) {
	p := needPeer(t)
	topic := p.entity(t, map[string]any{"kind": "topic"})
	for _, s := range []string{"s1", "s2"} {
		p.must(t, "POST", "/entities", map[string]any{"name": topic + "/Subscriptions/" + s, "lock_duration_ms": 5000}, nil)
	}
	c := newClient(t, p.conn)
	send(t, c, topic, textMsg("t-1", "fanout"))
	for _, s := range []string{"s1", "s2"} {
		r, err := c.NewReceiverForSubscription(topic, s, nil)
		if err != nil {
			t.Fatal(err)
		}
		m := receiveN(t, r, 1, 10*time.Second)[0]
		if m.MessageID != "t-1" || string(m.Body) != "fanout" {
			t.Fatalf("subscription %s: %s %q", s, m.MessageID, m.Body)
		}
		if err := r.CompleteMessage(ctxFor(t, 5*time.Second), m, nil); err != nil {
			t.Fatal(err)
		}
		r.Close(context.Background())
	}
}

// TestSendMessageBatch: a MessageBatch (one transfer carrying several
// messages) is unpacked into separate messages.
func TestSendMessageBatch(t *testing.T) {
	p := needPeer(t)
	q := p.entity(t, map[string]any{"lock_duration_ms": 5000})
	c := newClient(t, p.conn)
	s, err := c.NewSender(q, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close(context.Background())
	b, err := s.NewMessageBatch(ctxFor(t, 5*time.Second), nil)
	if err != nil {
		t.Fatal(err)
	}
	for i := range 5 {
		if err := b.AddMessage(textMsg(fmt.Sprintf("b-%d", i), fmt.Sprintf("%d", i)), nil); err != nil {
			t.Fatal(err)
		}
	}
	if err := s.SendMessageBatch(ctxFor(t, 5*time.Second), b, nil); err != nil {
		t.Fatal(err)
	}
	pm := p.messages(t, q)
	if len(pm) != 5 {
		t.Fatalf("peer holds %d messages, want 5", len(pm))
	}
	for i, m := range pm {
		if m.MessageID != fmt.Sprintf("b-%d", i) || m.Body != fmt.Sprintf("%d", i) {
			t.Errorf("message %d: %+v", i, m)
		}
	}
}

// TestSessions: AcceptNextSessionForQueue, AcceptSessionForQueue, ordered
// delivery, one receiver per session, RenewSessionLock, session state.
func TestSessions(t *testing.T) {
	p := needPeer(t)
	q := p.entity(t, map[string]any{"lock_duration_ms": 5000, "requires_session": true})
	c := newClient(t, p.conn)
	var msgs []*azservicebus.Message
	for i := range 6 {
		sid := []string{"a", "b"}[i%2]
		m := textMsg(fmt.Sprintf("%s-%d", sid, i/2), fmt.Sprintf("%d", i/2))
		m.SessionID = &sid
		msgs = append(msgs, m)
	}
	send(t, c, q, msgs...)

	// Next available: "a" holds the oldest message.
	sa, err := c.AcceptNextSessionForQueue(ctxFor(t, 10*time.Second), q, nil)
	if err != nil {
		t.Fatalf("AcceptNextSessionForQueue: %v", err)
	}
	defer sa.Close(context.Background())
	if sa.SessionID() != "a" {
		t.Fatalf("next session %q, want a", sa.SessionID())
	}
	info := p.info(t, q)
	peerUntil := info.Sessions["a"].LockedUntilMS
	if peerUntil == nil || sa.LockedUntil().UnixMilli() != *peerUntil {
		t.Fatalf("SDK LockedUntil %v, peer %v", sa.LockedUntil().UnixMilli(), peerUntil)
	}
	got := receiveN(t, sa, 3, 10*time.Second)
	for i, m := range got {
		if m.MessageID != fmt.Sprintf("a-%d", i) || str(m.SessionID) != "a" {
			t.Fatalf("session a message %d: %s (session %s)", i, m.MessageID, str(m.SessionID))
		}
		if err := sa.CompleteMessage(ctxFor(t, 5*time.Second), m, nil); err != nil {
			t.Fatal(err)
		}
	}

	// Named session "b"; a second receiver for it is refused.
	sb, err := c.AcceptSessionForQueue(ctxFor(t, 10*time.Second), q, "b", nil)
	if err != nil {
		t.Fatalf("AcceptSessionForQueue(b): %v", err)
	}
	if sb.SessionID() != "b" {
		t.Fatalf("session %q, want b", sb.SessionID())
	}
	c2 := newClient(t, p.conn)
	if _, err := c2.AcceptSessionForQueue(ctxFor(t, 10*time.Second), q, "b", nil); err == nil ||
		!strings.Contains(err.Error(), "session-cannot-be-locked") {
		t.Fatalf("second receiver for locked session b: %v, want session-cannot-be-locked", err)
	}

	// Renew the session lock.
	old := sb.LockedUntil()
	time.Sleep(50 * time.Millisecond)
	if err := sb.RenewSessionLock(ctxFor(t, 5*time.Second), nil); err != nil {
		t.Fatalf("RenewSessionLock: %v", err)
	}
	if !sb.LockedUntil().After(old) {
		t.Fatalf("LockedUntil %v not after %v", sb.LockedUntil(), old)
	}
	if u := p.info(t, q).Sessions["b"].LockedUntilMS; u == nil || *u != sb.LockedUntil().UnixMilli() {
		t.Fatalf("peer session lock %v, SDK %d", u, sb.LockedUntil().UnixMilli())
	}

	// Session state: empty, set, read back, cleared.
	st, err := sb.GetSessionState(ctxFor(t, 5*time.Second), nil)
	if err != nil || st != nil {
		t.Fatalf("initial state %q, %v", st, err)
	}
	want := []byte{0, 1, 2, 0xff, 'x'}
	if err := sb.SetSessionState(ctxFor(t, 5*time.Second), want, nil); err != nil {
		t.Fatalf("SetSessionState: %v", err)
	}
	if st, err = sb.GetSessionState(ctxFor(t, 5*time.Second), nil); err != nil || !bytes.Equal(st, want) {
		t.Fatalf("state %q, %v; want %q", st, err, want)
	}
	got = receiveN(t, sb, 3, 10*time.Second)
	for i, m := range got {
		if m.MessageID != fmt.Sprintf("b-%d", i) {
			t.Fatalf("session b message %d: %s", i, m.MessageID)
		}
		if err := sb.CompleteMessage(ctxFor(t, 5*time.Second), m, nil); err != nil {
			t.Fatal(err)
		}
	}
	if err := sb.Close(ctxFor(t, 5*time.Second)); err != nil {
		t.Fatal(err)
	}
	// Closed: the session (and its state) can be accepted again.
	sb2, err := c2.AcceptSessionForQueue(ctxFor(t, 10*time.Second), q, "b", nil)
	if err != nil {
		t.Fatalf("re-accepting b: %v", err)
	}
	defer sb2.Close(context.Background())
	if st, err = sb2.GetSessionState(ctxFor(t, 5*time.Second), nil); err != nil || !bytes.Equal(st, want) {
		t.Fatalf("state after re-accepting %q, %v", st, err)
	}
}

// TestSessionAbandonOrder: an abandoned session message comes back before
// the rest of its session, with DeliveryCount+1.
func TestSessionAbandonOrder(t *testing.T) {
	p := needPeer(t)
	q := p.entity(t, map[string]any{"lock_duration_ms": 5000, "requires_session": true})
	c := newClient(t, p.conn)
	sid := "s"
	var msgs []*azservicebus.Message
	for i := range 3 {
		m := textMsg(fmt.Sprintf("s-%d", i), "x")
		m.SessionID = &sid
		msgs = append(msgs, m)
	}
	send(t, c, q, msgs...)
	s, err := c.AcceptSessionForQueue(ctxFor(t, 10*time.Second), q, sid, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close(context.Background())
	m := receiveN(t, s, 1, 10*time.Second)[0]
	if err := s.AbandonMessage(ctxFor(t, 5*time.Second), m, nil); err != nil {
		t.Fatal(err)
	}
	got := receiveN(t, s, 3, 10*time.Second)
	for i, g := range got {
		if g.MessageID != fmt.Sprintf("s-%d", i) {
			t.Fatalf("message %d: %s", i, g.MessageID)
		}
		if want := map[bool]uint32{true: 2, false: 1}[i == 0]; g.DeliveryCount != want {
			t.Errorf("%s DeliveryCount %d, want %d", g.MessageID, g.DeliveryCount, want)
		}
		if err := s.CompleteMessage(ctxFor(t, 5*time.Second), g, nil); err != nil {
			t.Fatal(err)
		}
	}
}

// TestNoSessionAvailable: AcceptNextSessionForQueue with nothing to accept
// ends with the SDK's timeout code, after the time the client asked for.
func TestNoSessionAvailable(t *testing.T) {
	p := needPeer(t)
	q := p.entity(t, map[string]any{"lock_duration_ms": 2000, "requires_session": true})
	c := newClient(t, p.conn)
	before := p.counters(t)
	start := time.Now()
	_, err := c.AcceptNextSessionForQueue(ctxFor(t, 2*time.Second), q, nil)
	if sbCode(err) != azservicebus.CodeTimeout {
		t.Fatalf("AcceptNextSessionForQueue on an empty queue: %v (code %q), want CodeTimeout", err, sbCode(err))
	}
	if d := time.Since(start); d < time.Second || d > 3*time.Second {
		t.Errorf("timed out after %v; the client asked for about 2 s", d)
	}
	if n := p.counters(t)["session_accept_timeouts"] - before["session_accept_timeouts"]; n != 1 {
		t.Errorf("session_accept_timeouts grew by %d", n)
	}
	// A waiting accept is served as soon as a session gets a message.
	done := make(chan *azservicebus.SessionReceiver, 1)
	errc := make(chan error, 1)
	go func() {
		s, err := c.AcceptNextSessionForQueue(ctxFor(t, 10*time.Second), q, nil)
		if err != nil {
			errc <- err
			return
		}
		done <- s
	}()
	waitFor(t, 5*time.Second, "the accept to wait at the peer", func() bool {
		var e struct {
			Waiting int `json:"waiting_session_receivers"`
		}
		p.must(t, "GET", "/entity?name="+url.QueryEscape(q), nil, &e)
		return e.Waiting == 1
	})
	sid := "late"
	m := textMsg("late-1", "x")
	m.SessionID = &sid
	send(t, c, q, m)
	select {
	case s := <-done:
		defer s.Close(context.Background())
		if s.SessionID() != "late" {
			t.Fatalf("accepted %q", s.SessionID())
		}
	case err := <-errc:
		t.Fatalf("waiting accept: %v", err)
	}
}

// TestSessionLockExpiry: an unrenewed session lock is lost: the link is
// detached and the messages come back with DeliveryCount+1.
func TestSessionLockExpiry(t *testing.T) {
	p := needPeer(t)
	q := p.entity(t, map[string]any{"lock_duration_ms": 1000, "requires_session": true})
	c := newClient(t, p.conn)
	sid := "x"
	m := textMsg("x-0", "x")
	m.SessionID = &sid
	send(t, c, q, m)
	before := p.counters(t)
	s, err := c.AcceptSessionForQueue(ctxFor(t, 10*time.Second), q, sid, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close(context.Background())
	got := receiveN(t, s, 1, 10*time.Second)[0]
	p.waitCounter(t, before, "session_lock_lost", 1, 10*time.Second)
	// The SDK treats the detach (session-lock-lost) as a link error and
	// retries after its 4 s default delay; a short ctx is enough to see
	// that completing fails.
	if err := s.CompleteMessage(ctxFor(t, time.Second), got, nil); err == nil {
		t.Fatal("completing after the session lock was lost succeeded")
	}
	pm := p.messages(t, q)
	if len(pm) != 1 || pm[0].DeliveryCount != 1 || pm[0].State != "available" {
		t.Fatalf("after the session lock expired: %+v", pm)
	}
	s2, err := c.AcceptSessionForQueue(ctxFor(t, 10*time.Second), q, sid, nil)
	if err != nil {
		t.Fatalf("re-accepting: %v", err)
	}
	defer s2.Close(context.Background())
	again := receiveN(t, s2, 1, 10*time.Second)[0]
	if again.DeliveryCount != 2 {
		t.Errorf("DeliveryCount %d after the session lock expired, want 2", again.DeliveryCount)
	}
}
