package integration

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"

	"github.com/amqpsub/amqpsub/amqpsub"
)

// The network fails between subscriber and broker: connections cut,
// frozen (half-open), and on the Service Bus peer a connection lost with
// locks held, at any moment and during a stop's grace period.

// A proxy between subscriber and broker drops every connection mid-stream
// three times and refuses new ones for 1 s each time: every message is
// handled, none is left, duplicates are at most the credit per cut, and
// consumption resumes within 2 s of the proxy accepting again.
func TestFaultTCPCut(t *testing.T) {
	b := dedicatedBroker(t)
	const n, credit, cuts = 30_000, 256, 3
	q, conn := b.target().filled(t, uniqueSeqs(n, 100))

	p := newProxy(t, b.addr)
	c := newTally(n)
	s, err := amqpsub.New(amqpsub.Dial(p.url(), nil), q, c.handler(),
		amqpsub.WorkersByKey(8), amqpsub.Credit(credit),
		amqpsub.Backoff(100*time.Millisecond, time.Second), amqpsub.Logger(logger(t)))
	if err != nil {
		t.Fatal(err)
	}
	stop, wait := runSub(t, s)
	var resumes []time.Duration
	for i := 1; i <= cuts; i++ {
		at := int64(i * n / (cuts + 1))
		waitFor(t, time.Minute, fmt.Sprintf("%d handled", at), func() bool { return c.distinct.Load() >= at })
		dropped := p.cut()
		// Down for 1 s: reconnect attempts fail meanwhile.
		time.Sleep(time.Second)
		c.setMark()
		p.acceptAgain()
		acceptedAt := time.Now()
		waitFor(t, 30*time.Second, "a delivery after the cut", func() bool { _, ok := c.firstSinceMark(); return ok })
		first, _ := c.firstSinceMark()
		resumes = append(resumes, first.Sub(acceptedAt))
		t.Logf("cut %d: dropped %d connection(s) at %d handled; resumed %v after the proxy accepted again",
			i, dropped, at, first.Sub(acceptedAt).Round(time.Millisecond))
	}
	c.waitAll(t, 2*time.Minute)
	waitDrained(t, conn, q, time.Minute)
	stop()
	if err := wait(); err != nil {
		t.Fatalf("Run = %v", err)
	}
	st := s.Stats()
	t.Logf("resumes %v; duplicates %d (bound %d); stats %+v", resumes, c.duplicates(), cuts*credit, st)
	for i, r := range resumes {
		if r > 2*time.Second {
			t.Errorf("cut %d: resumed %v after the proxy accepted again, want ≤ 2s", i+1, r)
		}
	}
	if d := c.duplicates(); d > cuts*credit {
		t.Errorf("%d duplicates over %d cuts, want ≤ %d", d, cuts, cuts*credit)
	}
	if st.Reconnects < cuts {
		t.Errorf("%d reconnects, want ≥ %d", st.Reconnects, cuts)
	}
	assertQueueEmpty(t, conn, q)
}

// The proxy stops forwarding but keeps the sockets open: with
// IdleTimeout(2s) the subscriber finds the connection dead and reconnects.
func TestFaultHalfOpen(t *testing.T) {
	b := dedicatedBroker(t)
	const n, credit = 20_000, 256
	const idle = 2 * time.Second
	q, conn := b.target().filled(t, uniqueSeqs(n, 100))

	p := newProxy(t, b.addr)
	c := newTally(n)
	s, err := amqpsub.New(amqpsub.Dial(p.url(), nil), q, c.handler(),
		amqpsub.WorkersByKey(8), amqpsub.Credit(credit), amqpsub.IdleTimeout(idle),
		amqpsub.Backoff(100*time.Millisecond, time.Second), amqpsub.Logger(logger(t)))
	if err != nil {
		t.Fatal(err)
	}
	stop, wait := runSub(t, s)
	waitFor(t, time.Minute, "5,000 handled", func() bool { return c.distinct.Load() >= 5000 })
	frozen := p.freeze()
	frozenAt := time.Now()
	waitFor(t, 3*idle, "the half-open connection detected", func() bool { return s.Stats().LinksLost >= 1 })
	detection := time.Since(frozenAt)
	c.setMark()
	waitFor(t, 30*time.Second, "a delivery after the reconnect", func() bool { _, ok := c.firstSinceMark(); return ok })
	first, _ := c.firstSinceMark()
	resume := first.Sub(frozenAt)
	c.waitAll(t, 2*time.Minute)
	waitDrained(t, conn, q, time.Minute)
	stop()
	if err := wait(); err != nil {
		t.Fatalf("Run = %v", err)
	}
	st := s.Stats()
	t.Logf("froze %d connection(s); detected after %v (idle timeout %v); consuming again %v after the freeze; duplicates %d; stats %+v",
		frozen, detection.Round(time.Millisecond), idle, resume.Round(time.Millisecond), c.duplicates(), st)
	// go-amqp fails the read idle after the last frame; the broker sends
	// one at least every idle/2, so detection takes idle plus scheduling.
	if detection > idle+time.Second {
		t.Errorf("half-open connection found after %v, want ≤ %v", detection, idle+time.Second)
	}
	if d := c.duplicates(); d > credit {
		t.Errorf("%d duplicates, want ≤ the credit %d", d, credit)
	}
	if st.Reconnects != 1 {
		t.Errorf("%d reconnects, want 1", st.Reconnects)
	}
	assertQueueEmpty(t, conn, q)
}

// A lost connection, not only a link detach, under the reading that the
// locks survive it: accepts in flight on the receive link when the
// connection goes fall back to update-disposition, which waits for the
// next link's $management (not the dead one's), so none fails and no
// message whose handler had finished comes back.
func TestServiceBusConnectionLossLosesNoFinishedWork(t *testing.T) {
	p := serviceBusPeer(t)
	connectionLossLocks(t, p, "survive")
	q := p.entity(t, map[string]any{"lock_duration_ms": 5000})
	const n = 64
	p.send(t, q, n)
	// Each accept waits 300 ms for its answer: some are in flight at the cut.
	p.call(t, "POST", "/faults/settle-delay", map[string]any{"ms": 300}, nil)
	defer p.call(t, "POST", "/faults/settle-delay", map[string]any{"ms": 0}, nil)
	target := strings.TrimPrefix(strings.SplitN(strings.SplitN(p.conn, ";", 2)[0], "=", 2)[1], "sb://")
	px := newProxy(t, target)
	conn := strings.Replace(p.conn, target, px.addr(), 1)
	c, err := amqpsub.ServiceBus(conn)
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	calls := make([]int, n)
	finished := make([]bool, n)
	againFinished := 0
	handled := 0
	cut := make(chan struct{})
	s, err := amqpsub.New(c, q, amqpsub.HandlerFunc(func(ctx context.Context, d *amqpsub.Delivery) error {
		i := sbIndex(d)
		mu.Lock()
		calls[i]++
		if calls[i] > 1 && finished[i] {
			againFinished++
		}
		mu.Unlock()
		time.Sleep(20 * time.Millisecond)
		mu.Lock()
		finished[i] = true
		if handled++; handled == 24 {
			close(cut)
		}
		mu.Unlock()
		return nil
	}), amqpsub.Workers(16), amqpsub.Credit(16), amqpsub.Backoff(50*time.Millisecond, 200*time.Millisecond), amqpsub.Logger(zaptest.NewLogger(t, zaptest.Level(zap.DebugLevel))))
	if err != nil {
		t.Fatal(err)
	}
	stop, wait := runSub(t, s)
	<-cut
	// Cut while the peer holds accepts unanswered (its settle delay).
	waitFor(t, 10*time.Second, "settlements outstanding at the peer", func() bool {
		return p.counters(t)["settlements_outstanding"] > 0
	})
	px.drop()
	waitFor(t, 2*time.Minute, "all completed", func() bool { return p.info(t, q).Stats["completed"] == n })
	stop()
	if err := wait(); err != nil {
		t.Fatal(err)
	}
	st := s.Stats()
	mu.Lock()
	defer mu.Unlock()
	t.Logf("handled again though their handler had finished: %d; stats %v", againFinished, st)
	if st.LinksLost < 1 {
		t.Fatalf("no link lost")
	}
	if st.Locks.DispositionRequests == 0 {
		t.Fatalf("no settlement went by lock token: the cut caught none in flight")
	}
	if againFinished != 0 || st.SettleErrors != 0 {
		t.Fatalf("after a connection loss: %d messages whose handler had finished were handled again; %d settle errors",
			againFinished, st.SettleErrors)
	}
}

// stopDuringGrace runs 8 handlers of 1.5 s on 8 messages, starts a
// graceful stop once all 8 run, then calls hit (the connection cut, or the
// link detached) and waits for Run. Every handler's result must still
// reach the peer: by lock token, on the lost link's $management node while
// its connection is open, or on a connection of its own once it is not.
func stopDuringGrace(t *testing.T, p *sbPeer, c amqpsub.Connector, q string, hit func()) (amqpsub.Stats, map[string]int) {
	t.Helper()
	const n = 8
	p.send(t, q, n)
	var running sync.WaitGroup
	running.Add(n)
	s, err := amqpsub.New(c, q, amqpsub.HandlerFunc(func(ctx context.Context, d *amqpsub.Delivery) error {
		running.Done()
		time.Sleep(1500 * time.Millisecond)
		return nil
	}), amqpsub.Workers(n), amqpsub.Credit(n), amqpsub.GracePeriod(20*time.Second),
		amqpsub.Backoff(50*time.Millisecond, 200*time.Millisecond), amqpsub.Logger(logger(t)))
	if err != nil {
		t.Fatal(err)
	}
	before := p.counters(t)
	stop, wait := runSub(t, s)
	running.Wait()
	stop()
	time.Sleep(100 * time.Millisecond) // the stop has begun
	hit()
	if err := wait(); err != nil {
		t.Fatal(err)
	}
	after := p.counters(t)
	delta := map[string]int{}
	for k, v := range after {
		delta[k] = v - before[k]
	}
	return s.Stats(), delta
}

// The connection is lost during a stop's grace, while 8 handlers run: the
// subscriber connects again for $management only, and their results are
// settled by lock token there (the peer keeps the locks: "locks survive").
func TestServiceBusConnectionLostDuringTheGrace(t *testing.T) {
	p := serviceBusPeer(t)
	q := p.entity(t, map[string]any{"lock_duration_ms": 5000})
	target := strings.TrimPrefix(strings.SplitN(strings.SplitN(p.conn, ";", 2)[0], "=", 2)[1], "sb://")
	px := newProxy(t, target)
	c, err := amqpsub.ServiceBus(strings.Replace(p.conn, target, px.addr(), 1))
	if err != nil {
		t.Fatal(err)
	}
	st, d := stopDuringGrace(t, p, c, q, func() { px.drop() })
	e := p.info(t, q)
	t.Logf("connections opened for the entity %d (on the whole peer %d); entity %+v; stats %v", e.Stats["connections"], d["connections_opened"], e, st)
	if e.Stats["completed"] != 8 || st.Locks.SettledByToken != 8 || st.SettleErrors != 0 {
		t.Fatalf("completed %d, settled by token %d, settle errors %d: want 8, 8, 0",
			e.Stats["completed"], st.Locks.SettledByToken, st.SettleErrors)
	}
	if e.Stats["connections"] != 2 {
		t.Fatalf("%d connections opened: want the first and one for $management", e.Stats["connections"])
	}
}

// A lost connection under the reading that the service drops its locks
// (Learn): the peer puts back at once every message the connection held
// and delivers it again on the next. What was buffered here, and in no
// handler, when the connection went never reaches a handler from this
// process's first copy; only the messages whose handler was already
// running are handled a second time (their first result is answered 410,
// a lock lost at settlement), as the service's redelivery makes them.
func TestServiceBusConnectionLossUnderLocksDropped(t *testing.T) {
	p := serviceBusPeer(t)
	connectionLossLocks(t, p, "drop")
	q := p.entity(t, map[string]any{"lock_duration_ms": 30000})
	const n = 40
	p.send(t, q, n)
	target := strings.TrimPrefix(strings.SplitN(strings.SplitN(p.conn, ";", 2)[0], "=", 2)[1], "sb://")
	px := newProxy(t, target)
	c, err := amqpsub.ServiceBus(strings.Replace(p.conn, target, px.addr(), 1))
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	first := make([]time.Time, n) // when its first handler call began
	calls := make([]int, n)
	starts := 0
	cut := make(chan struct{})
	s, err := amqpsub.New(c, q, amqpsub.HandlerFunc(func(ctx context.Context, d *amqpsub.Delivery) error {
		i := sbIndex(d)
		mu.Lock()
		if calls[i]++; calls[i] == 1 {
			first[i] = time.Now()
		}
		if starts++; starts == 6 {
			close(cut) // both lanes have just begun a call: the rest is buffered
		}
		mu.Unlock()
		time.Sleep(200 * time.Millisecond)
		return nil
	}), amqpsub.Workers(2), amqpsub.Credit(20), amqpsub.FixedCredit(),
		amqpsub.Backoff(50*time.Millisecond, 200*time.Millisecond), amqpsub.Logger(logger(t)))
	if err != nil {
		t.Fatal(err)
	}
	before := p.counters(t)
	stop, wait := runSub(t, s)
	<-cut
	mu.Lock()
	cutAt := time.Now()
	mu.Unlock()
	px.drop()
	waitFor(t, 2*time.Minute, "all completed", func() bool { return p.info(t, q).Stats["completed"] == n })
	stop()
	if err := wait(); err != nil {
		t.Fatal(err)
	}
	after := p.counters(t)
	st := s.Stats()
	mu.Lock()
	defer mu.Unlock()
	twice, twiceAfterCut := 0, 0
	for i, c := range calls {
		if c > 1 {
			twice++
			if first[i].After(cutAt) {
				twiceAfterCut++
			}
		}
		if c == 0 {
			t.Fatalf("message %d never handled", i)
		}
	}
	dropped := after["locks_dropped_connection_lost"] - before["locks_dropped_connection_lost"]
	t.Logf("locks dropped by the peer %d; handled twice %d (first call after the cut: %d); stats %v", dropped, twice, twiceAfterCut, st)
	if dropped < 10 || st.LinksLost < 1 {
		t.Fatalf("the peer dropped %d locks, links lost %d: the cut caught little", dropped, st.LinksLost)
	}
	if twiceAfterCut != 0 {
		t.Fatalf("%d messages buffered at the cut went to a handler, and came again", twiceAfterCut)
	}
	// Handled twice: those whose handler began before the cut (6) and
	// whose result had not reached the peer by then; each such result was
	// answered 410.
	if twice > 6 || st.Locks.LostAtSettle < uint64(twice) || st.SettleErrors != 0 {
		t.Fatalf("handled twice %d, locks lost at settlement %d, settle errors %d: want at most the 6 begun before the cut, each lost at settlement, no error",
			twice, st.Locks.LostAtSettle, st.SettleErrors)
	}
}
