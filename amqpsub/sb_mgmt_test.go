package amqpsub

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/amqpsub/amqpsub/internal/servicebus"
)

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
			_ = tc.link(l.sb.mgmt).Close(cctx) // the link is gone
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
	_, rcv := l.sb.mgmt.Pair()
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
