package integration

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/amqpsub/amqpsub/amqpsub"
)

// Faults injected on RabbitMQ.

// The broker closes every connection mid-run: the subscriber reconnects and
// every message is handled; what was held at the cut comes again (at least
// once), nothing is lost.
func TestRabbitMQ4ConnectionClosedMidRun(t *testing.T) {
	url := rabbit4URL(t)
	for _, kind := range rabbit4Kinds {
		t.Run(kind, func(t *testing.T) {
			q := declareRabbit4(t, kind)
			conn := dial(t, url)
			const n = 4000
			specs := uniqueSeqs(n, 0)
			r4publish(t, conn, q, specs)
			var mu sync.Mutex
			seen := map[int]int{}
			var handled atomic.Int64
			s, err := amqpsub.New(amqpsub.Dial(url, nil), q, amqpsub.HandlerFunc(func(ctx context.Context, d *amqpsub.Delivery) error {
				if seqOf(d) == -1 {
					return nil
				}
				time.Sleep(2 * time.Millisecond) // 4,000 take 2 s: the close comes mid-run
				mu.Lock()
				seen[seqOf(d)]++
				mu.Unlock()
				handled.Add(1)
				return nil
			}), amqpsub.WithProfile(amqpsub.RabbitMQ4), amqpsub.Workers(4),
				amqpsub.Backoff(50*time.Millisecond, time.Second), amqpsub.Logger(logger(t)))
			if err != nil {
				t.Fatal(err)
			}
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
			if left := drainQueue(t, dial(t, url), q); len(left) != 0 { // the close took conn too
				t.Fatalf("%d messages left in the queue", len(left))
			}
		})
	}
}
