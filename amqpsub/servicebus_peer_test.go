//go:build peer

package amqpsub

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/Azure/go-amqp"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/amqpsub/amqpsub/internal/driver/servicebus"
	"github.com/amqpsub/amqpsub/internal/wait"
)

// Service Bus against the scripted Service Bus peer (integration/sbpeer),
// for the internals a black-box test cannot reach: session consumers
// (connections of idle slots, the session filter's descriptor, a named
// session locked elsewhere, the order of a session whose link is lost
// while one of its handlers runs, an idle session's release), a
// $management link that dies under held locks, a release sent by lock
// token, and a server that is not Service Bus (Artemis). They need the
// peer (AMQPSUB_SBPEER_CONN, AMQPSUB_SBPEER_CONTROL) and Artemis
// (AMQPSUB_ARTEMIS_URL), and are built only with the peer tag, so that the
// unit tests of the package need no server: make test runs them in its
// integration stage (go test -tags peer ./amqpsub).

// counter returns one of the peer's global counters (GET /counters).
func (p *sbTestPeer) counter(t *testing.T, name string) int {
	t.Helper()
	n, _ := p.call(t, "GET", "/counters", nil)[name].(float64)
	return int(n)
}

// runSessions runs s until the test ends, and fails the test if Run
// returns an error.
func runSessions(t *testing.T, s *Subscriber) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- s.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("Run: %v", err)
			}
		case <-time.After(30 * time.Second):
			t.Error("Run did not return within 30 s of the stop")
		}
	})
}

// Idle slots on an empty session queue wait for a session on the
// connection they have: every com.microsoft:timeout of the service is
// answered by a new attach there, and no connection is opened after the
// first one of each slot. AMQPSUB_SESSION_IDLE_WINDOW=60s runs it for that
// long at the default DialTimeout (the service then waits 5 s per attach)
// and logs the connections opened in the window.
func TestSessionIdleSlotsKeepTheirConnections(t *testing.T) {
	p := sbTestPeerOrSkip(t)
	q := p.entity(t, map[string]any{"requires_session": true})
	const slots = 4
	opts := []Option{Sessions(slots), Logger(sbTestLog(t))}
	window, err := time.ParseDuration(os.Getenv("AMQPSUB_SESSION_IDLE_WINDOW"))
	if err != nil || window <= 0 {
		// A short accept timeout (DialTimeout/2: the peer answers 50 ms
		// early), for many timeouts in little time.
		window = 0
		opts = append(opts, DialTimeout(time.Second))
	}
	c, err := ServiceBus(p.conn)
	if err != nil {
		t.Fatal(err)
	}
	s, err := New(c, q, HandlerFunc(func(context.Context, *Delivery) error { return nil }), opts...)
	if err != nil {
		t.Fatal(err)
	}
	// Connections are counted for q alone: other tests connect to the same peer.
	conns0, timeouts0 := p.stat(t, q, "connections"), p.counter(t, "session_accept_timeouts")
	runSessions(t, s)
	timeouts := func() int { return p.counter(t, "session_accept_timeouts") - timeouts0 }
	// Each slot has connected and been told "no session" at least once.
	waitUntil(t, 30*time.Second, "a timeout per slot", func() bool { return timeouts() >= slots })
	first := p.stat(t, q, "connections") - conns0
	began, t0 := time.Now(), timeouts()
	if window > 0 {
		time.Sleep(window) // a measurement of a wall-clock minute, not a wait for an event
	} else {
		// Three more timeouts per slot.
		waitUntil(t, 30*time.Second, "three more timeouts per slot", func() bool { return timeouts() >= t0+3*slots })
	}
	elapsed, n := time.Since(began), timeouts()-t0
	opened := p.stat(t, q, "connections") - conns0 - first
	t.Logf("Sessions(%d), empty queue: %d connections at first; then %d accept timeouts and %d connections opened in %v",
		slots, first, n, opened, elapsed.Round(time.Millisecond))
	if first != slots {
		t.Errorf("%d connections opened at first, want one per slot (%d)", first, slots)
	}
	if opened != 0 {
		t.Errorf("%d connections opened after the first ones, over %d accept timeouts; want none", opened, n)
	}
}

// msgSessionWaits is what a slot logs when it took a session whose
// handlers from a lost link still run here.
const msgSessionWaits = "the session's handlers from its lost link still run here; waiting for them before taking its messages"

// A session link lost while a handler of its session still runs: the
// session goes back to the service, which gives it to the first slot that
// asks (here the other, idle one). The messages of the session must not
// start here before that handler returns, or the session's order breaks.
// The handler's context is cancelled (the session lock went with the
// link); a handler that ignores it keeps the session's messages waiting
// until it returns.
//
// A handler that outlives DialTimeout does not turn that wait into failed
// attaches: the slot that took the session again waits under Run's
// context, not the attach's. Nor does it end Run when that slot had never
// held a session before (its first attach).
func TestSessionLinkLostWhileItsHandlerRuns(t *testing.T) {
	for _, tc := range []struct {
		name    string
		honours bool
		dial    time.Duration // DialTimeout; 0: the default
		before  time.Duration // how long the handler runs before the detach
		hold    time.Duration // how long it runs on once the slot waits for it
	}{
		{name: "handler returns at its context's end", honours: true},
		{name: "handler ignores its context"},
		{name: "handler outlives DialTimeout", dial: time.Second, before: 2 * time.Second, hold: 4 * time.Second},
		{name: "handler outlives DialTimeout on a slot's first attach", dial: 4 * time.Second, hold: 8 * time.Second},
	} {
		honours := tc.honours
		t.Run(tc.name, func(t *testing.T) {
			p := sbTestPeerOrSkip(t)
			q := p.entity(t, map[string]any{"requires_session": true, "lock_duration_ms": 10000})
			p.enqueue(t, q, 5, map[string]any{"sessions": []string{"s"}})
			var (
				mu          sync.Mutex
				running     []int64 // seq of the handlers of session s running now
				overlaps    []string
				calls       = map[int64]int{}
				cause       error
				blocked     = make(chan struct{})
				release     = make(chan struct{})
				redelivered = make(chan struct{})
			)
			core, logs := observer.New(zap.InfoLevel)
			log := zap.New(zapcore.NewTee(core, sbTestLog(t).Core()))
			h := HandlerFunc(func(ctx context.Context, d *Delivery) error {
				seq, _ := d.ApplicationProperties()["seq"].(int64)
				mu.Lock()
				if len(running) > 0 {
					overlaps = append(overlaps, fmt.Sprintf("seq %d (session %q) started while the handler of seq %v ran", seq, d.SessionID(), running))
				}
				running = append(running, seq)
				calls[seq]++
				n := calls[seq]
				mu.Unlock()
				defer func() {
					mu.Lock()
					running = slices.DeleteFunc(running, func(s int64) bool { return s == seq })
					mu.Unlock()
				}()
				switch {
				case seq == 0 && n == 1:
					close(blocked)
					if honours {
						select {
						case <-ctx.Done():
						case <-release:
						}
					} else {
						<-release
					}
					mu.Lock()
					cause = context.Cause(ctx)
					mu.Unlock()
				case seq == 0 && n == 2:
					close(redelivered)
				}
				return nil
			})
			c, err := ServiceBus(p.conn)
			if err != nil {
				t.Fatal(err)
			}
			opts := []Option{Sessions(2), Logger(log)}
			if tc.dial > 0 {
				opts = append(opts, DialTimeout(tc.dial))
			}
			s, err := New(c, q, h, opts...)
			if err != nil {
				t.Fatal(err)
			}
			var once sync.Once
			free := func() { once.Do(func() { close(release) }) }
			runSessions(t, s)
			t.Cleanup(free) // before Run's stop (cleanups run last first)
			select {
			case <-blocked:
			case <-time.After(30 * time.Second):
				t.Fatal("no message of session s was handled within 30 s")
			}
			time.Sleep(tc.before) // the scenario: the other slot has been told that no session is free
			if n, _ := p.call(t, "POST", "/faults/detach", map[string]any{"entity": q, "session_id": "s"})["detached"].(float64); n != 1 {
				t.Fatalf("the peer detached %v links, want the one holding session s; connections %v", n, p.call(t, "GET", "/connections", nil))
			}
			waiting := func() bool { return logs.FilterMessage(msgSessionWaits).Len() > 0 }
			if !honours {
				// Until it returns, the session's messages wait: the slot
				// that took the session again says so. (Without that wait,
				// the redelivery starts beside the handler.)
				waitUntil(t, 30*time.Second, "the session taken again, or its redelivery", func() bool {
					return waiting() || wait.Closed(redelivered)
				})
				time.Sleep(tc.hold) // the scenario: the handler runs on past DialTimeout
				free()
			}
			select {
			case <-redelivered:
			case <-time.After(30 * time.Second):
				t.Fatal("the first message of session s was not delivered again within 30 s")
			}
			waitUntil(t, 30*time.Second, "5 completed", func() bool { return p.stat(t, q, "completed") == 5 })
			mu.Lock()
			defer mu.Unlock()
			t.Logf("calls per seq %v; the first handler's context ended with %v; session accepts %d",
				calls, cause, p.counter(t, "session_accepts"))
			if len(overlaps) > 0 {
				t.Errorf("the session's order broke: %v", overlaps)
			}
			if honours && !errors.Is(cause, ErrLockLost) {
				t.Errorf("the first handler's context ended with %v, want ErrLockLost (the session lock went with its link)", cause)
			}
			if !honours && !waiting() {
				t.Errorf("no %q logged", msgSessionWaits)
			}
			if n := logs.FilterMessage("reconnect failed; trying again").Len(); n > 0 {
				t.Errorf("%d attaches failed while a slot waited for the session's handler", n)
			}
		})
	}
}

// sessionLinks returns the peer's receiver links that hold a session:
// session id → the session filter's descriptor as the client sent it.
func (p *sbTestPeer) sessionLinks(t *testing.T) map[string]any {
	t.Helper()
	out := map[string]any{}
	conns, _ := p.call(t, "GET", "/connections", nil)["connections"].([]any)
	for _, c := range conns {
		links, _ := c.(map[string]any)["links"].([]any)
		for _, l := range links {
			l := l.(map[string]any)
			if id, ok := l["session_id"].(string); ok {
				out[id] = l["session_filter_descriptor"]
			}
		}
	}
	return out
}

// sessionFilter is the session filter's name, as the service reads it.
const sessionFilter = "com.microsoft:session-filter"

// On the wire, the session filter has azservicebus's descriptor; the peer
// grants a session for it and for 0x000001370000000C, its own default.
func TestSessionFilterOnTheWire(t *testing.T) {
	p := sbTestPeerOrSkip(t)
	q := p.entity(t, map[string]any{"requires_session": true})
	p.enqueue(t, q, 1, map[string]any{"sessions": []string{"a"}})
	c, err := ServiceBus(p.conn)
	if err != nil {
		t.Fatal(err)
	}
	handled := make(chan string, 1)
	s, err := New(c, q, HandlerFunc(func(_ context.Context, d *Delivery) error {
		handled <- d.SessionID()
		return nil
	}), Sessions(1), Logger(sbTestLog(t)))
	if err != nil {
		t.Fatal(err)
	}
	runSessions(t, s)
	select {
	case id := <-handled:
		if id != "a" {
			t.Fatalf("handled a message of session %q, want a", id)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("no message handled within 30 s")
	}
	if d := p.sessionLinks(t)["a"]; d != float64(0x137000000C) {
		t.Errorf("amqpsub's session filter descriptor on the wire: %v, want 0x137000000C", d)
	}

	// A go-amqp receiver on a connection with claims, with either
	// descriptor.
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	conn, err := c.(*sbConnector).connect(ctx, connectRequest{entity: q, log: sbTestLog(t), idle: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		conn.stop()
		_ = conn.conn.Close()
	}()
	sess, err := conn.conn.NewSession(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	for id, code := range map[string]uint64{"b": 0x137000000C, "c": 0x000001370000000C} {
		r, err := sess.NewReceiver(ctx, q, &amqp.ReceiverOptions{
			SettlementMode: amqp.ReceiverSettleModeSecond.Ptr(),
			Filters:        []amqp.LinkFilter{amqp.NewLinkFilter(sessionFilter, code, id)},
		})
		if err != nil {
			t.Fatalf("session %s, descriptor %#x: %v", id, code, err)
		}
		if got := r.LinkSourceFilterValue(sessionFilter); got != id {
			t.Errorf("descriptor %#x: granted session %v, want %s", code, got, id)
		}
		if d := p.sessionLinks(t)[id]; d != float64(code) {
			t.Errorf("descriptor %#x: the peer saw %v", code, d)
		}
		_ = r.Close(ctx)
	}
}

// A named session that another consumer holds: asked for again, on the
// same connection, after waits that grow; taken once the other lets go.
func TestSessionIDsLockedByAnotherReceiver(t *testing.T) {
	p := sbTestPeerOrSkip(t)
	q := p.entity(t, map[string]any{"requires_session": true})
	p.enqueue(t, q, 1, map[string]any{"sessions": []string{"a"}})
	c, err := ServiceBus(p.conn)
	if err != nil {
		t.Fatal(err)
	}
	handledBy := make(chan string, 4)
	consumer := func(name string) *Subscriber {
		s, err := New(c, q, HandlerFunc(func(context.Context, *Delivery) error {
			handledBy <- name
			return nil
		}), SessionIDs("a"), Logger(sbTestLog(t)))
		if err != nil {
			t.Fatal(err)
		}
		return s
	}
	first := consumer("first")
	ctx, stopFirst := context.WithCancel(context.Background())
	firstDone := make(chan error, 1)
	go func() { firstDone <- first.Run(ctx) }()
	defer stopFirst()
	if by := <-handledBy; by != "first" {
		t.Fatalf("handled by %s", by)
	}
	conns0, refused0 := p.stat(t, q, "connections"), p.counter(t, "session_cannot_be_locked")
	refused := func() int { return p.counter(t, "session_cannot_be_locked") - refused0 }
	runSessions(t, consumer("second"))
	waitUntil(t, 30*time.Second, "3 refusals", func() bool { return refused() >= 3 })
	stopFirst()
	if err := <-firstDone; err != nil {
		t.Fatalf("first Run: %v", err)
	}
	p.enqueue(t, q, 1, map[string]any{"sessions": []string{"a"}})
	select {
	case by := <-handledBy:
		if by != "second" {
			t.Fatalf("handled by %s", by)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("the second consumer did not take the session within 30 s of the first letting it go")
	}
	n, opened := refused(), p.stat(t, q, "connections")-conns0
	t.Logf("%d refusals (session-cannot-be-locked), %d connections opened by the second consumer", n, opened)
	if opened != 1 {
		t.Errorf("the second consumer opened %d connections, want 1", opened)
	}
	// At 0, 0.5-1, 1.5-3, 3.5-7 s and 7.5-15 s: the first let go after
	// the third.
	if n > 5 {
		t.Errorf("%d refusals, want at most 5", n)
	}
}

type sbTestPeer struct{ conn, ctl string }

// sbTestPeerOrSkip returns the peer the environment names, and fails the
// test without one: under the peer tag the peer is required.
func sbTestPeerOrSkip(t *testing.T) *sbTestPeer {
	t.Helper()
	c, ctl := os.Getenv("AMQPSUB_SBPEER_CONN"), os.Getenv("AMQPSUB_SBPEER_CONTROL")
	if c == "" || ctl == "" {
		t.Fatal("no Service Bus peer (AMQPSUB_SBPEER_CONN, AMQPSUB_SBPEER_CONTROL): start it with `bash integration/sbpeer/sbpeer.sh start`, or run `make test`")
	}
	return &sbTestPeer{c, strings.TrimRight(ctl, "/")}
}

func (p *sbTestPeer) call(t *testing.T, method, path string, body any) map[string]any {
	t.Helper()
	var rd io.Reader
	if body != nil {
		b, _ := json.Marshal(body)
		rd = bytes.NewReader(b)
	}
	req, _ := http.NewRequest(method, p.ctl+path, rd)
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatalf("peer %s %s: %v", method, path, err)
	}
	defer resp.Body.Close()
	data, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("peer %s %s: %s %s", method, path, resp.Status, data)
	}
	out := map[string]any{}
	_ = json.Unmarshal(data, &out)
	return out
}

// entity creates a queue named fx-<test>-<n> with spec's settings, deleted
// when the test ends.
func (p *sbTestPeer) entity(t *testing.T, spec map[string]any) string {
	t.Helper()
	name := fmt.Sprintf("fx-%s-%d", strings.ToLower(strings.NewReplacer("/", "-", "_", "-").Replace(t.Name())), time.Now().UnixNano())
	spec["name"] = name
	p.call(t, "POST", "/entities", spec)
	t.Cleanup(func() {
		p.call(t, "POST", "/entities/delete", map[string]any{"name": name})
		http.DefaultClient.CloseIdleConnections()
	})
	return name
}

// enqueue puts n messages on q (ids <q>-<i>).
func (p *sbTestPeer) enqueue(t *testing.T, q string, n int, extra map[string]any) {
	t.Helper()
	body := map[string]any{"entity": q, "count": n, "message_id_prefix": q}
	for k, v := range extra {
		body[k] = v
	}
	p.call(t, "POST", "/messages", body)
}

// stat returns one of q's counters (completed, delivered, lock_expired…).
func (p *sbTestPeer) stat(t *testing.T, q, name string) int {
	t.Helper()
	st, _ := p.call(t, "GET", "/entity?name="+q, nil)["stats"].(map[string]any)
	n, _ := st[name].(float64)
	return int(n)
}

// An AMQP server that is not Service Bus (Artemis) gives no claims-based
// security answer: the error says what to check.
func TestServiceBusOnAnotherServer(t *testing.T) {
	raw := os.Getenv("AMQPSUB_ARTEMIS_URL")
	if raw == "" {
		t.Fatal("no AMQP server that is not Service Bus (AMQPSUB_ARTEMIS_URL): start Artemis with `bash integration/artemis.sh start`, or run `make test`")
	}
	u, err := url.Parse(raw)
	if err != nil {
		t.Fatal(err)
	}
	c, err := ServiceBusWithToken("amqp://"+u.Host, SASTokenProvider("Root", "k", time.Hour))
	if err != nil {
		t.Fatal(err)
	}
	s, err := New(c, "fx-not-service-bus", HandlerFunc(func(context.Context, *Delivery) error { return nil }),
		DialTimeout(2*time.Second), Logger(sbTestLog(t)))
	if err != nil {
		t.Fatal(err)
	}
	err = s.Run(context.Background())
	t.Logf("Run: %v", err)
	if err == nil || !strings.Contains(err.Error(), "is this a Service Bus endpoint?") {
		t.Fatalf("Run = %v: want a hint that this is not Service Bus", err)
	}
}

// The $management reply link dies (closed under the subscriber, as a
// detach by the service ends it) while deliveries are held whose locks
// need renewing: their locks must not be lost.
//
//   - after it answered: the link pair is attached again on the same
//     session, the receive link is not touched, no delivery is handled
//     twice; the same when the sender dies instead;
//   - before it answered anything: it is not attached again in a loop; the
//     first renewal that finds it gone closes the receive link, the pump
//     attaches both anew, and the service delivers what was held again.
func TestServiceBusManagementLinkDies(t *testing.T) {
	p := sbTestPeerOrSkip(t)
	closeReceiver := func(m *servicebus.Management) linkCloser { _, r := m.Pair(); return r }
	closeSender := func(m *servicebus.Management) linkCloser { snd, _ := m.Pair(); return snd }
	for _, tc := range []struct {
		name       string
		afterRenew bool
		link       func(*servicebus.Management) linkCloser
	}{
		{"after it answered", true, closeReceiver},
		{"sender, after it answered", true, closeSender},
		{"before it answered", false, closeReceiver},
	} {
		t.Run(tc.name, func(t *testing.T) {
			q := p.entity(t, map[string]any{"lock_duration_ms": 2000})
			var calls, cancelled atomic.Int32
			c, err := ServiceBus(p.conn)
			if err != nil {
				t.Fatal(err)
			}
			s, err := New(c, q, HandlerFunc(func(ctx context.Context, d *Delivery) error {
				calls.Add(1)
				select {
				case <-time.After(5 * time.Second): // needs a renewal or two
					return nil
				case <-ctx.Done():
					cancelled.Add(1)
					return context.Cause(ctx)
				}
			}), Workers(4), Logger(sbTestLog(t)))
			if err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			errc := make(chan error, 1)
			go func() { errc <- s.Run(ctx) }()
			waitUntil(t, 10*time.Second, "attached", func() bool { return s.pipes[0].current.Load() != nil })
			l := s.pipes[0].current.Load()
			if tc.afterRenew {
				p.enqueue(t, q, 4, nil)
				waitUntil(t, 10*time.Second, "a renewal", func() bool { return s.Stats().Locks.Renewed >= 4 })
			}
			cctx, ccancel := context.WithTimeout(context.Background(), time.Second)
			_ = tc.link(servicebus.LinkManagement(l)).Close(cctx) // the link is gone
			ccancel()
			if !tc.afterRenew {
				p.enqueue(t, q, 4, nil)
			}
			waitUntil(t, 30*time.Second, "4 completed", func() bool { return p.stat(t, q, "completed") == 4 })
			cancel()
			if err := <-errc; err != nil {
				t.Fatal(err)
			}
			st := s.Stats()
			t.Logf("handler calls %d, cancelled %d; stats %v; delivered %d, lock_expired %d",
				calls.Load(), cancelled.Load(), st, p.stat(t, q, "delivered"), p.stat(t, q, "lock_expired"))
			if st.Locks.Lost != 0 || p.stat(t, q, "lock_expired") != 0 {
				t.Fatalf("%d locks lost, %d expired at the peer", st.Locks.Lost, p.stat(t, q, "lock_expired"))
			}
			if tc.afterRenew && (st.LinksLost != 0 || calls.Load() != 4) {
				t.Fatalf("the receive link was replaced (%d lost) or deliveries repeated (%d calls for 4)", st.LinksLost, calls.Load())
			}
			if !tc.afterRenew && st.LinksLost != 1 {
				t.Fatalf("%d links lost, want the receive link given up once", st.LinksLost)
			}
		})
	}
}

// The same for a session consumer: the session's lock is renewed on the
// $management pair attached again, and the session is kept.
func TestServiceBusManagementLinkDiesSession(t *testing.T) {
	p := sbTestPeerOrSkip(t)
	q := p.entity(t, map[string]any{"lock_duration_ms": 2000, "requires_session": true})
	p.enqueue(t, q, 1, map[string]any{"sessions": []string{"a"}})
	lockedUntil := func() float64 {
		sessions, _ := p.call(t, "GET", "/entity?name="+q, nil)["sessions"].(map[string]any)
		a, _ := sessions["a"].(map[string]any)
		v, _ := a["locked_until_ms"].(float64)
		return v
	}
	var calls, cancelled atomic.Int32
	c, err := ServiceBus(p.conn)
	if err != nil {
		t.Fatal(err)
	}
	s, err := New(c, q, HandlerFunc(func(ctx context.Context, d *Delivery) error {
		calls.Add(1)
		select {
		case <-time.After(5 * time.Second):
			return nil
		case <-ctx.Done():
			cancelled.Add(1)
			return context.Cause(ctx)
		}
	}), Sessions(1), DialTimeout(4*time.Second), Logger(sbTestLog(t)))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	errc := make(chan error, 1)
	go func() { errc <- s.Run(ctx) }()
	waitUntil(t, 10*time.Second, "handling", func() bool { return calls.Load() == 1 })
	first := lockedUntil()
	waitUntil(t, 10*time.Second, "a session lock renewal", func() bool { return lockedUntil() > first })
	l := s.pipes[0].current.Load()
	cctx, ccancel := context.WithTimeout(context.Background(), time.Second)
	_, rcv := servicebus.LinkManagement(l).Pair()
	_ = rcv.Close(cctx)
	ccancel()
	waitUntil(t, 30*time.Second, "1 completed", func() bool { return p.stat(t, q, "completed") == 1 })
	cancel()
	if err := <-errc; err != nil {
		t.Fatal(err)
	}
	st := s.Stats()
	t.Logf("handler calls %d, cancelled %d; stats %v", calls.Load(), cancelled.Load(), st)
	if calls.Load() != 1 || cancelled.Load() != 0 || st.Locks.Lost != 0 || st.LinksLost != 0 {
		t.Fatalf("the session was given up: %d calls, %d cancelled, stats %v", calls.Load(), cancelled.Load(), st)
	}
}

// linkCloser is one link of a $management pair, to close under it.
type linkCloser interface {
	Close(ctx context.Context) error
}

// A session let go because it was idle for SessionIdleTimeout is the
// normal path of a session consumer: "session released" says so at info,
// with reason idle and no error (the pump's wrapped ErrSourceDone is no
// failure to report).
func TestSessionReleasedIdleLogsNoError(t *testing.T) {
	p := sbTestPeerOrSkip(t)
	q := p.entity(t, map[string]any{"requires_session": true})
	p.enqueue(t, q, 1, map[string]any{"sessions": []string{"acc-2"}})
	core, logs := observer.New(zap.InfoLevel)
	c, err := ServiceBus(p.conn)
	if err != nil {
		t.Fatal(err)
	}
	s, err := New(c, q, HandlerFunc(func(context.Context, *Delivery) error { return nil }),
		Sessions(1), SessionIdleTimeout(300*time.Millisecond), Logger(zap.New(zapcore.NewTee(core, sbTestLog(t).Core()))))
	if err != nil {
		t.Fatal(err)
	}
	runSessions(t, s)
	released := func() []observer.LoggedEntry {
		return logs.FilterMessage("session released").FilterField(zap.String("session_id", "acc-2")).All()
	}
	waitUntil(t, 30*time.Second, "session acc-2 released", func() bool { return len(released()) > 0 })
	e := released()[0]
	fields := e.ContextMap()
	t.Logf("%s %s %v", e.Level, e.Message, fields)
	if e.Level != zap.InfoLevel || fields["reason"] != "idle" {
		t.Errorf("logged at %s with reason %v, want info and idle", e.Level, fields["reason"])
	}
	if err, ok := fields["error"]; ok {
		t.Errorf("an idle release logs error %q, want none", err)
	}
}

// Stats().Settled counts what the service took: releases decided after a
// forced detach go by lock token (update-disposition), as abandons, which
// the service counts as such (delivery count + 1); Stats and OnSettled
// count them as modified, and the releases that went on the link as
// released.
func TestServiceBusReleaseByTokenCountsAsModified(t *testing.T) {
	p := sbTestPeerOrSkip(t)
	q := p.entity(t, map[string]any{"lock_duration_ms": 10000})
	const n = 8
	p.enqueue(t, q, n, nil)
	var (
		mu      sync.Mutex
		seen    = map[any]bool{}
		heard   = map[Outcome]int{}
		waiting atomic.Int32
		go1     = make(chan struct{})
	)
	c, err := ServiceBus(p.conn)
	if err != nil {
		t.Fatal(err)
	}
	s, err := New(c, q, HandlerFunc(func(ctx context.Context, d *Delivery) error {
		d.OnSettled(func(o Outcome, err error) {
			if err == nil {
				mu.Lock()
				heard[o]++
				mu.Unlock()
			}
		})
		mu.Lock()
		again := seen[d.MessageID()]
		seen[d.MessageID()] = true
		mu.Unlock()
		if again {
			return nil
		}
		if waiting.Add(1) <= n/2 {
			<-go1 // released once the link is gone: by lock token
		}
		return Release()
	}), Workers(n), Logger(sbTestLog(t)))
	if err != nil {
		t.Fatal(err)
	}
	runSessions(t, s)
	waitUntil(t, 30*time.Second, "half the handlers waiting, the others released", func() bool {
		return waiting.Load() == n && s.Stats().Settled.Released >= n/2
	})
	if got, _ := p.call(t, "POST", "/faults/detach", map[string]any{"entity": q})["detached"].(float64); got != 1 {
		t.Fatalf("the peer detached %v links, want 1", got)
	}
	waitUntil(t, 30*time.Second, "the link lost", func() bool { return s.Stats().LinksLost == 1 })
	close(go1)
	waitUntil(t, 30*time.Second, "all completed", func() bool { return p.stat(t, q, "completed") == n })
	st := s.Stats()
	released, abandoned := p.stat(t, q, "released"), p.stat(t, q, "abandoned")
	mu.Lock()
	defer mu.Unlock()
	t.Logf("the peer: %d released, %d abandoned, %d completed; Stats %+v, by token %d; OnSettled heard %v",
		released, abandoned, p.stat(t, q, "completed"), st.Settled, st.Locks.SettledByToken, heard)
	if abandoned == 0 {
		t.Fatal("nothing abandoned at the peer: no release went by lock token")
	}
	// What went by token is what the peer took by token: the held
	// releases, and any redelivery the old link took in before it was
	// lost (settled through it, so by token too).
	if byToken := p.stat(t, q, "update_disposition_tokens"); st.Locks.SettledByToken != uint64(byToken) || byToken < abandoned {
		t.Errorf("Stats().Locks.SettledByToken = %d; the peer took %d settlements by token, %d of them abandons", st.Locks.SettledByToken, byToken, abandoned)
	}
	if int(st.Settled.Released) != released || int(st.Settled.Modified) != abandoned {
		t.Errorf("Stats: %d released, %d modified; the peer took %d released, %d abandoned",
			st.Settled.Released, st.Settled.Modified, released, abandoned)
	}
	if heard[OutcomeReleased] != released || heard[OutcomeModified] != abandoned {
		t.Errorf("OnSettled heard %v; the peer took %d released, %d abandoned", heard, released, abandoned)
	}
}

// waitUntil polls cond until it holds, failing the test after within.
func waitUntil(t *testing.T, within time.Duration, what string, cond func() bool) {
	t.Helper()
	end := time.Now().Add(within)
	for !cond() {
		if time.Now().After(end) {
			t.Fatalf("timed out after %v waiting for %s", within, what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}
