package sbconformance

import (
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/base64"
	"fmt"
	"net/url"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/Azure/azure-sdk-for-go/sdk/messaging/azservicebus"
)

// connField returns a field of a connection string (case-insensitive key).
func connField(conn, key string) string {
	for _, part := range strings.Split(conn, ";") {
		k, v, ok := strings.Cut(part, "=")
		if ok && strings.EqualFold(strings.TrimSpace(k), key) {
			return strings.TrimSpace(v)
		}
	}
	return ""
}

// withField returns conn with one field set (added, or replaced);
// an empty value removes the field.
func withField(conn, key, value string) string {
	var out []string
	for _, part := range strings.Split(conn, ";") {
		k, _, ok := strings.Cut(part, "=")
		if part == "" || ok && strings.EqualFold(strings.TrimSpace(k), key) {
			continue
		}
		out = append(out, part)
	}
	if value != "" {
		out = append(out, key+"="+value)
	}
	return strings.Join(out, ";") + ";"
}

// sasToken builds a SAS token the way the Azure SDKs do: HMAC-SHA256 with
// the key string's bytes over the lower-cased, query-escaped audience, a
// newline and the expiry in Unix seconds.
func sasToken(audience, keyName, key string, expiry time.Time) string {
	aud := strings.ToLower(url.QueryEscape(audience))
	se := strconv.FormatInt(expiry.Unix(), 10)
	mac := hmac.New(sha256.New, []byte(key))
	mac.Write([]byte(aud + "\n" + se))
	sig := url.QueryEscape(base64.StdEncoding.EncodeToString(mac.Sum(nil)))
	return fmt.Sprintf("SharedAccessSignature sr=%s&sig=%s&se=%s&skn=%s", aud, sig, se, keyName)
}

// endpointHost returns host:port of the connection string's Endpoint.
func endpointHost(t *testing.T, conn string) string {
	u, err := url.Parse(connField(conn, "Endpoint"))
	if err != nil || u.Host == "" {
		t.Fatalf("connection string without a usable Endpoint: %v", err)
	}
	return u.Host
}

// TestWrongKeyFails: a wrong key, an unknown key name or an expired
// pre-made SAS: the peer answers put-token with 401 and the SDK reports
// CodeUnauthorizedAccess.
func TestWrongKeyFails(t *testing.T) {
	p := needPeer(t)
	q := p.entity(t, map[string]any{"lock_duration_ms": 5000})
	host := endpointHost(t, p.conn)
	expired := sasToken("amqp://"+host+"/"+q, connField(p.conn, "SharedAccessKeyName"), connField(p.conn, "SharedAccessKey"), time.Now().Add(-time.Minute))
	cases := map[string]string{
		"wrong key":      withField(p.conn, "SharedAccessKey", "not-the-key"),
		"unknown name":   withField(p.conn, "SharedAccessKeyName", "NoSuchRule"),
		"expired SAS":    withField(withField(withField(p.conn, "SharedAccessKey", ""), "SharedAccessKeyName", ""), "SharedAccessSignature", expired),
		"sas other path": withField(withField(withField(p.conn, "SharedAccessKey", ""), "SharedAccessKeyName", ""), "SharedAccessSignature", sasToken("amqp://"+host+"/other-entity", connField(p.conn, "SharedAccessKeyName"), connField(p.conn, "SharedAccessKey"), time.Now().Add(time.Hour))),
	}
	for name, conn := range cases {
		t.Run(strings.ReplaceAll(name, " ", "_"), func(t *testing.T) {
			before := p.counters(t)
			c := newClient(t, conn)
			r, err := c.NewReceiverForQueue(q, nil)
			if err != nil {
				t.Fatal(err)
			}
			start := time.Now()
			_, err = r.ReceiveMessages(ctxFor(t, 20*time.Second), 1, nil)
			if sbCode(err) != azservicebus.CodeUnauthorizedAccess {
				t.Fatalf("ReceiveMessages: %v (code %q), want CodeUnauthorizedAccess", err, sbCode(err))
			}
			if d := time.Since(start); d > 5*time.Second {
				t.Errorf("failing took %v; a refused token is fatal, not retried", d)
			}
			if n := p.counters(t)["put_token_failed"] - before["put_token_failed"]; n < 1 {
				t.Errorf("put_token_failed grew by %d", n)
			}
		})
	}
	// The right key still works.
	c := newClient(t, p.conn)
	send(t, c, q, textMsg("ok", "x"))
}

// TestPremadeSAS: a connection string with a SharedAccessSignature works
// until it expires.
func TestPremadeSAS(t *testing.T) {
	p := needPeer(t)
	q := p.entity(t, map[string]any{"lock_duration_ms": 5000})
	host := endpointHost(t, p.conn)
	// A token for the namespace covers every entity below it.
	tok := sasToken("amqp://"+host+"/", connField(p.conn, "SharedAccessKeyName"), connField(p.conn, "SharedAccessKey"), time.Now().Add(time.Hour))
	conn := withField(withField(withField(p.conn, "SharedAccessKey", ""), "SharedAccessKeyName", ""), "SharedAccessSignature", tok)
	c := newClient(t, conn)
	send(t, c, q, textMsg("sas-1", "x"))
	r, err := c.NewReceiverForQueue(q, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close(context.Background())
	m := receiveN(t, r, 1, 10*time.Second)[0]
	if err := r.CompleteMessage(ctxFor(t, 5*time.Second), m, nil); err != nil {
		t.Fatal(err)
	}
}

// TestShortLivedTokenDetachesLinks: the peer caps token lifetimes (control
// API) below the SDK's refresh interval; when the token runs out the peer
// detaches the entity's links with amqp:unauthorized-access and the SDK's
// receive fails with CodeUnauthorizedAccess.
func TestShortLivedTokenDetachesLinks(t *testing.T) {
	p := needPeer(t)
	p.restoreAuth(t)
	q := p.entity(t, map[string]any{"lock_duration_ms": 5000})
	p.must(t, "POST", "/auth", map[string]any{"max_token_lifetime_s": 2}, nil)
	c := newClient(t, p.conn)
	r, err := c.NewReceiverForQueue(q, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close(context.Background())
	before := p.counters(t)
	start := time.Now()
	_, err = r.ReceiveMessages(ctxFor(t, 10*time.Second), 1, nil)
	if sbCode(err) != azservicebus.CodeUnauthorizedAccess || !strings.Contains(err.Error(), "amqp:unauthorized-access") {
		t.Fatalf("ReceiveMessages across the token's expiry: %v (code %q), want CodeUnauthorizedAccess from a detach", err, sbCode(err))
	}
	if d := time.Since(start); d < time.Second || d > 4*time.Second {
		t.Errorf("the link went after %v; the token lived 2 s", d)
	}
	if n := p.counters(t)["links_detached_token_expired"] - before["links_detached_token_expired"]; n < 1 {
		t.Errorf("links_detached_token_expired grew by %d", n)
	}
	// With long tokens again, the SDK recovers on the next call.
	p.must(t, "POST", "/auth", map[string]any{"max_token_lifetime_s": nil}, nil)
	send(t, c, q, textMsg("after", "x"))
	m := receiveN(t, r, 1, 10*time.Second)[0]
	if err := r.CompleteMessage(ctxFor(t, 5*time.Second), m, nil); err != nil {
		t.Fatal(err)
	}
}
