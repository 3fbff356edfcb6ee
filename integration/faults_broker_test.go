package integration

import (
	"context"
	"fmt"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/Azure/go-amqp"

	"github.com/amqpsub/amqpsub/amqpsub"
)

// The broker dies under load (kill -9) and comes back.

// assertQueueEmpty fails when anything is left on q (the broker's count,
// once the last acceptances have landed).
// waitDrained waits, while the subscriber still runs, until the broker
// counts no message on q (Artemis's messageCount includes the ones being
// delivered): a delivery whose acceptance a fault lost comes back and is
// handled, as a duplicate, before the stop. Stopping as soon as every
// message was handled once would release such a redelivery, if it arrived
// during the stop, and leave it on the queue.
func waitDrained(t testing.TB, conn *amqp.Conn, q string, within time.Duration) {
	t.Helper()
	deadline := time.Now().Add(within)
	for {
		n := queueAttribute(t, conn, q, "messageCount")
		if n == "0" {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s messages still on %s %v after every message was handled once", n, q, within)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// waitAccepting polls addr with TCP connects every 10 ms and returns when
// one succeeds: the moment the broker (or proxy) accepts again.
func waitAccepting(ctx context.Context, addr string) (time.Time, error) {
	for {
		c, err := net.DialTimeout("tcp", addr, 200*time.Millisecond)
		if err == nil {
			at := time.Now()
			c.Close()
			return at, nil
		}
		select {
		case <-ctx.Done():
			return time.Time{}, fmt.Errorf("%s never accepted: %w", addr, err)
		case <-time.After(10 * time.Millisecond):
		}
	}
}

// kill -9 the broker while 100,000 persistent messages are consumed with
// WorkersByKey(8), start it again after 2 s: every message is handled, none
// is left on the queue, duplicates are at most the credit and the
// acceptances the broker had not yet journaled, and consumption resumes
// within 2 s of the broker accepting connections again.
func TestFaultBrokerKill(t *testing.T) {
	b := dedicatedBroker(t)
	q := queueName(t)
	const n, credit = 100_000, 256
	conn := dial(t, b.url)
	start := time.Now()
	publishFast(t, conn, q, true, uniqueSeqs(n, 100))
	t.Logf("published %d persistent messages in %v", n, time.Since(start).Round(time.Millisecond))
	conn.Close()

	c := newTally(n)
	s, err := amqpsub.New(amqpsub.Dial(b.url, nil), q, c.handler(),
		amqpsub.WorkersByKey(8), amqpsub.Credit(credit),
		amqpsub.Backoff(100*time.Millisecond, time.Second), amqpsub.Logger(logger(t)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("stats at the end: %+v", s.Stats())
		}
	})
	stop, wait := runSub(t, s)
	waitFor(t, time.Minute, "20,000 handled", func() bool { return c.distinct.Load() >= 20_000 })

	t.Cleanup(func() { b.ensureRunning(t) })
	b.ctl(t, "kill9")
	killedAt := time.Now()
	handledAtKill := c.distinct.Load()
	// The scenario: the broker is down for 2 s.
	time.Sleep(2 * time.Second)
	c.setMark() // nothing is handled while the broker is down
	acceptedAt := restartWatching(t, b)
	t.Logf("killed with %d of %d handled; broker accepted again %v after the kill",
		handledAtKill, n, acceptedAt.Sub(killedAt).Round(time.Millisecond))
	waitFor(t, 30*time.Second, "a delivery handled after the restart", func() bool { _, ok := c.firstSinceMark(); return ok })
	first, _ := c.firstSinceMark()
	resume := first.Sub(acceptedAt)

	c.waitAll(t, 2*time.Minute)
	waitDrained(t, dial(t, b.url), q, time.Minute)
	stop()
	if err := wait(); err != nil {
		t.Fatalf("Run = %v", err)
	}
	st := s.Stats()
	t.Logf("resumed %v after the broker accepted; duplicates %d (credit %d); total %v; stats %+v",
		resume.Round(time.Millisecond), c.duplicates(), credit, time.Since(start).Round(time.Second), st)
	if resume > 2*time.Second {
		t.Errorf("consumption resumed %v after the broker accepted connections, want ≤ 2s", resume)
	}
	// The credit bounds the deliveries the broker had sent and not seen
	// settled. Artemis settles in receiver-settle-mode first (the only mode
	// it offers), so no acceptance is confirmed, and it writes the
	// acceptances it did receive to its journal asynchronously: those not
	// yet written at kill -9 come back too. Measured: 0–296 in 8 runs, and
	// once 522 (a journal that lagged 50 ms at 7,000/s), so the bound
	// asserted is the credit plus the acceptances of the last 100 ms
	// before the kill, as the handlers finished them.
	recent := c.firstHandledIn(killedAt.Add(-100*time.Millisecond), killedAt)
	if d := c.duplicates(); d > int64(credit+recent) {
		t.Errorf("%d duplicates after one restart, want ≤ the credit %d + the %d handled in the 100 ms before the kill", d, credit, recent)
	} else if d > credit {
		t.Logf("%d duplicates: %d past the credit, acceptances the broker had received but not journaled (%d handled in the 100 ms before the kill)", d, d-credit, recent)
	}
	if st.Reconnects < 1 || st.LinksLost < 1 {
		t.Errorf("no reconnect recorded: %+v", st)
	}
	assertQueueEmpty(t, dial(t, b.url), q)
}

// restartWatching starts the dedicated broker and returns when its port
// first accepted.
func restartWatching(t *testing.T, b *faultBroker) time.Time {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	type res struct {
		at  time.Time
		err error
	}
	got := make(chan res, 1)
	var wg sync.WaitGroup
	defer wg.Wait()
	defer cancel()
	wg.Go(func() {
		at, err := waitAccepting(ctx, b.addr)
		got <- res{at, err}
	})
	b.ctl(t, "start")
	r := <-got
	if r.err != nil {
		t.Fatal(r.err)
	}
	return r.at
}
