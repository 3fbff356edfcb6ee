package integration

import (
	"context"
	"fmt"
	"os"
	"os/exec"
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
	var handled, copyFailed, copied atomic.Int64
	// What DeadLetterCopied says once each delivery is settled.
	var notes []string
	s, err := amqpsub.New(amqpsub.Dial(url, nil), q, amqpsub.HandlerFunc(func(_ context.Context, d *amqpsub.Delivery) error {
		handled.Add(1)
		d.OnSettled(func(o amqpsub.Outcome, _ error) {
			addr, err := d.DeadLetterCopied()
			mu.Lock()
			defer mu.Unlock()
			kind := "rejection"
			if seqOf(d) < 0 {
				kind = "barrier"
			}
			notes = append(notes, fmt.Sprintf("%s %v %q %v", kind, o, addr, err != nil))
		})
		if seqOf(d) < 0 {
			return nil
		}
		return amqpsub.RejectWith("malformed", "no customer in order")
	}), amqpsub.DeadLetterCopy("DLQ::DLQ.{queue}"), amqpsub.Logger(logger(t)), amqpsub.OnEvent(func(e amqpsub.Event) {
		switch e.Kind {
		case amqpsub.EventDeadLetterCopyFailed:
			copyFailed.Add(1)
		case amqpsub.EventDeadLetterCopied:
			copied.Add(1)
		}
	}))
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
	if st.Results.Reject != 3 || st.DeadLetterCopies != 2 || st.DeadLetterCopyFailures != 1 ||
		st.Settled.Rejected != 1 || st.Settled.Accepted != 4 || copyFailed.Load() != 1 || copied.Load() != 2 {
		t.Fatalf("stats %v, %d copy-failed and %d copied events", st, copyFailed.Load(), copied.Load())
	}
	mu.Lock()
	defer mu.Unlock()
	// The barriers were handled: no copy. The first rejection's copy
	// failed: rejected; the next two were copied, then accepted.
	wantNotes := map[string]int{
		`barrier accepted "" false`:                               2,
		fmt.Sprintf(`rejection rejected %q true`, "DLQ::DLQ."+q):  1,
		fmt.Sprintf(`rejection accepted %q false`, "DLQ::DLQ."+q): 2,
	}
	gotNotes := map[string]int{}
	for _, n := range notes {
		gotNotes[n]++
	}
	if fmt.Sprint(gotNotes) != fmt.Sprint(wantNotes) {
		t.Fatalf("DeadLetterCopied in OnSettled: %v, want %v", gotNotes, wantNotes)
	}
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

// The recipe of docs/brokers.md for a dead-letter queue created ahead of
// the first dead letter (the Artemis CLI's queue create, with the filter
// auto-creation would give it): the very first rejection keeps its reason,
// and no copy fails.
func TestArtemisPrecreatedDeadLetterQueueKeepsTheFirstReason(t *testing.T) {
	url := artemisURL(t)
	ctl := os.Getenv("AMQPSUB_ARTEMIS_CTL")
	if ctl == "" {
		t.Fatal("AMQPSUB_ARTEMIS_CTL is empty: this test creates a queue with `integration/artemis.sh cli` (`make test` sets it)")
	}
	q := queueName(t)
	out, err := exec.Command("bash", ctl, "cli", "queue", "create", "--name", "DLQ."+q, "--address", "DLQ",
		"--anycast", "--durable", "--filter", "_AMQ_ORIG_ADDRESS = '"+q+"'",
		"--preserve-on-no-consumers", "--auto-create-address", "--silent").CombinedOutput()
	if err != nil {
		t.Fatalf("artemis queue create: %v\n%s", err, out)
	}
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
