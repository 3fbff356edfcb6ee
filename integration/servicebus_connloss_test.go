package integration

import (
	"context"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"

	"github.com/amqpsub/amqpsub/amqpsub"
)

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

// The link is detached during a stop's grace, while 8 handlers run: its
// connection is open, so its $management node settles their results by
// lock token, and no connection is opened.
func TestServiceBusLinkDetachedDuringTheGrace(t *testing.T) {
	p := serviceBusPeer(t)
	q := p.entity(t, map[string]any{"lock_duration_ms": 5000})
	st, d := stopDuringGrace(t, p, sbConnector(t, p), q, func() {
		p.call(t, "POST", "/faults/detach", map[string]any{"entity": q}, nil)
	})
	e := p.info(t, q)
	t.Logf("connections opened for the entity %d (on the whole peer %d); entity %+v; stats %v", e.Stats["connections"], d["connections_opened"], e, st)
	if e.Stats["completed"] != 8 || st.Locks.SettledByToken != 8 || st.SettleErrors != 0 || st.LinksLost != 1 {
		t.Fatalf("completed %d, settled by token %d, settle errors %d, links lost %d: want 8, 8, 0, 1",
			e.Stats["completed"], st.Locks.SettledByToken, st.SettleErrors, st.LinksLost)
	}
	if e.Stats["connections"] != 1 {
		t.Fatalf("%d connections opened: want the first only", e.Stats["connections"])
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
