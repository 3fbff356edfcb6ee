package amqpsub_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/Azure/go-amqp"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/amqpsub/amqpsub/amqpsub"
	"github.com/amqpsub/amqpsub/internal/wire"
)

var nop = amqpsub.HandlerFunc(func(context.Context, *amqpsub.Delivery) error { return nil })

// closedAddr returns a local address nothing listens on: connections to it
// are refused.
func closedAddr(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	return addr
}

// silentAddr returns a local address that accepts connections and never
// answers.
func silentAddr(t *testing.T) string { return acceptAll(t, nil) }

// acceptAll returns a local address that accepts every connection and
// hands each to serve on a goroutine of its own (none: it holds them); the
// connections are closed, and the goroutines waited for, when the test ends.
func acceptAll(t *testing.T, serve func(net.Conn)) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	wg.Go(func() {
		var held []net.Conn
		defer func() {
			for _, c := range held {
				c.Close()
			}
		}()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			held = append(held, c)
			if serve != nil {
				wg.Go(func() { serve(c) })
			}
		}
	})
	t.Cleanup(func() { ln.Close(); wg.Wait() })
	return ln.Addr().String()
}

func TestDialFailoverRejectsBadInput(t *testing.T) {
	for _, tc := range []struct {
		name string
		urls []string
		want []string // in the error
	}{
		{"nil", nil, []string{"no address"}},
		{"empty", []string{}, []string{"no address"}},
		{"an empty URL", []string{"amqp://h1", ""}, []string{"urls[1]", "empty"}},
		{"unparsable", []string{"amqp://alice:s3cr3t%zz@h1:5672"}, []string{`urls[0] ("amqp://alice:xxxxx@h1:5672")`, "not a URL"}},
		{"unparsable port", []string{"amqp://h1", "amqp://alice:s3cr3t@h2:56x2"}, []string{`urls[1] ("amqp://alice:xxxxx@h2:56x2")`, "not a URL"}},
		{"scheme", []string{"http://alice:s3cr3t@h1"}, []string{`urls[0] ("http://alice@h1")`, `unsupported scheme "http"`}},
		{"no host", []string{"amqp:///q"}, []string{"urls[0]", "no host"}},
		{"each bad entry", []string{"", "amqp://h1", "amqps://"}, []string{"urls[0]", "urls[2]"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c, err := amqpsub.DialFailover(tc.urls, nil)
			if !errors.Is(err, amqpsub.ErrInvalidOption) || c != nil {
				t.Fatalf("DialFailover = %v, %v; want an error wrapping ErrInvalidOption", c, err)
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q does not say %q", err, w)
				}
			}
			if strings.Contains(err.Error(), "s3cr3t") || strings.Contains(err.Error(), "%zz") {
				t.Errorf("error %q holds (part of) the password", err)
			}
		})
	}
	c, err := amqpsub.DialFailover([]string{"amqp://alice:s3cr3t@h1", "amqps://h2:5671", "amqp+ssl://h3", "//h4:5672"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if got := c.String(); got != "[amqp://alice@h1, amqps://h2:5671, amqp+ssl://h3, //h4:5672]" {
		t.Fatalf("String() = %q", got)
	}
}

// No address answers: Run's error names each one tried and why, without
// the password, wraps each cause, and comes within DialTimeout per address
// (each has its own: two silent ones take two).
func TestDialFailoverNoAddressAnswers(t *testing.T) {
	const dialTimeout = 250 * time.Millisecond
	refused, silent1, silent2 := closedAddr(t), silentAddr(t), silentAddr(t)
	c, err := amqpsub.DialFailover([]string{"amqp://alice:s3cr3t@" + refused, "amqp://" + silent1, "amqp://" + silent2}, nil)
	if err != nil {
		t.Fatal(err)
	}
	s, err := amqpsub.New(c, "q", nop, amqpsub.DialTimeout(dialTimeout))
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	err = s.Run(context.Background())
	took := time.Since(start)
	if err == nil {
		t.Fatal("Run connected to nothing")
	}
	t.Log(err)
	if took < 2*dialTimeout || took > 3*dialTimeout+2*time.Second {
		t.Errorf("Run took %v; want 2 × DialTimeout (%v) for the two silent addresses, give or take", took, dialTimeout)
	}
	for _, want := range []string{"amqp://alice@" + refused + ": ", "amqp://" + silent1 + ": context deadline exceeded", "amqp://" + silent2 + ": context deadline exceeded"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error does not say %q", want)
		}
	}
	if strings.Contains(err.Error(), "s3cr3t") {
		t.Errorf("error %q holds the password", err)
	}
	if !errors.Is(err, syscall.ECONNREFUSED) || !errors.Is(err, context.DeadlineExceeded) || amqpsub.IsFatal(err) {
		t.Errorf("errors.Is(ECONNREFUSED) %v, errors.Is(DeadlineExceeded) %v, IsFatal %v",
			errors.Is(err, syscall.ECONNREFUSED), errors.Is(err, context.DeadlineExceeded), amqpsub.IsFatal(err))
	}
}

// The first address refuses the TCP connection: the subscriber runs on the
// second, and its log says so.
func TestDialFailoverRunsOnTheNextAddress(t *testing.T) {
	p := newPeer(t, false)
	dead := closedAddr(t)
	c, err := amqpsub.DialFailover([]string{"amqp://" + dead, "amqp://alice:s3cr3t@" + p.addr()}, nil)
	if err != nil {
		t.Fatal(err)
	}
	core, logs := observer.New(zap.InfoLevel)
	s, _ := amqpsub.New(c, "q", nop, amqpsub.DialTimeout(5*time.Second), amqpsub.Logger(zap.New(core)))
	cancel, errc := run(t, s)
	waitAttached(t, p, errc)
	cancel()
	if err := <-errc; err != nil {
		t.Fatal(err)
	}
	if st := s.Stats(); st.Links != 1 || p.accepted.Load() != 1 {
		t.Fatalf("links %d, peer accepted %d", st.Links, p.accepted.Load())
	}
	attached := logs.FilterMessage("attached").All()
	if len(attached) != 1 || attached[0].ContextMap()["broker"] != "amqp://alice@"+p.addr() {
		t.Fatalf("attach log lines %+v; want one naming amqp://alice@%s", attached, p.addr())
	}
	// The dead address is not passed over in silence.
	past := logs.FilterMessage("connected past addresses that did not answer").All()
	if len(past) != 1 || past[0].Level != zap.WarnLevel || !strings.Contains(past[0].ContextMap()["error"].(string), dead) {
		t.Fatalf("log lines about the dead address %+v; want one warning naming %s", past, dead)
	}
}

// After a lost connection the subscriber reconnects to the address after
// the one it was on, round the end of the list, refused addresses skipped
// within the pass; EventReconnected names the address in use.
func TestDialFailoverRotatesAfterALostConnection(t *testing.T) {
	b, c := newPeer(t, false), newPeer(t, false)
	conn, err := amqpsub.DialFailover([]string{"amqp://" + closedAddr(t), "amqp://" + b.addr(), "amqp://" + c.addr()}, nil)
	if err != nil {
		t.Fatal(err)
	}
	reconnected := make(chan string, 4)
	s, _ := amqpsub.New(conn, "q", nop, amqpsub.DialTimeout(5*time.Second),
		amqpsub.Backoff(time.Millisecond, time.Millisecond),
		amqpsub.OnEvent(func(e amqpsub.Event) {
			if e.Kind == amqpsub.EventReconnected {
				reconnected <- e.Broker
			}
		}))
	cancel, errc := run(t, s)
	defer cancel()
	waitAttached(t, b, errc) // the first refused
	for _, step := range []struct {
		drop, next *peer
	}{
		{b, c}, // the one after b
		{c, b}, // round the end: the first, refused, then b
	} {
		step.drop.drop()
		waitAttached(t, step.next, errc)
		select {
		case got := <-reconnected:
			if want := "amqp://" + step.next.addr(); got != want {
				t.Fatalf("reconnected to %s, want %s", got, want)
			}
		case <-time.After(10 * time.Second):
			t.Fatal("no EventReconnected")
		}
	}
	cancel()
	if err := <-errc; err != nil {
		t.Fatal(err)
	}
	if st := s.Stats(); st.Links != 3 || st.Reconnects != 2 || b.accepted.Load() != 2 || c.accepted.Load() != 1 {
		t.Fatalf("stats %+v; b accepted %d, c %d", st, b.accepted.Load(), c.accepted.Load())
	}
}

// An address that refuses the credentials ends Run, the others untried: on
// the first connect, and on a reconnect.
func TestDialFailoverFatalErrorEndsRun(t *testing.T) {
	t.Run("first connect", func(t *testing.T) {
		refuser, good := newPeer(t, true), newPeer(t, false)
		c, _ := amqpsub.DialFailover([]string{"amqp://alice:s3cr3t@" + refuser.addr(), "amqp://" + good.addr()}, nil)
		s, _ := amqpsub.New(c, "q", nop, amqpsub.DialTimeout(5*time.Second))
		err := s.Run(context.Background())
		var se *wire.SASLError
		if !errors.As(err, &se) || se.Code != wire.SASLAuth || !amqpsub.IsFatal(err) {
			t.Fatalf("Run = %v; want the refusal, fatal", err)
		}
		if strings.Contains(err.Error(), "s3cr3t") || !strings.Contains(err.Error(), "amqp://alice@"+refuser.addr()) ||
			!strings.Contains(err.Error(), "(1 more not tried)") {
			t.Fatalf("Run = %q: want the address without the password, and the one left", err)
		}
		if good.accepted.Load() != 0 {
			t.Fatal("the address after the refusal was dialed")
		}
	})
	t.Run("reconnect", func(t *testing.T) {
		good, refuser := newPeer(t, false), newPeer(t, true)
		c, _ := amqpsub.DialFailover([]string{"amqp://" + good.addr(), "amqp://alice:s3cr3t@" + refuser.addr()}, nil)
		s, _ := amqpsub.New(c, "q", nop, amqpsub.DialTimeout(5*time.Second), amqpsub.Backoff(time.Millisecond, time.Millisecond))
		_, errc := run(t, s)
		waitAttached(t, good, errc)
		good.drop()
		var err error
		select {
		case err = <-errc:
		case <-time.After(10 * time.Second):
			t.Fatal("Run did not end")
		}
		var se *wire.SASLError
		if !errors.Is(err, amqpsub.ErrLinkLost) || !errors.As(err, &se) || strings.Contains(err.Error(), "s3cr3t") {
			t.Fatalf("Run = %v; want ErrLinkLost and the refusal", err)
		}
		if good.accepted.Load() != 1 {
			t.Fatalf("good accepted %d: the pass went on after the refusal", good.accepted.Load())
		}
	})
}

// waitAttached waits for a receiver to attach on p, failing the test if
// Run returns first.
func waitAttached(t *testing.T, p *peer, errc <-chan error) {
	t.Helper()
	select {
	case <-p.attached:
	case err := <-errc:
		t.Fatalf("Run returned before attaching to %s: %v", p.addr(), err)
	case <-time.After(10 * time.Second):
		t.Fatalf("no receiver attached to %s", p.addr())
	}
}

// A DialFailover that cannot attach at the start names, in Run's error,
// every address and why it failed, also those that answered but could not
// attach, each tried once.
func TestFirstAttachErrorNamesEveryAddress(t *testing.T) {
	a, b := muteAfterOpen(t), muteAfterOpen(t)
	c, err := amqpsub.DialFailover([]string{"amqp://" + a, "amqp://" + b}, nil)
	if err != nil {
		t.Fatal(err)
	}
	s, _ := amqpsub.New(c, "q", nop, amqpsub.DialTimeout(200*time.Millisecond))
	t0 := time.Now()
	err = s.Run(context.Background())
	t.Logf("Run after %v: %v", time.Since(t0).Round(time.Millisecond), err)
	if err == nil {
		t.Fatal("Run = nil")
	}
	for _, addr := range []string{a, b} {
		if !strings.Contains(err.Error(), addr) {
			t.Errorf("Run's error does not name %s", addr)
		}
	}
}

// muteAfterOpen returns the address of a broker that opens AMQP
// connections and then answers nothing (no begin): one that is starting,
// overloaded, or a node that takes connections but cannot serve the queue.
func muteAfterOpen(t *testing.T) string {
	t.Helper()
	return acceptAll(t, func(c net.Conn) {
		hdr := make([]byte, 8)
		if _, err := io.ReadFull(c, hdr); err != nil {
			return
		}
		if write(c, peerAMQPHeader) != nil {
			return
		}
		if _, _, err := readPeerFrame(c); err != nil { // open
			return
		}
		if write(c, peerFrame(0, 0, described(0x10, list8(str8("mute"))))) != nil {
			return
		}
		_, _ = io.Copy(io.Discard, c)
	})
}

// On the first connect, an address that opens the connection but never
// opens the session is passed over: the good address after it serves the
// subscriber, and Run does not end with the first one's error.
func TestFailoverFirstAttachMovesOn(t *testing.T) {
	good := newPeer(t, false)
	c, err := amqpsub.DialFailover([]string{"amqp://" + muteAfterOpen(t), "amqp://" + good.addr()}, nil)
	if err != nil {
		t.Fatal(err)
	}
	s, _ := amqpsub.New(c, "q", nop, amqpsub.DialTimeout(300*time.Millisecond))
	cancel, errc := run(t, s)
	defer cancel()
	select {
	case <-good.attached:
		cancel()
		<-errc
	case err := <-errc:
		t.Fatalf("Run = %v; the second address (accepted %d connections) was never tried", err, good.accepted.Load())
	case <-time.After(10 * time.Second):
		t.Fatal("neither")
	}
}

// A password with an unescaped '/' or '?' after a numeric prefix (such as
// 2024/Spring) makes the URL parse with the user name as the host and the
// password as the port and path. DialFailover refuses it, and Dial's
// String and Run's error never show the password.
func TestPasswordThatParsesAsAPortIsNotShown(t *testing.T) {
	const raw = "amqp://alice:2024/Spring@127.0.0.1:5672"
	if _, err := amqpsub.DialFailover([]string{raw}, nil); err == nil || strings.Contains(err.Error(), "Spring") {
		t.Fatalf("DialFailover = %v; want an error without the password", err)
	}
	c := amqpsub.Dial(raw, nil)
	s, _ := amqpsub.New(c, "q", nop, amqpsub.DialTimeout(200*time.Millisecond))
	err := s.Run(context.Background())
	t.Logf("String() %q; Run: %v", c.String(), err)
	if strings.Contains(c.String(), "Spring") || err != nil && strings.Contains(err.Error(), "Spring") {
		t.Fatalf("the password is shown: String() %q, Run: %v", c.String(), err)
	}
}

// An address whose scheme was left out (user:password@host:port,
// or amqp: without the //) parses as scheme + opaque, with no user info for
// the redaction to take out: DialFailover refuses it, and neither its error
// nor Dial's String nor Run's error shows the password.
func TestPasswordOfAnAddressWithoutSlashesIsNotShown(t *testing.T) {
	const secret = "s3cr3tPW"
	for _, raw := range []string{
		"alice:" + secret + "@127.0.0.1:1",          // scheme left out
		"amqp:alice:" + secret + "@127.0.0.1:1",     // // left out
		"amqps:alice:" + secret + "@127.0.0.1:1",    // // left out
		"amqp:/alice:" + secret + "%zz@127.0.0.1:1", // one / and a bad escape: unparsable, no // to find the password by
	} {
		_, err := amqpsub.DialFailover([]string{raw}, nil)
		if err == nil {
			t.Errorf("%s: DialFailover accepted it", raw)
		} else if strings.Contains(err.Error(), secret) {
			t.Errorf("DialFailover error shows the password: %v", err)
		}
		c := amqpsub.Dial(raw, nil)
		if strings.Contains(c.String(), secret) {
			t.Errorf("Dial(%q).String() = %q shows the password", raw, c.String())
		}
		if strings.HasPrefix(raw, "alice:") { // runs no dial: the scheme is refused first
			s, err := amqpsub.New(c, "q", amqpsub.HandlerFunc(func(context.Context, *amqpsub.Delivery) error { return nil }),
				amqpsub.DialTimeout(200*time.Millisecond))
			if err != nil {
				t.Fatal(err)
			}
			if err := s.Run(context.Background()); err != nil && strings.Contains(err.Error(), secret) {
				t.Errorf("Run's error shows the password: %v", err)
			}
		}
	}
}

// An '@' written %40 in a path is not taken for a misplaced credential.
func TestEscapedAtInAPathIsAccepted(t *testing.T) {
	if _, err := amqpsub.DialFailover([]string{"amqp://u:p@host:5672/%40"}, nil); err != nil {
		t.Fatalf("DialFailover refused a valid URL: %v", err)
	}
	if _, err := amqpsub.DialFailover([]string{"amqp://u:p/w@host:5672"}, nil); err == nil {
		t.Fatal("DialFailover took a password with an unescaped '/'")
	}
}

// An address that does not parse is quoted whole in the error: the password
// in it is scrubbed all the same.
func TestUnparsableAddressHidesThePassword(t *testing.T) {
	s, _ := amqpsub.New(amqpsub.Dial("amqp://alice:s3cr3t%zz@127.0.0.1:1", nil), "q",
		amqpsub.HandlerFunc(func(context.Context, *amqpsub.Delivery) error { return nil }))
	err := s.Run(context.Background())
	// Not a fragment of it either: url.Parse's error quotes the password
	// partly decoded ("%zz"), where scrubbing cannot find it.
	if err == nil || strings.Contains(err.Error(), "s3cr3t") || strings.Contains(err.Error(), "%zz") {
		t.Fatalf("Run = %v: want an error without the password", err)
	}
}

func TestUnreachableBrokerNamesTheAddressButNotTheSecret(t *testing.T) {
	s, _ := amqpsub.New(amqpsub.Dial("amqp://alice:s3cr3t-pw@127.0.0.1:1", nil), "q",
		amqpsub.HandlerFunc(func(context.Context, *amqpsub.Delivery) error { return nil }),
		amqpsub.DialTimeout(3*time.Second))
	start := time.Now()
	err := s.Run(context.Background())
	if err == nil {
		t.Fatal("Run connected to nothing")
	}
	if time.Since(start) > 3*time.Second+500*time.Millisecond {
		t.Fatalf("Run took %v, past the dial timeout", time.Since(start))
	}
	if !strings.Contains(err.Error(), "127.0.0.1:1") || strings.Contains(err.Error(), "s3cr3t-pw") {
		t.Fatalf("error %q: want the address, not the password", err)
	}
}

// A URL without credentials offers SASL ANONYMOUS (RabbitMQ 4 takes no
// client without SASL), one with credentials PLAIN.
func TestDialOffersAnonymousWithoutCredentials(t *testing.T) {
	for _, tc := range []struct{ url, mech string }{
		{"amqp://%s", "ANONYMOUS"},
		{"amqp://alice:s3cr3t@%s", "PLAIN"},
	} {
		p := newPeer(t, false)
		s, err := amqpsub.New(amqpsub.Dial(fmt.Sprintf(tc.url, p.addr()), nil), "q", nop, amqpsub.DialTimeout(5*time.Second))
		if err != nil {
			t.Fatal(err)
		}
		cancel, errc := run(t, s)
		waitAttached(t, p, errc)
		cancel()
		if err := <-errc; err != nil {
			t.Fatal(err)
		}
		select {
		case m := <-p.mechs:
			if m != tc.mech {
				t.Errorf("%s: mechanism %s, want %s", tc.url, m, tc.mech)
			}
		default:
			t.Errorf("%s: no SASL offered, want %s", tc.url, tc.mech)
		}
	}
}

// A broker that answers a client without SASL with the SASL header gets an
// error that says what to do, not go-amqp's protocol header numbers alone;
// so does one that does not take the ANONYMOUS that Dial offers.
func TestHandshakeErrorsSayWhatToDo(t *testing.T) {
	p := newPeer(t, false)
	p.saslOnly = true
	c, err := amqp.Dial(t.Context(), "amqp://"+p.addr(), nil) // no SASL
	if err == nil {
		c.Close()
		t.Fatal("a dial without SASL succeeded")
	}
	if got := amqpsub.HandshakeHint(err, false, false).Error(); !strings.Contains(got, "the broker requires SASL: give user:password@ in the URL") {
		t.Fatalf("error %q says nothing of SASL", got)
	}
	if !errors.Is(amqpsub.HandshakeHint(err, false, false), err) {
		t.Fatal("the hint does not wrap go-amqp's error")
	}
	none := errors.New("no supported auth mechanism ([PLAIN])") // go-amqp's words
	if got := amqpsub.HandshakeHint(none, true, false).Error(); !strings.Contains(got, "SASL ANONYMOUS was offered, which the broker does not take") {
		t.Fatalf("error %q does not say that ANONYMOUS was refused", got)
	}
	if got := amqpsub.HandshakeHint(none, false, true); got != none {
		t.Fatalf("with credentials given, the error is changed: %v", got)
	}
}
