package amqpsub

// Session consumers against the scripted Service Bus peer
// (integration/sbpeer): connections of idle slots, the session filter's
// descriptor, a named session locked elsewhere, and the order of a session
// whose link is lost while one of its handlers runs. They skip without
// AMQPSUB_SBPEER_CONN and AMQPSUB_SBPEER_CONTROL.

import (
	"context"
	"errors"
	"fmt"
	"os"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/Azure/go-amqp"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"
)

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
	conns0, timeouts0 := p.counter(t, "connections_opened"), p.counter(t, "session_accept_timeouts")
	runSessions(t, s)
	timeouts := func() int { return p.counter(t, "session_accept_timeouts") - timeouts0 }
	// Each slot has connected and been told "no session" at least once.
	waitUntil(t, 30*time.Second, "a timeout per slot", func() bool { return timeouts() >= slots })
	first := p.counter(t, "connections_opened") - conns0
	began, t0 := time.Now(), timeouts()
	if window > 0 {
		time.Sleep(window) // a measurement of a wall-clock minute, not a wait for an event
	} else {
		// Three more timeouts per slot.
		waitUntil(t, 30*time.Second, "three more timeouts per slot", func() bool { return timeouts() >= t0+3*slots })
	}
	elapsed, n := time.Since(began), timeouts()-t0
	opened := p.counter(t, "connections_opened") - conns0 - first
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
func TestSessionLinkLostWhileItsHandlerRuns(t *testing.T) {
	for _, honours := range []bool{true, false} {
		name := "handler returns at its context's end"
		if !honours {
			name = "handler ignores its context"
		}
		t.Run(name, func(t *testing.T) {
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
			s, err := New(c, q, h, Sessions(2), Logger(log))
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
			if n, _ := p.call(t, "POST", "/faults/detach", map[string]any{"entity": q, "session_id": "s"})["detached"].(float64); n != 1 {
				t.Fatalf("the peer detached %v links, want the one holding session s; connections %v", n, p.call(t, "GET", "/connections", nil))
			}
			waiting := func() bool { return logs.FilterMessage(msgSessionWaits).Len() > 0 }
			if !honours {
				// Until it returns, the session's messages wait: the slot
				// that took the session again says so. (Without that wait,
				// the redelivery starts beside the handler.)
				waitUntil(t, 30*time.Second, "the session taken again, or its redelivery", func() bool {
					return waiting() || isClosed(redelivered)
				})
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
// grants a session for it and for the one of Microsoft's AMQP documents.
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
	conns0, refused0 := p.counter(t, "connections_opened"), p.counter(t, "session_cannot_be_locked")
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
	n, opened := refused(), p.counter(t, "connections_opened")-conns0
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
