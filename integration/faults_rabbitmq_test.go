//go:build chaos

package integration

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/amqpsub/amqpsub/amqpsub"
)

// Faults injected on RabbitMQ. They run with -tags chaos (make
// faults-all), not in make test, whose fault scenarios run on Artemis and
// the Service Bus peer.

// The broker closes every connection mid-run: the subscriber reconnects and
// every message is handled; what was held at the cut comes again (at least
// once), nothing is lost.
func TestRabbitMQ4ConnectionClosedMidRun(t *testing.T) {
	for _, name := range []string{onRabbitMQ4Classic, onRabbitMQ4Quorum} {
		t.Run(name[len("rabbitmq4/"):], func(t *testing.T) {
			tg := newTarget(t, name)
			const n = 4000
			q, _ := tg.filled(t, uniqueSeqs(n, 0))
			var mu sync.Mutex
			seen := map[int]int{}
			var handled atomic.Int64
			s := tg.subscriber(t, q, amqpsub.HandlerFunc(func(ctx context.Context, d *amqpsub.Delivery) error {
				if seqOf(d) == -1 {
					return nil
				}
				time.Sleep(2 * time.Millisecond) // 4,000 take 2 s: the close comes mid-run
				mu.Lock()
				seen[seqOf(d)]++
				mu.Unlock()
				handled.Add(1)
				return nil
			}), amqpsub.Workers(4), amqpsub.Backoff(50*time.Millisecond, time.Second))
			stop, wait := runSub(t, s)
			waitFor(t, time.Minute, "1,000 handled", func() bool { return handled.Load() >= 1000 })
			// Closing the test's own publisher connection too is fine: it
			// is done.
			rabbit4(t, "ctl", "close_all_connections", "amqpsub integration test")
			waitFor(t, 2*time.Minute, "every message handled on a new link", func() bool {
				mu.Lock()
				defer mu.Unlock()
				return len(seen) >= n && s.Stats().Links >= 2
			})
			stop()
			if err := wait(); err != nil {
				t.Fatalf("Run = %v", err)
			}
			st := s.Stats()
			mu.Lock()
			defer mu.Unlock()
			dups := 0
			for _, c := range seen {
				dups += c - 1
			}
			t.Logf("links %d, lost %d, duplicates %d", st.Links, st.LinksLost, dups)
			if st.LinksLost < 1 || st.Links < 2 {
				t.Fatalf("the close was not seen: stats %+v", st)
			}
			if len(seen) != n || dups > 256+4 {
				t.Fatalf("%d distinct of %d, %d duplicates (at most what was held)", len(seen), n, dups)
			}
			tg.assertDrained(t, dial(t, tg.url), q) // the close took the publisher's connection too
		})
	}
}
