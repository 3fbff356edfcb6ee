package integration

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/Azure/go-amqp"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/amqpsub/amqpsub/amqpsub"
)

// The leak tests log in as this user, whose password is distinctive enough
// to look for in every log entry and error.
const (
	leakUser     = "leaktest"
	leakPassword = "Zq7leakCanary93xT"
)

// addLeakUser adds leakUser to the dedicated broker's users and role amq.
// The JAAS properties module of our login.config reloads the files when
// they change.
func addLeakUser(home string) error {
	users := filepath.Join(home, "etc", "artemis-users.properties")
	roles := filepath.Join(home, "etc", "artemis-roles.properties")
	u, err := os.ReadFile(users)
	if err != nil {
		return err
	}
	if !bytes.Contains(u, []byte("\n"+leakUser+" = ")) {
		u = append(u, []byte("\n"+leakUser+" = "+leakPassword+"\n")...)
		if err := os.WriteFile(users, u, 0o644); err != nil {
			return err
		}
	}
	r, err := os.ReadFile(roles)
	if err != nil {
		return err
	}
	lines := strings.Split(string(r), "\n")
	for i, l := range lines {
		if k, v, ok := strings.Cut(l, "="); ok && strings.TrimSpace(k) == "amq" && !strings.Contains(v, leakUser) {
			lines[i] = strings.TrimRight(l, " ") + "," + leakUser
		}
	}
	return os.WriteFile(roles, []byte(strings.Join(lines, "\n")), 0o644)
}

// consumeOne publishes one message to a fresh queue over plain AMQP on the
// dedicated broker and consumes it through connector; it returns Run's
// error, or nil once the message was handled and Run stopped.
func consumeOne(t *testing.T, b *faultBroker, connector amqpsub.Connector, opts ...amqpsub.Option) error {
	t.Helper()
	q := queueName(t)
	publishFast(t, dial(t, b.url), q, true, []msgSpec{{seq: 1}})
	var got atomic.Int64
	s, err := amqpsub.New(connector, q, amqpsub.HandlerFunc(func(ctx context.Context, d *amqpsub.Delivery) error {
		if seqOf(d) == 1 {
			got.Add(1)
		}
		return nil
	}), append([]amqpsub.Option{amqpsub.DialTimeout(10 * time.Second)}, opts...)...)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	errc := make(chan error, 1)
	go func() { errc <- s.Run(ctx) }()
	deadline := time.After(30 * time.Second)
	for got.Load() == 0 {
		select {
		case err := <-errc:
			return err
		case <-deadline:
			cancel()
			<-errc
			t.Fatal("no delivery within 30 s")
		case <-time.After(5 * time.Millisecond):
		}
	}
	cancel()
	if err := <-errc; err != nil {
		t.Fatalf("Run after a stop = %v", err)
	}
	return nil
}

// amqps with certificate verification: the test CA verifies the broker, the
// system roots do not.
func TestSecurityTLS(t *testing.T) {
	b := dedicatedBroker(t)
	tlsURL := "amqps://" + b.tlsAddr
	t.Run("verified with the test CA", func(t *testing.T) {
		err := consumeOne(t, b, amqpsub.Dial(tlsURL, &amqp.ConnOptions{TLSConfig: &tls.Config{RootCAs: b.roots}}))
		if err != nil {
			t.Fatalf("Run over amqps = %v", err)
		}
	})
	t.Run("SASL PLAIN over TLS", func(t *testing.T) {
		u := "amqps://amqpsub:amqpsub@" + b.tlsAddr
		err := consumeOne(t, b, amqpsub.Dial(u, &amqp.ConnOptions{TLSConfig: &tls.Config{RootCAs: b.roots}}))
		if err != nil {
			t.Fatalf("Run over amqps with SASL PLAIN = %v", err)
		}
	})
	for _, tc := range []struct {
		name string
		opts *amqp.ConnOptions
	}{
		{"system roots refuse the test CA", nil},
		{"system roots with a TLS config", &amqp.ConnOptions{TLSConfig: &tls.Config{}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			start := time.Now()
			err := consumeOne(t, b, amqpsub.Dial(tlsURL, tc.opts), amqpsub.DialTimeout(5*time.Second))
			t.Logf("after %v: %v", time.Since(start).Round(time.Millisecond), err)
			var unknown x509.UnknownAuthorityError
			var verify *tls.CertificateVerificationError
			if err == nil || !errors.As(err, &verify) || !errors.As(err, &unknown) {
				t.Fatalf("Run = %v, want a certificate verification error (unknown authority)", err)
			}
			if !strings.Contains(err.Error(), b.tlsAddr) {
				t.Errorf("the error does not name the broker: %v", err)
			}
		})
	}
}

// SASL PLAIN on the shared broker: the right password consumes, a wrong one
// ends Run with a fatal error, at once.
func TestSecuritySASL(t *testing.T) {
	url := artemisURL(t)
	hostPort := strings.TrimPrefix(url, "amqp://")
	q := queueName(t)
	publishFast(t, dial(t, url), q, true, []msgSpec{{seq: 1}})
	t.Run("right password", func(t *testing.T) {
		var got atomic.Int64
		s, err := amqpsub.New(amqpsub.Dial("amqp://amqpsub:amqpsub@"+hostPort, nil), q,
			amqpsub.HandlerFunc(func(context.Context, *amqpsub.Delivery) error { got.Add(1); return nil }),
			amqpsub.Logger(logger(t)))
		if err != nil {
			t.Fatal(err)
		}
		stop, wait := runSub(t, s)
		waitFor(t, 30*time.Second, "the message and the barrier", func() bool { return got.Load() == 2 })
		stop()
		if err := wait(); err != nil {
			t.Fatal(err)
		}
	})
	t.Run("wrong password", func(t *testing.T) {
		s, err := amqpsub.New(amqpsub.Dial("amqp://amqpsub:not-the-password@"+hostPort, nil), q,
			amqpsub.HandlerFunc(func(context.Context, *amqpsub.Delivery) error { return nil }),
			amqpsub.DialTimeout(5*time.Second), amqpsub.Logger(logger(t)))
		if err != nil {
			t.Fatal(err)
		}
		start := time.Now()
		err = s.Run(context.Background())
		took := time.Since(start)
		t.Logf("Run = %v after %v", err, took.Round(time.Millisecond))
		if err == nil || !amqpsub.IsFatal(err) {
			t.Fatalf("Run = %v, want a fatal error", err)
		}
		if took > 5*time.Second {
			t.Errorf("Run took %v to report a refused login", took)
		}
		if strings.Contains(err.Error(), "not-the-password") {
			t.Errorf("the password is in the error: %v", err)
		}
	})
}

// Credentials never appear in logs or errors: success and failure cases
// with a distinctive password, every log entry captured at debug level.
func TestSecurityNoCredentialLeak(t *testing.T) {
	b := dedicatedBroker(t)
	secrets := []string{leakPassword}
	core, logs := observer.New(zapcore.DebugLevel)
	log := zap.New(core)

	check := func(t *testing.T, what string, err error) {
		t.Helper()
		if err == nil {
			return
		}
		for _, text := range []string{err.Error(), fmt.Sprintf("%v", err), fmt.Sprintf("%+v", err)} {
			for _, s := range secrets {
				if strings.Contains(text, s) {
					t.Errorf("%s: the password is in the error: %s", what, text)
					return
				}
			}
		}
	}
	withPassword := func(hostPort, pw string) string {
		return fmt.Sprintf("amqp://%s:%s@%s", leakUser, pw, hostPort)
	}

	t.Run("success, a cut and a reconnect", func(t *testing.T) {
		p := newProxy(t, b.addr)
		q := queueName(t)
		const n = 200
		publishFast(t, dial(t, b.url), q, true, uniqueSeqs(n, 0))
		c := newTally(n)
		s, err := amqpsub.New(amqpsub.Dial(withPassword(p.ln.Addr().String(), leakPassword), nil), q, c.handler(),
			amqpsub.Credit(16), amqpsub.Backoff(50*time.Millisecond, 200*time.Millisecond), amqpsub.Logger(log))
		if err != nil {
			t.Fatal(err)
		}
		stop, wait := runSub(t, s)
		waitFor(t, 30*time.Second, "100 handled", func() bool { return c.distinct.Load() >= 100 })
		p.cut()
		// Let a few reconnect attempts fail (and log) before accepting.
		waitFor(t, 10*time.Second, "failed reconnect attempts", func() bool {
			return logs.FilterMessage("reconnect failed; trying again").Len() >= 2
		})
		p.acceptAgain()
		waitFor(t, 30*time.Second, "every message", c.all)
		stop()
		if err := wait(); err != nil {
			t.Fatal(err)
		}
		if s.Stats().Reconnects < 1 {
			t.Fatalf("no reconnect: %+v", s.Stats())
		}
	})

	runErr := func(t *testing.T, url string, opts *amqp.ConnOptions) error {
		t.Helper()
		s, err := amqpsub.New(amqpsub.Dial(url, opts), queueName(t),
			amqpsub.HandlerFunc(func(context.Context, *amqpsub.Delivery) error { return nil }),
			amqpsub.DialTimeout(5*time.Second), amqpsub.Logger(log))
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		err = s.Run(ctx)
		if err == nil {
			t.Fatalf("Run with %s succeeded", amqpsub.Dial(url, nil))
		}
		t.Logf("Run = %v", err)
		return err
	}
	closed := closedPort(t)
	for _, tc := range []struct {
		name string
		url  string
		opts *amqp.ConnOptions
	}{
		{"wrong password", withPassword(b.addr, leakPassword+"x"), nil},
		{"refused TCP connection", withPassword(closed, leakPassword), nil},
		{"TLS verification failure", fmt.Sprintf("amqps://%s:%s@%s", leakUser, leakPassword, b.tlsAddr), nil},
		{"unparsable address", withPassword("127.0.0.1:notaport", leakPassword), nil},
		// url.Error quotes the address: a '"' in it comes out escaped.
		{"unparsable address, a quote in the password", withPassword("127.0.0.1:notaport", leakPassword+`"q`), nil},
		{"percent-encoded password", withPassword(b.addr, leakPassword+"%21"), nil},
		{"unknown scheme", strings.Replace(withPassword(b.addr, leakPassword), "amqp:", "amqpx:", 1), nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			check(t, tc.name, runErr(t, tc.url, tc.opts))
		})
	}

	entries := logs.AllUntimed()
	if len(entries) == 0 {
		t.Fatal("no log entries captured")
	}
	for _, e := range entries {
		text := e.Message + " " + fmt.Sprint(e.ContextMap())
		for _, s := range secrets {
			if strings.Contains(text, s) {
				t.Errorf("the password is in a log entry: %s %s", e.Level, text)
			}
		}
	}
	t.Logf("%d log entries checked", len(entries))
}

// Tokens of 3 s: they are put again before they expire, for 18 s, and no
// link is detached for an expired token; a wrong key fails Run at once,
// naming the entity and not the key.
func TestServiceBusClaims(t *testing.T) {
	p := serviceBusPeer(t)
	t.Run("short-lived tokens are refreshed", func(t *testing.T) {
		// Tokens of 3 s (2 to 3 s once the expiry is truncated to the
		// second) are refreshed about every 1.25 s.
		const ttl = 3 * time.Second
		q := p.entity(t, map[string]any{"lock_duration_ms": 5000})
		key := connValue(p.conn, "SharedAccessKey")
		host := strings.TrimPrefix(connValue(p.conn, "Endpoint"), "sb://")
		c, err := amqpsub.ServiceBusWithToken("amqp://"+strings.TrimRight(host, "/"),
			amqpsub.SASTokenProvider(connValue(p.conn, "SharedAccessKeyName"), key, ttl))
		if err != nil {
			t.Fatal(err)
		}
		before := p.counters(t)
		var handled atomic.Int32
		s, _ := amqpsub.New(c, q, amqpsub.HandlerFunc(func(context.Context, *amqpsub.Delivery) error {
			handled.Add(1)
			return nil
		}), amqpsub.Logger(logger(t)))
		stop, wait := runSub(t, s)
		for i := range 6 { // a message every 3 s, for 18 s: 6 token lifetimes
			p.send(t, q, 1, "-start", fmt.Sprint(i))
			time.Sleep(ttl)
		}
		waitFor(t, 10*time.Second, "6 handled", func() bool { return handled.Load() == 6 })
		stop()
		if err := wait(); err != nil {
			t.Fatal(err)
		}
		after := p.counters(t)
		puts := after["put_token_ok"] - before["put_token_ok"]
		detached := after["links_detached_token_expired"] - before["links_detached_token_expired"]
		t.Logf("%d tokens put, %d links detached for an expired token; stats %v", puts, detached, s.Stats())
		if detached != 0 || s.Stats().LinksLost != 0 {
			t.Fatalf("%d links detached for an expired token, %d lost", detached, s.Stats().LinksLost)
		}
		if puts < 2*10 { // two audiences, refreshed about every 1.25 s for 18 s
			t.Fatalf("%d tokens put in 18 s, want the refreshes", puts)
		}
	})
	t.Run("a wrong key fails at once", func(t *testing.T) {
		q := p.entity(t, map[string]any{})
		const wrong = "V3JvbmdLZXlXcm9uZ0tleQ=="
		cs := strings.Replace(p.conn, "SharedAccessKey="+connValue(p.conn, "SharedAccessKey"), "SharedAccessKey="+wrong, 1)
		c, err := amqpsub.ServiceBus(cs)
		if err != nil {
			t.Fatal(err)
		}
		s, _ := amqpsub.New(c, q, amqpsub.HandlerFunc(func(context.Context, *amqpsub.Delivery) error { return nil }),
			amqpsub.Logger(logger(t)))
		start := time.Now()
		err = s.Run(context.Background())
		t.Logf("Run = %v (after %v)", err, time.Since(start).Round(time.Millisecond))
		if err == nil || !amqpsub.IsFatal(err) || !strings.Contains(err.Error(), q) || strings.Contains(err.Error(), wrong) {
			t.Fatalf("Run = %v: want a fatal error naming %s and not the key", err, q)
		}
		if time.Since(start) > 5*time.Second {
			t.Fatalf("Run took %v to fail", time.Since(start))
		}
	})
}

// One failed token refresh, while the token in place is still valid for
// half its life, is tried again: the connection, the link and the
// deliveries held on it are kept.
func TestServiceBusTokenRefreshFails(t *testing.T) {
	p := serviceBusPeer(t)
	q := p.fxEntity(t, map[string]any{"lock_duration_ms": 30000})
	endpoint, sas := p.tokenEndpoint(8 * time.Second)
	// Calls 1 and 2 claim the entity and its $management node; 3 is the
	// first refresh, 4 s later.
	tp := &tokenScript{TokenProvider: sas, fail: map[int]bool{3: true}}
	c, err := amqpsub.ServiceBusWithToken(endpoint, tp)
	if err != nil {
		t.Fatal(err)
	}
	var calls atomic.Int32
	s, _ := amqpsub.New(c, q, amqpsub.HandlerFunc(func(ctx context.Context, d *amqpsub.Delivery) error {
		calls.Add(1)
		select {
		case <-time.After(6 * time.Second): // spans the failed refresh
			return nil
		case <-ctx.Done():
			return context.Cause(ctx)
		}
	}), amqpsub.Workers(3), amqpsub.Logger(logger(t)))
	stop, wait := runSub(t, s)
	p.call(t, "POST", "/messages", map[string]any{"entity": q, "count": 3, "message_id_prefix": q}, nil)
	waitFor(t, 40*time.Second, "3 completed", func() bool { return p.info(t, q).Stats["completed"] == 3 })
	stop()
	if err := wait(); err != nil {
		t.Fatal(err)
	}
	st := s.Stats()
	t.Logf("%d Token calls, %d handler calls; stats %v", tp.calls(), calls.Load(), st)
	if st.LinksLost != 0 || calls.Load() != 3 {
		t.Fatalf("one failed refresh: %d links lost, %d handler calls for 3 messages", st.LinksLost, calls.Load())
	}
	if tp.calls() < 5 {
		t.Fatalf("%d Token calls: the failed refresh was not tried again", tp.calls())
	}
}
