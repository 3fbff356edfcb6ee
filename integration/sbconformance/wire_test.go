package sbconformance

// Wire-level checks with go-amqp (the library's own AMQP client) for what
// the SDK hides or cannot reach: the delivery-tag bytes and annotation
// types, JWT put-token, the CBS deadline, attaching without a token. They
// also pin what amqpsub will see on the wire.

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/Azure/go-amqp"
)

func dial(t *testing.T, p *peer) *amqp.Conn {
	t.Helper()
	conn, err := amqp.Dial(ctxFor(t, 5*time.Second), "amqp://"+endpointHost(t, p.conn), &amqp.ConnOptions{
		SASLType: amqp.SASLTypeAnonymous(),
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return conn
}

// putToken puts a token on $cbs and returns the reply's status code.
func putToken(t *testing.T, conn *amqp.Conn, typ, audience, token string, expiration any) int32 {
	t.Helper()
	ctx := ctxFor(t, 5*time.Second)
	s, err := conn.NewSession(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close(context.Background())
	reply := fmt.Sprintf("$cbs-reply-%d", nameSeq.Add(1))
	snd, err := s.NewSender(ctx, "$cbs", nil)
	if err != nil {
		t.Fatal(err)
	}
	rcv, err := s.NewReceiver(ctx, "$cbs", &amqp.ReceiverOptions{TargetAddress: reply, Credit: 10})
	if err != nil {
		t.Fatal(err)
	}
	id := fmt.Sprintf("req-%d", nameSeq.Add(1))
	err = snd.Send(ctx, &amqp.Message{
		Value:      token,
		Properties: &amqp.MessageProperties{MessageID: id, ReplyTo: &reply},
		ApplicationProperties: map[string]any{
			"operation": "put-token", "type": typ, "name": audience, "expiration": expiration,
		},
	}, nil)
	if err != nil {
		t.Fatal(err)
	}
	m, err := rcv.Receive(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	if m.Properties == nil || m.Properties.CorrelationID != id {
		t.Fatalf("reply correlation-id %v, want %s", m.Properties, id)
	}
	code, ok := m.ApplicationProperties["status-code"].(int32)
	if !ok {
		t.Fatalf("status-code %T %v, want int32", m.ApplicationProperties["status-code"], m.ApplicationProperties["status-code"])
	}
	return code
}

// TestWireDeliveryTagAndAnnotations pins what a go-amqp receiver sees.
func TestWireDeliveryTagAndAnnotations(t *testing.T) {
	p := needPeer(t)
	q := p.entity(t, map[string]any{"lock_duration_ms": 3000})
	p.must(t, "POST", "/messages", map[string]any{"entity": q, "count": 20}, nil)
	conn := dial(t, p)
	host := endpointHost(t, p.conn)
	aud := "amqp://" + host + "/" + q
	tok := sasToken(aud, connField(p.conn, "SharedAccessKeyName"), connField(p.conn, "SharedAccessKey"), time.Now().Add(time.Hour))
	// expiration as a timestamp (.NET) rather than a string (Go).
	if code := putToken(t, conn, "servicebus.windows.net:sastoken", aud, tok, time.Now().Add(time.Hour)); code != 202 {
		t.Fatalf("put-token: %d", code)
	}
	ctx := ctxFor(t, 10*time.Second)
	s, err := conn.NewSession(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	r, err := s.NewReceiver(ctx, q, &amqp.ReceiverOptions{
		SettlementMode: amqp.ReceiverSettleModeSecond.Ptr(), Credit: 20,
	})
	if err != nil {
		t.Fatal(err)
	}
	held := map[string]peerMessage{}
	msgs := make([]*amqp.Message, 0, 20)
	for range 20 {
		m, err := r.Receive(ctx, nil)
		if err != nil {
			t.Fatal(err)
		}
		msgs = append(msgs, m)
	}
	for _, pm := range p.messages(t, q) {
		held[pm.MessageID] = pm
	}
	highBit := false
	for _, m := range msgs {
		if len(m.DeliveryTag) != 16 {
			t.Fatalf("delivery tag %x: %d bytes, want 16", m.DeliveryTag, len(m.DeliveryTag))
		}
		for _, b := range m.DeliveryTag {
			highBit = highBit || b >= 0x80
		}
		// .NET Guid layout -> RFC 4122: swap 0-3, 4-5, 6-7.
		g := m.DeliveryTag
		rfc := []byte{g[3], g[2], g[1], g[0], g[5], g[4], g[7], g[6]}
		rfc = append(rfc, g[8:]...)
		tok := fmt.Sprintf("%x-%x-%x-%x-%x", rfc[0:4], rfc[4:6], rfc[6:8], rfc[8:10], rfc[10:])
		id := m.Properties.MessageID.(string)
		if held[id].LockToken != tok {
			t.Errorf("%s: tag %x -> %s, peer lock %s", id, g, tok, held[id].LockToken)
		}
		if _, ok := m.Annotations["x-opt-locked-until"].(time.Time); !ok {
			t.Errorf("x-opt-locked-until is %T", m.Annotations["x-opt-locked-until"])
		}
		if _, ok := m.Annotations["x-opt-sequence-number"].(int64); !ok {
			t.Errorf("x-opt-sequence-number is %T", m.Annotations["x-opt-sequence-number"])
		}
		if _, ok := m.Annotations["x-opt-enqueued-time"].(time.Time); !ok {
			t.Errorf("x-opt-enqueued-time is %T", m.Annotations["x-opt-enqueued-time"])
		}
		if m.Header == nil || m.Header.DeliveryCount != 0 {
			t.Errorf("header %+v, want delivery-count 0", m.Header)
		}
		if err := r.AcceptMessage(ctx, m); err != nil {
			t.Fatalf("accept: %v", err)
		}
	}
	if !highBit {
		t.Logf("no tag byte >= 0x80 in 20 tags: the peer runs with 7-bit (ascii7) tags")
	}
	var h struct {
		TagMode string `json:"tag_mode"`
	}
	p.must(t, "GET", "/health", nil, &h)
	t.Logf("peer tag mode %s", h.TagMode)
}

// TestWireAttachWithoutToken: entity links need a token first.
func TestWireAttachWithoutToken(t *testing.T) {
	p := needPeer(t)
	q := p.entity(t, map[string]any{"lock_duration_ms": 3000})
	conn := dial(t, p)
	ctx := ctxFor(t, 5*time.Second)
	s, err := conn.NewSession(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	_, err = s.NewReceiver(ctx, q, nil)
	var amqpErr *amqp.Error
	if !asAMQPError(err, &amqpErr) || amqpErr.Condition != amqp.ErrCondUnauthorizedAccess {
		t.Fatalf("attach without a token: %v, want amqp:unauthorized-access", err)
	}
	_, err = s.NewReceiver(ctx, "no-such-queue-at-all", nil)
	if !asAMQPError(err, &amqpErr) || (amqpErr.Condition != amqp.ErrCondUnauthorizedAccess && amqpErr.Condition != amqp.ErrCondNotFound) {
		t.Fatalf("attach to a missing entity: %v", err)
	}
}

// TestWireJWT: a configured JWT is accepted (type jwt); any other is 401.
func TestWireJWT(t *testing.T) {
	p := needPeer(t)
	p.restoreAuth(t)
	q := p.entity(t, map[string]any{"lock_duration_ms": 3000})
	claims, _ := json.Marshal(map[string]any{"aud": "https://servicebus.azure.net", "exp": time.Now().Add(2 * time.Second).Unix()})
	jwt := "eyJhbGciOiJub25lIn0." + base64.RawURLEncoding.EncodeToString(claims) + ".sig"
	p.must(t, "POST", "/auth", map[string]any{"jwt_tokens": []string{jwt}}, nil)
	conn := dial(t, p)
	aud := "amqp://" + endpointHost(t, p.conn) + "/" + q
	if code := putToken(t, conn, "jwt", aud, "some-other-jwt", "0"); code != 401 {
		t.Fatalf("unknown JWT: %d, want 401", code)
	}
	if code := putToken(t, conn, "jwt", aud, jwt, fmt.Sprint(time.Now().Add(2*time.Second).Unix())); code != 202 {
		t.Fatalf("configured JWT: %d, want 202", code)
	}
	ctx := ctxFor(t, 10*time.Second)
	s, err := conn.NewSession(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	r, err := s.NewReceiver(ctx, q, &amqp.ReceiverOptions{SettlementMode: amqp.ReceiverSettleModeSecond.Ptr()})
	if err != nil {
		t.Fatalf("attach with the JWT: %v", err)
	}
	// The JWT's exp is 2 s away: the link is detached when it passes.
	_, err = r.Receive(ctx, nil)
	var amqpErr *amqp.Error
	if !asAMQPError(err, &amqpErr) || amqpErr.Condition != amqp.ErrCondUnauthorizedAccess {
		t.Fatalf("receive across the JWT's expiry: %v, want a detach with amqp:unauthorized-access", err)
	}
}

// TestWireCBSDeadline: a connection that puts no token is closed.
func TestWireCBSDeadline(t *testing.T) {
	p := needPeer(t)
	p.restoreAuth(t)
	p.must(t, "POST", "/auth", map[string]any{"cbs_deadline_s": 1}, nil)
	before := p.counters(t)
	start := time.Now()
	conn := dial(t, p)
	select {
	case <-conn.Done():
	case <-time.After(5 * time.Second):
		t.Fatal("the connection without a token is still open after 5 s")
	}
	if d := time.Since(start); d < 900*time.Millisecond {
		t.Errorf("closed after %v, before the 1 s deadline", d)
	}
	if err := conn.Err(); err == nil || !strings.Contains(err.Error(), "unauthorized-access") {
		t.Errorf("connection error %v, want amqp:unauthorized-access", err)
	}
	if n := p.counters(t)["connections_closed_no_token"] - before["connections_closed_no_token"]; n != 1 {
		t.Errorf("connections_closed_no_token grew by %d", n)
	}
}
