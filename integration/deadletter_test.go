package integration

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/amqpsub/amqpsub/amqpsub"
)

// A dead-letter reader starts before the first dead letter (WaitForQueue:
// its queue does not exist yet), and DeadLetterCopy keeps the reason that
// Artemis drops from a rejection. A rejection made before the queue's
// dead-letter queue exists cannot be copied (under our broker.xml Artemis
// creates it with the first dead letter): it is rejected as without the
// option, and creates the queue; later ones keep their reason.
func TestArtemisDeadLetterCopyKeepsTheReason(t *testing.T) {
	url := artemisURL(t)
	q := queueName(t)
	conn := dial(t, url)

	type dead struct {
		seq                 int
		reason, description any
		origQueue           any
	}
	var mu sync.Mutex
	var deads []dead
	reader, err := amqpsub.New(amqpsub.Dial(url, nil), dlq(q), amqpsub.HandlerFunc(func(_ context.Context, d *amqpsub.Delivery) error {
		ap := d.ApplicationProperties()
		mu.Lock()
		defer mu.Unlock()
		deads = append(deads, dead{seqOf(d), ap["DeadLetterReason"], ap["DeadLetterErrorDescription"], ap["_AMQ_ORIG_QUEUE"]})
		return nil
	}), amqpsub.WaitForQueue(), amqpsub.Backoff(50*time.Millisecond, 200*time.Millisecond), amqpsub.Logger(logger(t)))
	if err != nil {
		t.Fatal(err)
	}
	stopReader, waitReader := runSub(t, reader)

	publishFast(t, conn, q, true, uniqueSeqs(1, 0))
	var handled atomic.Int64
	s, err := amqpsub.New(amqpsub.Dial(url, nil), q, amqpsub.HandlerFunc(func(_ context.Context, d *amqpsub.Delivery) error {
		handled.Add(1)
		if seqOf(d) < 0 {
			return nil
		}
		return amqpsub.RejectWith("malformed", "no customer in order")
	}), amqpsub.DeadLetterCopy("DLQ::DLQ.{queue}"), amqpsub.Logger(logger(t)))
	if err != nil {
		t.Fatal(err)
	}
	stop, wait := runSub(t, s)
	waitFor(t, 30*time.Second, "the first dead letter read", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(deads) == 1
	})
	publishFast(t, conn, q, true, uniqueSeqs(2, 0))
	waitFor(t, 30*time.Second, "the 3 dead letters read", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(deads) == 3
	})
	stop()
	if err := wait(); err != nil {
		t.Fatal(err)
	}
	stopReader()
	if err := waitReader(); err != nil {
		t.Fatal(err)
	}
	st := s.Stats()
	if st.Results.Reject != 3 || st.DeadLetterCopies != 2 || st.Settled.Rejected != 1 || st.Settled.Accepted != 4 {
		t.Fatalf("stats %v", st)
	}
	mu.Lock()
	defer mu.Unlock()
	if deads[0].reason != nil {
		t.Fatalf("the first dead letter has a reason: %+v", deads[0])
	}
	withReason := 0
	for _, d := range deads {
		if d.reason != nil {
			withReason++
			if d.reason != "malformed" || d.description != "no customer in order" || d.origQueue != q {
				t.Fatalf("dead letter %+v", d)
			}
		}
	}
	if withReason != 2 {
		t.Fatalf("%d of 3 dead letters carry the reason, want 2 (the first creates the queue): %+v", withReason, deads)
	}
	if rs := reader.Stats(); rs.Reconnects != 0 || rs.Settled.Accepted != 3 {
		t.Fatalf("reader stats %v", rs)
	}
}
