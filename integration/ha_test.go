package integration

import (
	"context"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/Azure/go-amqp"

	"github.com/amqpsub/amqpsub/amqpsub"
)

// TestArtemisSharedStoreHA kills the primary of a shared-store pair with
// kill -9 and checks that the backup becomes live with every message: those
// never delivered, and those delivered to a consumer that had not settled
// them. Two consumers see the failover: a plain go-amqp receiver holding
// unsettled deliveries, and an amqpsub subscriber given both addresses
// (DialFailover), which moves to the backup by itself and keeps running.
func TestArtemisSharedStoreHA(t *testing.T) {
	tp := startTopology(t, "ha")
	primary, backup := tp.url(t, "primary"), tp.url(t, "backup")

	// A passive backup opens no acceptor.
	if c, err := dialWithin(backup, 2*time.Second); err == nil {
		c.Close()
		t.Fatalf("the backup accepts AMQP connections while the primary is live")
	}
	conn := dial(t, primary)
	t.Logf("the primary's open frame properties: %v", conn.Properties())

	// The raw consumer's queue: 500 messages; 50 delivered and not settled
	// when the primary dies.
	const rawN, held = 500, 50
	qRaw := queueName(t)
	publishFast(t, conn, qRaw, true, uniqueSeqs(rawN, 0))
	r := rawReceiver(t, conn, qRaw, held)
	var heldSeqs []int
	func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		for range held {
			m, err := r.Receive(ctx, nil)
			if err != nil {
				t.Fatalf("receive from the primary: %v", err)
			}
			v, _ := m.ApplicationProperties["seq"].(int64)
			heldSeqs = append(heldSeqs, int(v))
		}
	}()

	// The amqpsub subscriber's queue: 3,000 messages over 20 groups, 2 ms a
	// message; the primary dies once 500 are handled.
	const subN, subGroups = 3000, 20
	qSub := queueName(t)
	publishFast(t, conn, qSub, true, uniqueSeqs(subN, subGroups))
	var mu sync.Mutex
	firsts := map[int]bool{}
	handled, dups, outOfOrder := 0, 0, 0
	lastFirst := map[string]int{} // per group, the highest seq handled
	var afterKill time.Time
	var firstOnBackup, reconnectedAfter time.Duration
	var reconnectedTo string
	var subp atomic.Pointer[amqpsub.Subscriber]
	h := func() amqpsub.Handler {
		return amqpsub.HandlerFunc(func(ctx context.Context, d *amqpsub.Delivery) error {
			seq := seqOf(d)
			if seq == -1 {
				return nil
			}
			time.Sleep(2 * time.Millisecond)
			mu.Lock()
			defer mu.Unlock()
			handled++
			// Reconnects counts the new link before its first delivery.
			if firstOnBackup == 0 && subp.Load().Stats().Reconnects > 0 {
				firstOnBackup = time.Since(afterKill)
			}
			if firsts[seq] {
				dups++
				return nil
			}
			firsts[seq] = true
			// A first handling must be the group's next message: a message
			// seen for the first time after a later one of its group is a gap.
			g := d.GroupID()
			if last, ok := lastFirst[g]; ok && seq < last {
				outOfOrder++
			}
			lastFirst[g] = max(lastFirst[g], seq)
			return nil
		})
	}
	conns, err := amqpsub.DialFailover([]string{primary, backup}, nil)
	if err != nil {
		t.Fatal(err)
	}
	sub, err := amqpsub.New(conns, qSub, h(), amqpsub.WorkersByKey(4),
		amqpsub.Backoff(50*time.Millisecond, 500*time.Millisecond), amqpsub.Logger(logger(t)),
		amqpsub.OnEvent(func(e amqpsub.Event) {
			if e.Kind == amqpsub.EventReconnected {
				mu.Lock()
				reconnectedTo, reconnectedAfter = e.Broker, time.Since(afterKill)
				mu.Unlock()
			}
		}))
	if err != nil {
		t.Fatal(err)
	}
	subp.Store(sub)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	subDone := make(chan error, 1)
	go func() { subDone <- sub.Run(ctx) }()
	waitFor(t, time.Minute, "500 messages handled on the primary", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return handled >= 500
	})

	// kill -9 of the primary; from then on, dial the backup until it
	// answers an AMQP open.
	lostRaw := make(chan time.Time, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		_, err := r.Receive(ctx, nil)
		lostRaw <- time.Now()
		if err == nil {
			t.Errorf("the raw receiver got a message after its held ones")
		}
	}()
	// Every time below runs from the start of `kill9`, which returns once
	// the process is gone (reaped), a second or so after the kill.
	killed := time.Now()
	mu.Lock()
	afterKill = killed
	mu.Unlock()
	type liveConn struct {
		c   *amqp.Conn
		at  time.Duration
		err error
	}
	liveC := make(chan liveConn, 1)
	go func() {
		for {
			c, err := dialWithin(backup, time.Second)
			if err == nil || time.Since(killed) > 2*time.Minute {
				liveC <- liveConn{c, time.Since(killed), err}
				return
			}
			time.Sleep(20 * time.Millisecond)
		}
	}()
	kill := tp.timed(t, "kill9", "primary")
	lc := <-liveC
	if lc.err != nil {
		t.Fatalf("the backup did not accept an AMQP connection within 2 min of the kill: %v", lc.err)
	}
	bconn, live := lc.c, lc.at
	t.Cleanup(func() { bconn.Close() })
	lostAfter := (<-lostRaw).Sub(killed) // when the process died, give or take
	waitLive := tp.do(t, "wait-live", "backup", "10")

	// Every message of the raw queue is on the backup, the held ones too.
	r2 := rawReceiver(t, bconn, qRaw, 100)
	got := receiveN(t, r2, rawN+1, time.Minute)
	seen := map[int]bool{}
	var heldCounts []uint32
	for _, m := range got {
		v, _ := m.ApplicationProperties["seq"].(int64)
		seen[int(v)] = true
		if slices.Contains(heldSeqs, int(v)) {
			heldCounts = append(heldCounts, m.Header.DeliveryCount)
		}
	}
	if len(got) != rawN+1 || len(seen) != rawN+1 {
		t.Fatalf("the backup gave %d messages (%d distinct) of the %d sent to the primary", len(got), len(seen), rawN+1)
	}
	slices.Sort(heldCounts)
	heldCounts = slices.Compact(heldCounts)

	waitFor(t, 2*time.Minute, "every subscriber message handled", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(firsts) >= subN
	})
	cancel()
	if err := <-subDone; err != nil {
		t.Fatalf("the subscriber: %v", err)
	}
	mu.Lock()
	defer mu.Unlock()
	if outOfOrder != 0 {
		t.Errorf("%d messages handled for the first time after a later one of their group", outOfOrder)
	}
	if dups > 256 {
		t.Errorf("%d duplicates, want at most the credit (256)", dups)
	}
	if firstOnBackup == 0 {
		t.Errorf("no message was handled on the backup: the kill came after the last one, and the failover was not tested")
	}
	if reconnectedTo != backup && reconnectedTo != redactURL(backup) {
		t.Errorf("the subscriber reconnected to %q, want the backup %s", reconnectedTo, redactURL(backup))
	}
	t.Logf("from the start of `kill9 primary` (which took %v): the raw receiver's link failed after %v; the backup accepted AMQP after %v "+
		"(failover %v after the link failed; wait-live: %s); the backup had all %d raw messages, the %d held unsettled among them (delivery-count %v); "+
		"the amqpsub subscriber reconnected to %s after %v and handled its first message there after %v; "+
		"%d subscriber messages handled %d times in all: %d duplicates, %d first handlings out of group order",
		kill.Round(time.Millisecond), lostAfter.Round(time.Millisecond), live.Round(time.Millisecond),
		(live - lostAfter).Round(time.Millisecond), waitLive,
		rawN+1, held, heldCounts, reconnectedTo, reconnectedAfter.Round(time.Millisecond), firstOnBackup.Round(time.Millisecond),
		subN, handled, dups, outOfOrder)
}
