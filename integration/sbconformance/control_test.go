package sbconformance

// The control API's faults, seen through the official client: what the
// library's tests will rely on.

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/Azure/azure-sdk-for-go/sdk/messaging/azservicebus"
	"github.com/Azure/go-amqp"
)

// TestRenewFaults: a renewal refused for one message id is CodeLockLost
// for that message only, and the message is redelivered at once; an
// unanswered renewal runs into the caller's deadline.
func TestRenewFaults(t *testing.T) {
	p := needPeer(t)
	q := p.entity(t, map[string]any{"lock_duration_ms": 5000})
	t.Cleanup(func() { _ = p.call("POST", "/faults/renew/clear", nil, nil) })
	c := newClient(t, p.conn)
	send(t, c, q, textMsg("keep", "x"), textMsg("lose", "x"), textMsg("hang", "x"))
	r, err := c.NewReceiverForQueue(q, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close(context.Background())
	ms := receiveN(t, r, 3, 10*time.Second)
	byID := map[string]*azservicebus.ReceivedMessage{}
	for _, m := range ms {
		byID[m.MessageID] = m
	}
	p.must(t, "POST", "/faults/renew", map[string]any{"message_ids": []string{"lose"}, "mode": "lost", "times": 1}, nil)
	p.must(t, "POST", "/faults/renew", map[string]any{"message_ids": []string{"hang"}, "mode": "timeout"}, nil)
	before := p.counters(t)

	if err := r.RenewMessageLock(ctxFor(t, 5*time.Second), byID["keep"], nil); err != nil {
		t.Fatalf("renewing keep: %v", err)
	}
	if err := r.RenewMessageLock(ctxFor(t, 5*time.Second), byID["lose"], nil); sbCode(err) != azservicebus.CodeLockLost {
		t.Fatalf("renewing lose: %v (code %q), want CodeLockLost", err, sbCode(err))
	}
	start := time.Now()
	err = r.RenewMessageLock(ctxFor(t, time.Second), byID["hang"], nil)
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("renewing hang: %v, want the caller's deadline", err)
	}
	if d := time.Since(start); d < 900*time.Millisecond {
		t.Errorf("the unanswered renewal ended after %v", d)
	}
	after := p.counters(t)
	if after["renew_lock_unanswered"]-before["renew_lock_unanswered"] < 1 {
		t.Errorf("renew_lock_unanswered did not grow")
	}
	// "lose" went back at once: the next receive gets it, count 2.
	m := receiveN(t, r, 1, 5*time.Second)[0]
	if m.MessageID != "lose" || m.DeliveryCount != 2 {
		t.Fatalf("after the refused renewal got %s (count %d), want lose (2)", m.MessageID, m.DeliveryCount)
	}
	for _, x := range []*azservicebus.ReceivedMessage{byID["keep"], byID["hang"], m} {
		if err := r.CompleteMessage(ctxFor(t, 5*time.Second), x, nil); err != nil {
			t.Fatalf("complete %s: %v", x.MessageID, err)
		}
	}
	if err := r.CompleteMessage(ctxFor(t, 5*time.Second), byID["lose"], nil); sbCode(err) != azservicebus.CodeLockLost {
		t.Fatalf("completing the first copy of lose: %v, want CodeLockLost", err)
	}
}

// TestSettleDelay: the peer holds each settling disposition back.
func TestSettleDelay(t *testing.T) {
	p := needPeer(t)
	q := p.entity(t, map[string]any{"lock_duration_ms": 5000})
	p.must(t, "POST", "/faults/settle-delay", map[string]any{"ms": 300}, nil)
	t.Cleanup(func() { _ = p.call("POST", "/faults/settle-delay", map[string]any{"ms": 0}, nil) })
	c := newClient(t, p.conn)
	send(t, c, q, textMsg("slow", "x"))
	r, err := c.NewReceiverForQueue(q, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close(context.Background())
	m := receiveN(t, r, 1, 10*time.Second)[0]
	start := time.Now()
	if err := r.CompleteMessage(ctxFor(t, 5*time.Second), m, nil); err != nil {
		t.Fatal(err)
	}
	if d := time.Since(start); d < 300*time.Millisecond || d > 2*time.Second {
		t.Fatalf("CompleteMessage took %v with a 300 ms settle delay", d)
	}
}

// TestForceDetach: the peer detaches the entity's receivers. The message
// lock outlives the link, so completing the message afterwards succeeds
// through the SDK's $management fallback (update-disposition) and it is
// not delivered again; the SDK reattaches and receives the next message.
func TestForceDetach(t *testing.T) {
	p := needPeer(t)
	q := p.entity(t, map[string]any{"lock_duration_ms": 5000})
	c := newClient(t, p.conn)
	send(t, c, q, textMsg("d-1", "x"))
	r, err := c.NewReceiverForQueue(q, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close(context.Background())
	m := receiveN(t, r, 1, 10*time.Second)[0]
	before := p.counters(t)
	var res struct {
		Detached int `json:"detached"`
	}
	p.must(t, "POST", "/faults/detach", map[string]any{"entity": q}, &res)
	if res.Detached != 1 {
		t.Fatalf("detached %d links, want 1", res.Detached)
	}
	if err := r.CompleteMessage(ctxFor(t, 10*time.Second), m, nil); err != nil {
		t.Fatalf("completing after the detach: %v (code %q), want success through update-disposition", err, sbCode(err))
	}
	after := p.counters(t)
	for name, want := range map[string]int{"update_disposition_requests": 1, "update_disposition_tokens": 1,
		"completed": 1, "locks_orphaned": 1, "redeliveries_link_closed": 0} {
		if got := after[name] - before[name]; got != want {
			t.Errorf("counter %s grew by %d, want %d", name, got, want)
		}
	}
	send(t, c, q, textMsg("d-2", "x"))
	again := receiveN(t, r, 1, 10*time.Second)[0]
	if again.MessageID != "d-2" || again.DeliveryCount != 1 {
		t.Fatalf("after the detach: %s count %d, want d-2 count 1 (d-1 must not come back)", again.MessageID, again.DeliveryCount)
	}
	if err := r.CompleteMessage(ctxFor(t, 5*time.Second), again, nil); err != nil {
		t.Fatal(err)
	}
	if e := p.info(t, q); e.Available != 0 || e.Locked != 0 {
		t.Fatalf("entity after both completions: %+v", e)
	}
}

// TestPeekAndReceiveAndDelete: $management peek, and receive-and-delete
// links (pre-settled deliveries).
func TestPeekAndReceiveAndDelete(t *testing.T) {
	p := needPeer(t)
	q := p.entity(t, map[string]any{"lock_duration_ms": 5000})
	c := newClient(t, p.conn)
	send(t, c, q, textMsg("p-1", "a"), textMsg("p-2", "b"))
	r, err := c.NewReceiverForQueue(q, &azservicebus.ReceiverOptions{ReceiveMode: azservicebus.ReceiveModeReceiveAndDelete})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close(context.Background())
	peeked, err := r.PeekMessages(ctxFor(t, 5*time.Second), 10, nil)
	if err != nil || len(peeked) != 2 || peeked[0].MessageID != "p-1" || *peeked[1].SequenceNumber != 2 {
		t.Fatalf("peek: %d messages, %v", len(peeked), err)
	}
	got := receiveN(t, r, 2, 10*time.Second)
	if got[0].MessageID != "p-1" || got[1].MessageID != "p-2" {
		t.Fatalf("received %s %s", got[0].MessageID, got[1].MessageID)
	}
	if e := p.info(t, q); e.Available != 0 || e.Locked != 0 {
		t.Fatalf("after receive-and-delete: %+v", e)
	}
}

// TestDeliveryFaults: the peer can send a short delivery tag and leave out
// x-opt-locked-until, for the library's bad-input tests.
func TestDeliveryFaults(t *testing.T) {
	p := needPeer(t)
	q := p.entity(t, map[string]any{"lock_duration_ms": 3000})
	t.Cleanup(func() { _ = p.call("POST", "/faults/delivery/clear", nil, nil) })
	p.must(t, "POST", "/faults/delivery", map[string]any{"entity": q, "tag_length": 8, "times": 1}, nil)
	p.must(t, "POST", "/faults/delivery", map[string]any{"entity": q, "omit_annotations": []string{"x-opt-locked-until"}, "times": 1}, nil)
	p.must(t, "POST", "/messages", map[string]any{"entity": q, "count": 3}, nil)
	conn := dial(t, p)
	aud := "amqp://" + endpointHost(t, p.conn) + "/" + q
	tok := sasToken(aud, connField(p.conn, "SharedAccessKeyName"), connField(p.conn, "SharedAccessKey"), time.Now().Add(time.Hour))
	if code := putToken(t, conn, "servicebus.windows.net:sastoken", aud, tok, "0"); code != 202 {
		t.Fatalf("put-token: %d", code)
	}
	ctx := ctxFor(t, 10*time.Second)
	s, err := conn.NewSession(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	r, err := s.NewReceiver(ctx, q, &amqp.ReceiverOptions{SettlementMode: amqp.ReceiverSettleModeSecond.Ptr(), Credit: 3})
	if err != nil {
		t.Fatal(err)
	}
	var ms []*amqp.Message
	for range 3 {
		m, err := r.Receive(ctx, nil)
		if err != nil {
			t.Fatal(err)
		}
		ms = append(ms, m)
	}
	if len(ms[0].DeliveryTag) != 8 {
		t.Errorf("first tag has %d bytes, want 8", len(ms[0].DeliveryTag))
	}
	if _, ok := ms[1].Annotations["x-opt-locked-until"]; ok || len(ms[1].DeliveryTag) != 16 {
		t.Errorf("second: locked-until present %v, tag %d bytes", ok, len(ms[1].DeliveryTag))
	}
	if _, ok := ms[2].Annotations["x-opt-locked-until"]; !ok || len(ms[2].DeliveryTag) != 16 {
		t.Errorf("third (no fault left) is not normal")
	}
	for _, m := range ms {
		if err := r.AcceptMessage(ctx, m); err != nil {
			t.Fatalf("accept: %v", err)
		}
	}
}
