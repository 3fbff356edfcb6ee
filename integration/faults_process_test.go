package integration

import (
	"context"
	"fmt"
	"maps"
	"os"
	"strconv"
	"testing"
	"time"

	"github.com/Azure/go-amqp"

	"github.com/amqpsub/amqpsub/internal/publish"
)

// A consumer in a process of its own (the test binary run again, see
// TestMain): SIGTERM under load, and its memory over a large backlog.

// SIGTERM a consumer process under load: it exits within grace + 1 s and
// nothing is lost: every message was accepted by the consumer exactly once
// or is still on the queue.
func TestFaultSigterm(t *testing.T) {
	b := dedicatedBroker(t)
	for _, tc := range []struct {
		name  string
		grace time.Duration
		stuck []int
	}{
		{"handlers finish within the grace", 5 * time.Second, nil},
		{"a handler outlives the grace", 2 * time.Second, []int{5000}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			q := queueName(t)
			const n = 20_000
			conn := dial(t, b.url)
			publishFast(t, conn, q, true, uniqueSeqs(n, 100))
			ch := startChild(t, childConfig{
				URL: b.url, Queue: q, Credit: 256, Workers: 8, ByKey: true,
				Delay: time.Millisecond, Grace: tc.grace, Stuck: tc.stuck,
				Report: 50 * time.Millisecond, Handled: true,
			})
			waitFor(t, time.Minute, "the consumer under load", func() bool {
				st := ch.last()
				return st.Handled >= 6000 && (tc.stuck == nil || st.Stuck == int64(len(tc.stuck)))
			})
			if !ch.running() {
				t.Fatal("the consumer exited by itself")
			}
			before := ch.last()
			took := ch.sigterm(t, tc.grace+30*time.Second)
			final := ch.last()
			t.Logf("SIGTERM with %d held (%d handled): Run returned after %v, the process exited after %v (grace %v); final stats %+v",
				before.Held, before.Handled, final.StopTook.Round(time.Millisecond), took.Round(time.Millisecond), tc.grace, final)
			if took > tc.grace+time.Second {
				t.Errorf("exited %v after SIGTERM, want ≤ grace + 1s = %v", took, tc.grace+time.Second)
			}
			if tc.stuck != nil && took < tc.grace {
				t.Errorf("exited %v after SIGTERM, before the grace period %v ended for a handler in progress", took, tc.grace)
			}
			if !final.Final {
				t.Fatalf("no final stats from the consumer")
			}
			// Without a stuck handler, every delivery was settled or
			// released before Run returned.
			if tc.stuck == nil && (final.Held != 0 || final.Received != final.Accepted+final.Released+final.Modified) {
				t.Errorf("deliveries neither settled nor released: %+v", final)
			}
			// Everything not accepted by the child is still on the queue.
			ch.mu.Lock()
			handled := maps.Clone(ch.handled)
			ch.mu.Unlock()
			left := drainSeqs(t, conn, q, n+1-len(handled))
			checkPartition(t, n, handled, left)
		})
	}
}

// drainSeqs takes every message off q (want of them, then waits 1 s for
// more) and returns how often each seq came.
func drainSeqs(t *testing.T, conn *amqp.Conn, q string, want int) map[int]int {
	t.Helper()
	r := rawReceiver(t, conn, q, 500)
	got := map[int]int{}
	n := 0
	for _, m := range receiveN(t, r, want, time.Minute) {
		seq, _ := m.ApplicationProperties["seq"].(int64)
		got[int(seq)]++
		n++
	}
	for _, m := range receiveN(t, r, 1000, time.Second) {
		seq, _ := m.ApplicationProperties["seq"].(int64)
		got[int(seq)]++
		n++
	}
	t.Logf("drained %d messages from the queue (wanted %d)", n, want)
	return got
}

// checkPartition checks that each seq in [-1, n) was accepted by the
// consumer exactly once or is on the queue exactly once, not both.
func checkPartition(t *testing.T, n int, handled, left map[int]int) {
	t.Helper()
	var lost, twice []int
	for seq := -1; seq < n; seq++ {
		switch k := handled[seq] + left[seq]; {
		case k == 0:
			lost = append(lost, seq)
		case k > 1:
			twice = append(twice, seq)
		}
	}
	t.Logf("accepted by the consumer %d, left on the queue %d, lost %d, twice %d", len(handled), len(left), len(lost), len(twice))
	if len(lost) > 0 || len(twice) > 0 {
		t.Fatalf("lost %v (first 10 of %d); handled or queued twice %v (first 10 of %d)",
			lost[:min(10, len(lost))], len(lost), twice[:min(10, len(twice))], len(twice))
	}
}

// publisher sends small persistent messages over several links at once,
// seq counting on.
type publisher struct {
	conn  *amqp.Conn
	q     string
	links int
	sent  int
}

func newPublisher(t testing.TB, url, q string, links int) *publisher {
	return &publisher{conn: dial(t, url), q: q, links: links}
}

// send publishes n messages and returns once the broker has them all.
func (p *publisher) send(t testing.TB, n int) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	err := publish.Send(ctx, p.conn, publish.Target{Address: p.q, Capabilities: []string{"queue"}}, p.links, n,
		func(k int) *amqp.Message {
			m := amqp.NewMessage([]byte("backlog"))
			m.Header = &amqp.MessageHeader{Durable: true}
			m.ApplicationProperties = map[string]any{"seq": int64(p.sent + k)}
			return m
		})
	if err != nil {
		t.Fatalf("publish: %v", err)
	}
	p.sent += n
}

// A slow consumer (its own process, 4 workers of 20 ms) over a backlog of
// 300,000 messages (AMQPSUB_BACKLOG=1000000 for a million, as
// docs/reliability.md reports; 200,000 with -short): it never holds more
// than the credit, and its RSS with the big backlog is within 10% of its
// RSS with 10k, 30 times smaller. A consumer whose memory followed the
// backlog would fail at either size; the million costs a minute more.
func TestFaultBacklog(t *testing.T) {
	b := dedicatedBroker(t)
	target := 300_000
	if testing.Short() {
		target = 200_000
	}
	if v := os.Getenv("AMQPSUB_BACKLOG"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 50_000 {
			t.Fatalf("AMQPSUB_BACKLOG=%q: want a number ≥ 50000", v)
		}
		target = n
	}
	const credit = 256
	q := queueName(t)
	// Drop the backlog afterwards: restarting the broker over it is slow.
	t.Cleanup(func() {
		for _, cmd := range []string{"kill9", "reset", "start"} {
			if out, err := b.run(cmd); err != nil {
				t.Errorf("artemis.sh %s: %v\n%s", cmd, err, out)
			}
		}
	})
	pub := newPublisher(t, b.url, q, 4)
	pub.send(t, 31_000)
	ch := startChild(t, childConfig{
		URL: b.url, Queue: q, Credit: credit, Workers: 4, Delay: 20 * time.Millisecond, Warm: 20_000,
		Grace: 5 * time.Second, Report: 200 * time.Millisecond,
	})
	// sample waits for n more stats lines and returns them.
	sample := func(n int) []childStats {
		i := ch.nstats()
		waitFor(t, time.Minute, fmt.Sprintf("%d stats lines", n), func() bool { return ch.nstats() >= i+n })
		return ch.statsSince(i)
	}
	maxRSS := func(ss []childStats) int64 {
		var m int64
		for _, s := range ss {
			m = max(m, s.RSSKiB)
		}
		return m
	}
	waitFor(t, time.Minute, "the consumer warmed up", func() bool { return ch.last().Accepted >= 20_000 })
	small := sample(15)
	rssSmall, backlogSmall := maxRSS(small), pub.sent-int(small[len(small)-1].Accepted)

	start := time.Now()
	// The consumer goes on while the RSS is sampled: publish a margin past
	// the target.
	const margin = 50_000
	for pub.sent-int(ch.last().Accepted) < target+margin {
		pub.send(t, min(100_000, target+margin-(pub.sent-int(ch.last().Accepted))+1000))
		t.Logf("published %d in %v; consumer: %+v", pub.sent, time.Since(start).Round(time.Second), ch.last())
	}
	big := sample(15)
	rssBig, backlogBig := maxRSS(big), pub.sent-int(big[len(big)-1].Accepted)

	took := ch.sigterm(t, time.Minute)
	final := ch.last()
	ch.mu.Lock()
	maxHeldSeen := 0
	for _, s := range ch.stats {
		maxHeldSeen = max(maxHeldSeen, s.Held)
	}
	lines := len(ch.stats)
	ch.mu.Unlock()
	growth := float64(rssBig-rssSmall) / float64(rssSmall)
	t.Logf("consumer RSS %d KiB at a backlog of %d, %d KiB at %d (%+.1f%%); held at most %d of credit %d (%d samples), MaxHeld %d; accepted %d; exit after SIGTERM %v",
		rssSmall, backlogSmall, rssBig, backlogBig, 100*growth, maxHeldSeen, credit, lines, final.MaxHeld, final.Accepted, took.Round(time.Millisecond))
	if backlogBig < target {
		t.Errorf("backlog %d, want ≥ %d", backlogBig, target)
	}
	if final.MaxHeld > credit || maxHeldSeen > credit {
		t.Errorf("held up to %d (MaxHeld %d), past the credit %d", maxHeldSeen, final.MaxHeld, credit)
	}
	if growth > 0.10 || growth < -0.10 {
		t.Errorf("consumer RSS went from %d KiB to %d KiB (%+.1f%%), want within 10%%", rssSmall, rssBig, 100*growth)
	}
}
