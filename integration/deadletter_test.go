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

	"github.com/Azure/go-amqp"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/amqpsub/amqpsub/amqpsub"
)

// DeadLetterCopy attaches to the dead-letter address with the queue, so no
// rejection can lose its reason for want of the dead-letter queue: without
// it Run fails at once with the broker's amqp:not-found and no delivery is
// taken; with WaitForQueue the subscriber waits, and once the queue is
// created every rejection keeps its reason. A copy the broker refuses
// later (the dead-letter queue deleted under the running subscriber) is
// rejected as without the option, and says so: the event, the counter, and
// Delivery.DeadLetterCopied in OnSettled.
func TestArtemisDeadLetterCopyKeepsTheReason(t *testing.T) {
	url := artemisURL(t)
	q := queueName(t)
	conn := dial(t, url)
	publishFast(t, conn, q, true, uniqueSeqs(3, 0))
	var handled, copyFailed, copied atomic.Int64
	var mu sync.Mutex
	var notes []string // what DeadLetterCopied says once each delivery is settled
	h := amqpsub.HandlerFunc(func(_ context.Context, d *amqpsub.Delivery) error {
		handled.Add(1)
		d.OnSettled(func(o amqpsub.Outcome, _ error) {
			addr, err := d.DeadLetterCopied()
			kind := "rejection"
			if seqOf(d) < 0 {
				kind = "barrier"
			}
			mu.Lock()
			defer mu.Unlock()
			notes = append(notes, fmt.Sprintf("%s %v %q %v", kind, o, addr, err != nil))
		})
		if seqOf(d) < 0 {
			return nil
		}
		return amqpsub.RejectWith("malformed", "no customer in order")
	})
	opts := []amqpsub.Option{amqpsub.DeadLetterCopy("DLQ::DLQ.{queue}"), amqpsub.Logger(logger(t)),
		amqpsub.OnEvent(func(e amqpsub.Event) {
			switch e.Kind {
			case amqpsub.EventDeadLetterCopyFailed:
				copyFailed.Add(1)
			case amqpsub.EventDeadLetterCopied:
				copied.Add(1)
			}
		})}

	// No dead-letter queue: Run fails before taking anything.
	s, err := amqpsub.New(amqpsub.Dial(url, nil), q, h, opts...)
	if err != nil {
		t.Fatal(err)
	}
	_, wait := runSub(t, s)
	var ae *amqp.Error
	if err := wait(); !errors.As(err, &ae) || ae.Condition != amqp.ErrCondNotFound || !strings.Contains(err.Error(), "DLQ::DLQ."+q) {
		t.Fatalf("Run without the dead-letter queue = %v, want amqp:not-found naming it", err)
	}
	if handled.Load() != 0 || s.Stats().Received != 0 {
		t.Fatalf("handled %d, %v: want nothing taken", handled.Load(), s.Stats())
	}

	// WaitForQueue: it waits for the queue, then keeps every reason.
	core, logs := observer.New(zap.InfoLevel)
	s, err = amqpsub.New(amqpsub.Dial(url, nil), q, h, append(opts, amqpsub.WaitForQueue(),
		amqpsub.Backoff(50*time.Millisecond, 200*time.Millisecond), amqpsub.Logger(zap.New(core)))...)
	if err != nil {
		t.Fatal(err)
	}
	stop, wait := runSub(t, s)
	waitFor(t, 30*time.Second, "the subscriber waiting for the dead-letter queue", func() bool {
		return logs.FilterMessageSnippet("waiting for it").Len() > 0
	})
	if st := s.Stats(); st.Received != 0 {
		t.Fatalf("received before the dead-letter queue exists: %v", st)
	}
	// A dead-letter reader, also started before its queue exists
	// (WaitForQueue on a receiver), reads the copies as the broker has them.
	type dead struct{ reason, description, origQueue any }
	var deads []dead
	reader, err := amqpsub.New(amqpsub.Dial(url, nil), dlq(q), amqpsub.HandlerFunc(func(_ context.Context, d *amqpsub.Delivery) error {
		ap := d.ApplicationProperties()
		mu.Lock()
		defer mu.Unlock()
		deads = append(deads, dead{ap["DeadLetterReason"], ap["DeadLetterErrorDescription"], ap["_AMQ_ORIG_QUEUE"]})
		return nil
	}), amqpsub.WaitForQueue(), amqpsub.Backoff(50*time.Millisecond, 200*time.Millisecond), amqpsub.Logger(logger(t)))
	if err != nil {
		t.Fatal(err)
	}
	stopReader, waitReader := runSub(t, reader)
	createDeadLetterQueue(t, q)
	waitFor(t, 30*time.Second, "the 3 rejections copied", func() bool { return s.Stats().DeadLetterCopies == 3 })
	waitFor(t, 30*time.Second, "the 3 copies read from the dead-letter queue", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(deads) == 3
	})
	stopReader()
	if err := waitReader(); err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	for _, d := range deads {
		if d.reason != "malformed" || d.description != "no customer in order" || d.origQueue != q {
			mu.Unlock()
			t.Fatalf("dead letter %+v: want the reason, its description and the original queue", d)
		}
	}
	mu.Unlock()

	// The dead-letter queue deleted under the subscriber: the next copy
	// is refused, and the rejection goes to the broker without its reason.
	ctl(t, "queue", "delete", "--name", "DLQ."+q, "--removeConsumers", "--silent")
	publishFast(t, conn, q, true, uniqueSeqs(1, 0))
	// publishFast's barrier follows the fourth message, and a stop releases
	// whatever is not settled yet: stop once all six deliveries (four
	// rejections, two barriers) have had their settlement applied.
	waitFor(t, 30*time.Second, "the fourth rejection and its barrier settled", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(notes) == 6
	})
	stop()
	if err := wait(); err != nil {
		t.Fatal(err)
	}
	st := s.Stats()
	if st.Results.Reject != 4 || st.DeadLetterCopies != 3 || st.DeadLetterCopyFailures != 1 ||
		st.Settled.Rejected != 1 || st.Settled.Accepted != 5 || copyFailed.Load() != 1 || copied.Load() != 3 {
		t.Fatalf("stats %v, %d copy-failed and %d copied events", st, copyFailed.Load(), copied.Load())
	}
	mu.Lock()
	defer mu.Unlock()
	wantNotes := map[string]int{
		`barrier accepted "" false`:                               2,
		fmt.Sprintf(`rejection accepted %q false`, "DLQ::DLQ."+q): 3,
		fmt.Sprintf(`rejection rejected %q true`, "DLQ::DLQ."+q):  1,
	}
	gotNotes := map[string]int{}
	for _, n := range notes {
		gotNotes[n]++
	}
	if fmt.Sprint(gotNotes) != fmt.Sprint(wantNotes) {
		t.Fatalf("DeadLetterCopied in OnSettled: %v, want %v", gotNotes, wantNotes)
	}
}

// A dead-letter queue deleted under a running subscriber, then the
// connection lost: the reconnect goes on without the dead-letter sender
// (only the first attach requires it), and the subscriber consumes on.
func TestArtemisDeadLetterQueueGoneAtAReconnect(t *testing.T) {
	url := artemisURL(t)
	q := queueName(t)
	createDeadLetterQueue(t, q)
	px := newProxy(t, strings.TrimPrefix(url, "amqp://"))
	conn := dial(t, url)
	publishFast(t, conn, q, true, uniqueSeqs(2, 0))
	var barriers atomic.Int64
	s, err := amqpsub.New(amqpsub.Dial(px.url(), nil), q, amqpsub.HandlerFunc(func(_ context.Context, d *amqpsub.Delivery) error {
		if seqOf(d) < 0 {
			barriers.Add(1)
			return nil
		}
		return amqpsub.Reject("bad")
	}), amqpsub.DeadLetterCopy("DLQ::DLQ.{queue}"), amqpsub.Backoff(50*time.Millisecond, 200*time.Millisecond),
		amqpsub.Logger(logger(t)))
	if err != nil {
		t.Fatal(err)
	}
	stop, wait := runSub(t, s)
	waitFor(t, 30*time.Second, "2 copies and the barrier", func() bool {
		return s.Stats().DeadLetterCopies == 2 && barriers.Load() == 1
	})
	ctl(t, "queue", "delete", "--name", "DLQ."+q, "--removeConsumers", "--silent")
	px.cut()
	px.acceptAgain()
	publishFast(t, conn, q, true, uniqueSeqs(1, 0))
	waitFor(t, 30*time.Second, "the second barrier, after the reconnect", func() bool { return barriers.Load() == 2 })
	stop()
	if err := wait(); err != nil {
		t.Fatalf("Run: %v", err)
	}
	if st := s.Stats(); st.Reconnects < 1 || st.Results.Reject != 3 {
		t.Fatalf("stats %v: want a reconnect and the third rejection handled", st)
	}
}

// createDeadLetterQueue creates DLQ.<q> on the address DLQ as
// auto-create-dead-letter-resources would (docs/brokers.md's recipe).
func createDeadLetterQueue(t *testing.T, q string) {
	t.Helper()
	ctl(t, "queue", "create", "--name", "DLQ."+q, "--address", "DLQ",
		"--anycast", "--durable", "--filter", "_AMQ_ORIG_ADDRESS = '"+q+"'",
		"--preserve-on-no-consumers", "--auto-create-address", "--silent")
}

// The recipe of docs/brokers.md for a dead-letter queue created ahead of
// the first dead letter (the Artemis CLI's queue create, with the filter
// auto-creation would give it): the very first rejection keeps its reason,
// and no copy fails.
func TestArtemisPrecreatedDeadLetterQueueKeepsTheFirstReason(t *testing.T) {
	url := artemisURL(t)
	q := queueName(t)
	createDeadLetterQueue(t, q)
	conn := dial(t, url)
	publishFast(t, conn, q, true, uniqueSeqs(3, 0))
	s, err := amqpsub.New(amqpsub.Dial(url, nil), q, amqpsub.HandlerFunc(func(_ context.Context, d *amqpsub.Delivery) error {
		if seqOf(d) < 0 {
			return nil // publishFast's barrier
		}
		return amqpsub.Reject("malformed")
	}), amqpsub.DeadLetterCopy("DLQ::DLQ.{queue}"), amqpsub.Logger(logger(t)))
	if err != nil {
		t.Fatal(err)
	}
	stop, wait := runSub(t, s)
	waitFor(t, 30*time.Second, "3 rejections and the barrier", func() bool {
		r := s.Stats().Results
		return r.Reject == 3 && r.Accept == 1
	})
	stop()
	if err := wait(); err != nil {
		t.Fatal(err)
	}
	if st := s.Stats(); st.DeadLetterCopies != 3 || st.DeadLetterCopyFailures != 0 || st.Settled.Rejected != 0 {
		t.Fatalf("stats %v", st)
	}
	var reasons []any
	var mu sync.Mutex
	reader, err := amqpsub.New(amqpsub.Dial(url, nil), dlq(q), amqpsub.HandlerFunc(func(_ context.Context, d *amqpsub.Delivery) error {
		mu.Lock()
		defer mu.Unlock()
		reasons = append(reasons, d.ApplicationProperties()["DeadLetterReason"])
		return nil
	}), amqpsub.Logger(logger(t)))
	if err != nil {
		t.Fatal(err)
	}
	stopReader, waitReader := runSub(t, reader)
	waitFor(t, 30*time.Second, "3 dead letters", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(reasons) >= 3
	})
	stopReader()
	if err := waitReader(); err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	defer mu.Unlock()
	if fmt.Sprint(reasons) != "[malformed malformed malformed]" {
		t.Fatalf("reasons %v", reasons)
	}
}
