package integration

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/amqpsub/amqpsub/amqpsub"
)

// Lock duration 2 s, Credit(256), Workers(4), 50 ms per message: past the
// first 160 or so, each of the 1,000 deliveries waits about 3.2 s behind
// the 256 held, longer than a lock lasts, yet none is redelivered, and the
// renewals share requests.
func TestServiceBusRenewalUnderBacklog(t *testing.T) {
	p := serviceBusPeer(t)
	q := p.entity(t, map[string]any{"lock_duration_ms": 2000})
	const n = 1000
	p.send(t, q, n)
	before := p.counters(t)
	seen := make([]atomic.Int32, n)
	s, _ := amqpsub.New(sbConnector(t, p), q, amqpsub.HandlerFunc(func(ctx context.Context, d *amqpsub.Delivery) error {
		seen[sbIndex(d)].Add(1)
		time.Sleep(50 * time.Millisecond)
		return nil
	}), amqpsub.Credit(256), amqpsub.FixedCredit(), amqpsub.Workers(4), amqpsub.Logger(logger(t)))
	stop, wait := runSub(t, s)
	waitFor(t, 2*time.Minute, "1,000 completed", func() bool { return p.info(t, q).Stats["completed"] == n })
	stop()
	if err := wait(); err != nil {
		t.Fatal(err)
	}
	after := p.counters(t)
	e := p.info(t, q)
	st := s.Stats()
	requests, tokens := after["renew_lock_requests"]-before["renew_lock_requests"], after["renew_lock_tokens"]-before["renew_lock_tokens"]
	t.Logf("%d locks renewed in %d requests; entity %+v; stats %v", tokens, requests, e, st)
	for i := range seen {
		if c := seen[i].Load(); c != 1 {
			t.Fatalf("message %d handled %d times", i, c)
		}
	}
	if e.Stats["lock_expired"] != 0 || e.Stats["delivered"] != n || st.Locks.Lost != 0 || st.Locks.Held != 0 {
		t.Fatalf("locks expired or deliveries repeated: entity %+v, stats %v", e, st)
	}
	if tokens < n || requests*10 > tokens {
		t.Fatalf("%d tokens renewed in %d requests: want batched renewals of every waiting lock", tokens, requests)
	}
}

// TestServiceBusSettleRoundTrip: with a 5 ms settle delay on the peer and
// Workers(16), settlements go out concurrently: the peer sees at least 8
// of them outstanding at once (settlements_outstanding_max). The rate is
// logged only; it is the benchmark's figure, not a pass condition.
func TestServiceBusSettleRoundTrip(t *testing.T) {
	p := serviceBusPeer(t)
	q := p.entity(t, map[string]any{"lock_duration_ms": 60000})
	const n = 2000
	p.send(t, q, n)
	p.call(t, "POST", "/faults/settle-delay", map[string]any{"ms": 5}, nil)
	t.Cleanup(func() { p.call(t, "POST", "/faults/settle-delay", map[string]any{"ms": 0}, nil) })
	p.call(t, "POST", "/counters/reset", nil, nil)
	var first, last atomic.Int64
	s, _ := amqpsub.New(sbConnector(t, p), q, amqpsub.HandlerFunc(func(ctx context.Context, d *amqpsub.Delivery) error {
		first.CompareAndSwap(0, time.Now().UnixNano())
		return nil
	}), amqpsub.Workers(16), amqpsub.Logger(logger(t)))
	stop, wait := runSub(t, s)
	waitFor(t, 2*time.Minute, "2,000 completed", func() bool {
		if s.Stats().Settled.Accepted == n {
			last.CompareAndSwap(0, time.Now().UnixNano())
			return true
		}
		return false
	})
	stop()
	if err := wait(); err != nil {
		t.Fatal(err)
	}
	c := p.counters(t)
	took := time.Duration(last.Load() - first.Load())
	t.Logf("%d settled in %v: %.0f msg/s; peer saw at most %d settlements outstanding (stats %v)",
		n, took.Round(time.Millisecond), float64(n)/took.Seconds(), c["settlements_outstanding_max"], s.Stats())
	if got := p.info(t, q).Stats["completed"]; got != n {
		t.Fatalf("the peer completed %d of %d", got, n)
	}
	if c["settlements_outstanding_max"] < 8 {
		t.Fatalf("at most %d settlements were outstanding at once with Workers(16), want >= 8", c["settlements_outstanding_max"])
	}
}

// The peer refuses to renew one message's lock: that handler's context is
// cancelled with ErrLockLost, no settlement is sent for it, the message is
// delivered again, and no other message is disturbed.
func TestServiceBusLostLock(t *testing.T) {
	p := serviceBusPeer(t)
	q := p.entity(t, map[string]any{"lock_duration_ms": 2000})
	const n = 10
	p.send(t, q, n)
	p.call(t, "POST", "/faults/renew", map[string]any{"message_ids": []string{"m-3"}, "mode": "lost", "times": 1}, nil)
	t.Cleanup(func() { p.call(t, "POST", "/faults/renew/clear", nil, nil) })
	var mu sync.Mutex
	counts := map[int][]uint32{}
	var cause atomic.Value
	s, _ := amqpsub.New(sbConnector(t, p), q, amqpsub.HandlerFunc(func(ctx context.Context, d *amqpsub.Delivery) error {
		i := sbIndex(d)
		mu.Lock()
		counts[i] = append(counts[i], d.DeliveryCount())
		mu.Unlock()
		if i == 3 && d.DeliveryCount() == 0 {
			select {
			case <-ctx.Done():
				cause.Store(context.Cause(ctx))
				return context.Cause(ctx)
			case <-time.After(30 * time.Second):
				return errors.New("the lost lock never cancelled the handler")
			}
		}
		time.Sleep(300 * time.Millisecond) // long enough to need a renewal
		return nil
	}), amqpsub.Workers(n), amqpsub.Logger(logger(t)))
	stop, wait := runSub(t, s)
	waitFor(t, time.Minute, "10 completed", func() bool { return p.info(t, q).Stats["completed"] == n })
	stop()
	if err := wait(); err != nil {
		t.Fatal(err)
	}
	st := s.Stats()
	e := p.info(t, q)
	t.Logf("deliveries %v; stats %v; entity %+v", counts, st, e)
	if c, _ := cause.Load().(error); !errors.Is(c, amqpsub.ErrLockLost) {
		t.Fatalf("the handler's ctx cause: %v, want ErrLockLost", c)
	}
	if fmt.Sprint(counts[3]) != "[0 1]" || st.Locks.Skipped != 1 || st.Locks.Lost != 1 {
		t.Fatalf("message 3 delivered %v (want [0 1]), stats %v", counts[3], st)
	}
	for i := range n {
		if i != 3 && fmt.Sprint(counts[i]) != "[0]" {
			t.Fatalf("message %d disturbed: deliveries %v", i, counts[i])
		}
	}
	if e.Stats["delivered"] != n+1 || st.Settled.Accepted != n {
		t.Fatalf("entity %+v, stats %v", e, st)
	}
}

// 20 sessions of 100 messages, 4 held at once, WorkersByKey inside: every
// session in order, every message accepted once; a session that goes idle
// is released, and a session that gets messages later is accepted.
func TestServiceBusSessions(t *testing.T) {
	p := serviceBusPeer(t)
	q := p.entity(t, map[string]any{"lock_duration_ms": 3000, "requires_session": true})
	const sessions, per = 20, 100
	p.send(t, q, sessions*per, "-sessions", fmt.Sprint(sessions))
	var mu sync.Mutex
	last := map[string]int64{}
	violations, handled := 0, 0
	seenSlots := map[string]bool{}
	s, err := amqpsub.New(sbConnector(t, p), q, amqpsub.HandlerFunc(func(ctx context.Context, d *amqpsub.Delivery) error {
		seq, _ := d.ApplicationProperties()["seq"].(int64)
		mu.Lock()
		defer mu.Unlock()
		sid := d.SessionID()
		if sid == "" || sid != d.GroupID() {
			violations++
		}
		if seq != last[sid]+1 {
			violations++
		}
		last[sid] = seq
		seenSlots[sid] = true
		handled++
		return nil
	}), amqpsub.Sessions(4), amqpsub.WorkersByKey(2), amqpsub.SessionIdleTimeout(time.Second),
		amqpsub.DialTimeout(4*time.Second), amqpsub.Logger(logger(t)))
	if err != nil {
		t.Fatal(err)
	}
	stop, wait := runSub(t, s)
	waitFor(t, 2*time.Minute, "2,000 completed", func() bool { return p.info(t, q).Stats["completed"] == sessions*per })
	// Every session has been drained and let go; a late one is accepted.
	p.send(t, q, 5, "-session-ids", "late", "-start", "5000")
	waitFor(t, time.Minute, "the late session", func() bool { return p.info(t, q).Stats["completed"] == sessions*per+5 })
	stop()
	if err := wait(); err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	defer mu.Unlock()
	st := s.Stats()
	t.Logf("handled %d over %d sessions, %d violations; stats %v", handled, len(last), violations, st)
	if violations != 0 || handled != sessions*per+5 || len(last) != sessions+1 || last["late"] != 5 {
		t.Fatalf("handled %d, %d sessions, %d order violations", handled, len(last), violations)
	}
	if st.MaxHeld > 256 || st.Settled.Accepted != sessions*per+5 {
		t.Fatalf("stats %v", st)
	}
}

// Reject keeps its reason on the dead-letter sub-queue, and a message that
// keeps failing (Retry) is dead-lettered by the service at its
// MaxDeliveryCount.
func TestServiceBusDeadLetter(t *testing.T) {
	p := serviceBusPeer(t)
	q := p.entity(t, map[string]any{"lock_duration_ms": 5000, "max_delivery_count": 3})
	p.send(t, q, 2)
	var calls sync.Map
	s, _ := amqpsub.New(sbConnector(t, p), q, amqpsub.HandlerFunc(func(ctx context.Context, d *amqpsub.Delivery) error {
		c, _ := calls.LoadOrStore(sbIndex(d), new(atomic.Int32))
		c.(*atomic.Int32).Add(1)
		if sbIndex(d) == 0 {
			return amqpsub.RejectWith("malformed", "no customer in the order")
		}
		return amqpsub.Retry(errors.New("store down"))
	}), amqpsub.Logger(logger(t)))
	stop, wait := runSub(t, s)
	waitFor(t, time.Minute, "2 dead letters", func() bool { return p.info(t, q).DeadLetter == 2 })
	stop()
	if err := wait(); err != nil {
		t.Fatal(err)
	}
	dead := p.messages(t, q+"/$DeadLetterQueue")
	reasons := map[string]string{}
	for _, m := range dead {
		reasons[m.MessageID] = fmt.Sprint(m.AppProps["DeadLetterReason"], "|", m.AppProps["DeadLetterErrorDescription"])
	}
	t.Logf("dead letters %v", reasons)
	if reasons["m-0"] != "malformed|no customer in the order" || !strings.HasPrefix(reasons["m-1"], "MaxDeliveryCountExceeded") {
		t.Fatalf("dead letters %v", reasons)
	}
	if c, _ := calls.Load(1); c.(*atomic.Int32).Load() != 3 {
		t.Fatalf("the failing message was tried %d times, want 3", c.(*atomic.Int32).Load())
	}
	// The dead-letter sub-queue is an address to consume too.
	var read atomic.Int32
	r, _ := amqpsub.New(sbConnector(t, p), q+"/$DeadLetterQueue", amqpsub.HandlerFunc(func(context.Context, *amqpsub.Delivery) error {
		read.Add(1)
		return nil
	}), amqpsub.Logger(logger(t)))
	stopR, waitR := runSub(t, r)
	waitFor(t, 30*time.Second, "2 dead letters read", func() bool { return read.Load() == 2 })
	stopR()
	if err := waitR(); err != nil {
		t.Fatal(err)
	}
}

// Tokens of 5 s: they are put again before they expire, for 30 s, and no
// link is detached for an expired token; a wrong key fails Run at once,
// naming the entity and not the key.
func TestServiceBusClaims(t *testing.T) {
	p := serviceBusPeer(t)
	t.Run("short-lived tokens are refreshed", func(t *testing.T) {
		q := p.entity(t, map[string]any{"lock_duration_ms": 5000})
		key := connValue(p.conn, "SharedAccessKey")
		host := strings.TrimPrefix(connValue(p.conn, "Endpoint"), "sb://")
		c, err := amqpsub.ServiceBusWithToken("amqp://"+strings.TrimRight(host, "/"),
			amqpsub.SASTokenProvider(connValue(p.conn, "SharedAccessKeyName"), key, 5*time.Second))
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
		for i := range 6 { // a message every 5 s, for 30 s
			p.send(t, q, 1, "-start", fmt.Sprint(i))
			time.Sleep(5 * time.Second)
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
		if puts < 2*10 { // two audiences, refreshed every 2.5 s for 30 s
			t.Fatalf("%d tokens put in 30 s, want the refreshes", puts)
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

func connValue(cs, key string) string {
	for _, seg := range strings.Split(cs, ";") {
		if k, v, ok := strings.Cut(seg, "="); ok && strings.EqualFold(k, key) {
			return v
		}
	}
	return ""
}

// A stop with 200 deliveries buffered releases them at once, to a second
// consumer, uncounted (delivery count 0); the one in its handler is
// completed; the lease book is empty after.
func TestServiceBusStopReleasesBuffered(t *testing.T) {
	p := serviceBusPeer(t)
	q := p.entity(t, map[string]any{"lock_duration_ms": 10000})
	p.send(t, q, 300)
	in, finish := make(chan struct{}), make(chan struct{})
	var once sync.Once
	s, _ := amqpsub.New(sbConnector(t, p), q, amqpsub.HandlerFunc(func(ctx context.Context, d *amqpsub.Delivery) error {
		once.Do(func() { close(in) })
		<-finish
		return nil
	}), amqpsub.Credit(201), amqpsub.FixedCredit(), amqpsub.Logger(logger(t)))
	stop, wait := runSub(t, s)
	<-in
	waitFor(t, 10*time.Second, "201 held", func() bool { return s.Stats().Held == 201 })
	began := time.Now()
	stop()
	waitFor(t, 5*time.Second, "200 released", func() bool { return p.info(t, q).Stats["released"] >= 200 })
	released := time.Since(began)
	close(finish)
	if err := wait(); err != nil {
		t.Fatal(err)
	}
	st := s.Stats()
	t.Logf("released in %v; stats %v", released.Round(time.Millisecond), st)
	if released > time.Second || st.Held != 0 || st.Locks.Held != 0 || st.Settled.Released != 200 || st.Settled.Accepted != 1 {
		t.Fatalf("released after %v; stats %v", released, st)
	}
	var second, recounted atomic.Int32
	r, _ := amqpsub.New(sbConnector(t, p), q, amqpsub.HandlerFunc(func(_ context.Context, d *amqpsub.Delivery) error {
		second.Add(1)
		if d.DeliveryCount() != 0 {
			recounted.Add(1)
		}
		return nil
	}), amqpsub.Logger(logger(t)))
	stopR, waitR := runSub(t, r)
	waitFor(t, 30*time.Second, "the other 299 at the second consumer", func() bool { return second.Load() == 299 })
	stopR()
	if err := waitR(); err != nil {
		t.Fatal(err)
	}
	if recounted.Load() != 0 {
		t.Fatalf("%d released deliveries came back with a delivery count", recounted.Load())
	}
}

// Deliveries with a delivery tag that is not 16 bytes, or without
// x-opt-locked-until: a logged skip of their renewal, never a crash.
func TestServiceBusBadDeliveries(t *testing.T) {
	p := serviceBusPeer(t)
	q := p.entity(t, map[string]any{"lock_duration_ms": 5000})
	p.send(t, q, 4)
	p.call(t, "POST", "/faults/delivery", map[string]any{"entity": q, "tag_length": 8, "times": 1}, nil)
	p.call(t, "POST", "/faults/delivery", map[string]any{"entity": q, "omit_annotations": []string{"x-opt-locked-until"}, "times": 1}, nil)
	t.Cleanup(func() { p.call(t, "POST", "/faults/delivery/clear", nil, nil) })
	var handled atomic.Int32
	s, _ := amqpsub.New(sbConnector(t, p), q, amqpsub.HandlerFunc(func(context.Context, *amqpsub.Delivery) error {
		handled.Add(1)
		return nil
	}), amqpsub.Logger(logger(t)))
	stop, wait := runSub(t, s)
	waitFor(t, 30*time.Second, "4 handled", func() bool { return handled.Load() >= 4 })
	stop()
	if err := wait(); err != nil {
		t.Fatal(err)
	}
	if st := s.Stats(); st.Locks.Unrenewable != 2 {
		t.Fatalf("stats %v, want 2 unrenewable", st)
	}
}

// BenchmarkServiceBusRenewalCost measures what renewing costs: 256
// deliveries held for two minutes at a 30 s lock (the handlers never
// return until the end), once arriving together and once spread over the
// first 20 s. It reports renew-lock requests and locks renewed per second.
//
//	go test -run '^$' -bench ServiceBusRenewalCost -benchtime 1x ./integration/
func BenchmarkServiceBusRenewalCost(b *testing.B) {
	p := serviceBusPeer(b)
	for _, spread := range []time.Duration{0, 20 * time.Second} {
		b.Run(fmt.Sprintf("arrivals-over-%v", spread), func(b *testing.B) {
			for range b.N {
				q := p.entity(b, map[string]any{"lock_duration_ms": 30000})
				release := make(chan struct{})
				var got atomic.Int32
				s, _ := amqpsub.New(sbConnector(b, p), q, amqpsub.HandlerFunc(func(ctx context.Context, d *amqpsub.Delivery) error {
					got.Add(1)
					<-release
					return nil
				}), amqpsub.Workers(256), amqpsub.Logger(logger(b)))
				stop, wait := runSub(b, s)
				if spread == 0 {
					p.send(b, q, 256)
				} else {
					for i := range 16 {
						p.send(b, q, 16, "-start", fmt.Sprint(16*i))
						time.Sleep(spread / 16)
					}
				}
				waitFor(b, time.Minute, "256 held", func() bool { return got.Load() == 256 })
				before := p.counters(b)
				const window = 2 * time.Minute
				time.Sleep(window)
				after := p.counters(b)
				close(release)
				stop()
				if err := wait(); err != nil {
					b.Fatal(err)
				}
				req := after["renew_lock_requests"] - before["renew_lock_requests"]
				tok := after["renew_lock_tokens"] - before["renew_lock_tokens"]
				if e := p.info(b, q); e.Stats["lock_expired"] != 0 {
					b.Fatalf("%d locks expired", e.Stats["lock_expired"])
				}
				b.ReportMetric(float64(req)/window.Seconds(), "requests/s")
				b.ReportMetric(float64(tok)/window.Seconds(), "locks-renewed/s")
			}
		})
	}
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

// Run returns within CloseTimeout of Close, whatever the peer or the
// TokenProvider does: a peer that stops answering (its sockets open,
// nothing forwarded), or a TokenProvider stuck in a refresh that ignores
// its ctx.
func TestServiceBusCloseBound(t *testing.T) {
	p := serviceBusPeer(t)
	const closeTimeout = 200 * time.Millisecond
	const slack = 300 * time.Millisecond // scheduling, under -race on a busy machine
	closeAndTime := func(t *testing.T, s *amqpsub.Subscriber, wait func() error) {
		t.Helper()
		began := time.Now()
		s.Close()
		err := wait()
		took := time.Since(began)
		t.Logf("Run returned %v after Close (CloseTimeout %v): %v", took.Round(time.Millisecond), closeTimeout, err)
		if took > closeTimeout+slack {
			t.Fatalf("Run returned %v after Close, CloseTimeout is %v", took.Round(time.Millisecond), closeTimeout)
		}
	}
	for _, sessions := range []bool{false, true} {
		t.Run(fmt.Sprintf("peer hangs, sessions %v", sessions), func(t *testing.T) {
			spec := map[string]any{"lock_duration_ms": 30000}
			send := map[string]any{"count": 4}
			opts := []amqpsub.Option{amqpsub.CloseTimeout(closeTimeout), amqpsub.Logger(logger(t))}
			if sessions {
				spec["requires_session"] = true
				send["sessions"] = []string{"a", "b"}
				opts = append(opts, amqpsub.Sessions(2))
			}
			q := p.fxEntity(t, spec)
			send["entity"], send["message_id_prefix"] = q, q
			p.call(t, "POST", "/messages", send, nil)
			host := strings.TrimRight(strings.TrimPrefix(connValue(p.conn, "Endpoint"), "sb://"), "/")
			px := newProxy(t, host)
			c, err := amqpsub.ServiceBus(strings.Replace(p.conn, host, px.ln.Addr().String(), 1))
			if err != nil {
				t.Fatal(err)
			}
			s, _ := amqpsub.New(c, q, amqpsub.HandlerFunc(func(context.Context, *amqpsub.Delivery) error { return nil }), opts...)
			_, wait := runSub(t, s)
			waitFor(t, 20*time.Second, "4 accepted", func() bool { return s.Stats().Settled.Accepted == 4 })
			px.freeze()
			closeAndTime(t, s, wait)
		})
	}
	t.Run("TokenProvider blocks", func(t *testing.T) {
		q := p.fxEntity(t, map[string]any{"lock_duration_ms": 30000})
		endpoint, sas := p.tokenEndpoint(4 * time.Second)
		tp := &tokenScript{TokenProvider: sas, blockFrom: 3, blocked: make(chan struct{}), release: make(chan struct{})}
		var once sync.Once
		release := func() { once.Do(func() { close(tp.release) }) }
		defer release()
		c, err := amqpsub.ServiceBusWithToken(endpoint, tp)
		if err != nil {
			t.Fatal(err)
		}
		s, _ := amqpsub.New(c, q, amqpsub.HandlerFunc(func(context.Context, *amqpsub.Delivery) error { return nil }),
			amqpsub.CloseTimeout(closeTimeout), amqpsub.Logger(logger(t)))
		_, wait := runSub(t, s)
		select {
		case <-tp.blocked: // the refresh, due 2 s after connecting, is stuck in Token
		case <-time.After(20 * time.Second):
			t.Fatal("no token refresh within 20 s")
		}
		// Let the provider go if Run is not back in time, so that the test
		// reports the time rather than hanging.
		watchdog := time.AfterFunc(closeTimeout+5*time.Second, release)
		defer watchdog.Stop()
		closeAndTime(t, s, wait)
	})
}
