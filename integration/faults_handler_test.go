package integration

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/Azure/go-amqp"
	"go.uber.org/zap"

	"github.com/amqpsub/amqpsub/amqpsub"
)

// Handlers that panic.

// The handler panics on every 100th message: the subscriber survives, each
// of those is retried until the broker's max-delivery-attempts (5) and
// dead-lettered, and the counts match.
func TestFaultPanics(t *testing.T) {
	tg := newTarget(t, onArtemis)
	url := tg.url
	const n, every, attempts = 2000, 100, 5
	q, conn := tg.filled(t, uniqueSeqs(n, 20))
	const poison = n / every

	var accepted, panicking atomic.Int64
	var mu sync.Mutex
	calls := map[int]int{}
	s, err := amqpsub.New(amqpsub.Dial(url, nil), q, amqpsub.HandlerFunc(func(ctx context.Context, d *amqpsub.Delivery) error {
		seq := seqOf(d)
		if seq >= 0 && seq%every == every-1 {
			mu.Lock()
			calls[seq]++
			mu.Unlock()
			panicking.Add(1)
			panic(fmt.Sprintf("bug on message %d", seq))
		}
		accepted.Add(1)
		return nil
	}), amqpsub.WorkersByKey(4), amqpsub.Logger(zap.NewNop()))
	if err != nil {
		t.Fatal(err)
	}
	stop, wait := runSub(t, s)
	waitFor(t, time.Minute, "every message handled or dead-lettered", func() bool {
		st := s.Stats()
		return accepted.Load() == n-poison+1 && st.Settled.Modified == poison*attempts
	})
	// No sixth delivery of a poison message can follow: nothing is left in
	// the queue, queued or out.
	waitFor(t, 30*time.Second, "the queue empty", func() bool { return queueAttribute(t, conn, q, "messageCount") == "0" })
	stop()
	if err := wait(); err != nil {
		t.Fatalf("Run = %v", err)
	}
	st := s.Stats()
	t.Logf("panics %d, modified %d, accepted %d; stats %v", st.Results.Panics, st.Settled.Modified, st.Settled.Accepted, st)
	if st.Results.Panics != poison*attempts || st.Results.Retry != poison*attempts || st.Settled.Modified != poison*attempts ||
		st.Settled.Accepted != n-poison+1 || st.Settled.Rejected != 0 || st.Held != 0 {
		t.Fatalf("stats %+v, want %d panics and modified, %d accepted", st, poison*attempts, n-poison+1)
	}
	mu.Lock()
	for seq, k := range calls {
		if k != attempts {
			t.Errorf("message %d handled %d times, want %d", seq, k, attempts)
		}
	}
	if len(calls) != poison {
		t.Errorf("%d distinct poison messages, want %d", len(calls), poison)
	}
	mu.Unlock()
	// The DLQ exists now (its queue is made by the first dead letter); the
	// broker counts what it holds.
	if n := queueAttribute(t, conn, "DLQ."+q, "messageCount"); n != fmt.Sprint(poison) {
		t.Fatalf("DLQ holds %s messages, want %d", n, poison)
	}
	dead := receiveN(t, attachRetrying(t, conn, dlq(q)), poison, 30*time.Second)
	seen := map[int64]bool{}
	for _, m := range dead {
		seq, _ := m.ApplicationProperties["seq"].(int64)
		if seq%every != every-1 || seen[seq] {
			t.Errorf("dead letter seq %d: not a poison message, or twice", seq)
		}
		seen[seq] = true
	}
	if len(dead) != poison {
		t.Fatalf("DLQ holds %d messages, want %d", len(dead), poison)
	}
	assertQueueEmpty(t, conn, q)
}

// attachRetrying attaches a receiver to address, retrying amqp:not-found for
// up to 10 s (a DLQ queue appears with its first dead letter).
func attachRetrying(t testing.TB, conn *amqp.Conn, address string) *amqp.Receiver {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		sess, err := conn.NewSession(ctx, nil)
		if err != nil {
			cancel()
			t.Fatalf("session: %v", err)
		}
		r, err := sess.NewReceiver(ctx, address, &amqp.ReceiverOptions{Credit: 100, SourceCapabilities: []string{"queue"}})
		cancel()
		if err == nil {
			t.Cleanup(func() { closeSession(sess) })
			return r
		}
		closeSession(sess)
		var ae *amqp.Error
		if !errors.As(err, &ae) || ae.Condition != amqp.ErrCondNotFound || time.Now().After(deadline) {
			t.Fatalf("receiver on %s: %v", address, err)
		}
		time.Sleep(100 * time.Millisecond)
	}
}
