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

// Reject keeps its reason on the dead-letter sub-queue, and a message that
// keeps failing (Retry) is dead-lettered by the service at its
// MaxDeliveryCount.
func TestServiceBusDeadLetter(t *testing.T) {
	p := serviceBusPeer(t)
	q := p.entity(t, map[string]any{"lock_duration_ms": 5000, "max_delivery_count": 3})
	p.send(t, q, 2)
	var calls sync.Map
	s, _ := amqpsub.New(sbConnector(t, p), q, amqpsub.HandlerFunc(func(ctx context.Context, d *amqpsub.Delivery) error {
		c, _ := calls.LoadOrStore(sbIndex(d), new(atomic.Int32))
		c.(*atomic.Int32).Add(1)
		if sbIndex(d) == 0 {
			return amqpsub.RejectWith("malformed", "no customer in the order")
		}
		return amqpsub.Retry(errors.New("store down"))
	}), amqpsub.Logger(logger(t)))
	stop, wait := runSub(t, s)
	waitFor(t, time.Minute, "2 dead letters", func() bool { return p.info(t, q).DeadLetter == 2 })
	stop()
	if err := wait(); err != nil {
		t.Fatal(err)
	}
	dead := p.messages(t, q+"/$DeadLetterQueue")
	reasons := map[string]string{}
	for _, m := range dead {
		reasons[m.MessageID] = fmt.Sprint(m.AppProps["DeadLetterReason"], "|", m.AppProps["DeadLetterErrorDescription"])
	}
	t.Logf("dead letters %v", reasons)
	if reasons["m-0"] != "malformed|no customer in the order" || !strings.HasPrefix(reasons["m-1"], "MaxDeliveryCountExceeded") {
		t.Fatalf("dead letters %v", reasons)
	}
	if c, _ := calls.Load(1); c.(*atomic.Int32).Load() != 3 {
		t.Fatalf("the failing message was tried %d times, want 3", c.(*atomic.Int32).Load())
	}
	// The dead-letter sub-queue is an address to consume too.
	var read atomic.Int32
	r, _ := amqpsub.New(sbConnector(t, p), q+"/$DeadLetterQueue", amqpsub.HandlerFunc(func(context.Context, *amqpsub.Delivery) error {
		read.Add(1)
		return nil
	}), amqpsub.Logger(logger(t)))
	stopR, waitR := runSub(t, r)
	waitFor(t, 30*time.Second, "2 dead letters read", func() bool { return read.Load() == 2 })
	stopR()
	if err := waitR(); err != nil {
		t.Fatal(err)
	}
}

// A dead-letter queue is read as an entity of its own: its locks are
// renewed, and settled by lock token, on its own $management node
// (<entity>/$DeadLetterQueue/$management), which the peer alone knows them
// at. Handlers of 3 s on 2 s locks, a queue's dead-letter queue and a
// subscription's, and one whose receive link the peer detaches while the
// handlers run: every message is handled once and finished, its lock
// renewed, none lost, and after the detach each is settled by lock token.
// The claims are the dead-letter queue's own.
func TestServiceBusDeadLetterQueueLocksAreRenewed(t *testing.T) {
	t.Parallel() // its entities and counters are its own
	p := serviceBusPeer(t)
	for _, row := range []struct {
		name         string
		subscription bool
		detach       bool
	}{
		{"queue", false, false},
		{"subscription", true, false},
		{"queue after a forced detach", false, true},
	} {
		t.Run(row.name, func(t *testing.T) {
			t.Parallel()
			const lock = 2 * time.Second
			spec := map[string]any{"lock_duration_ms": lock.Milliseconds(), "max_delivery_count": 10}
			var entity, sendTo string
			if row.subscription {
				sendTo = strings.ToLower(queueName(t))
				p.call(t, "POST", "/entities", map[string]any{"name": sendTo, "kind": "topic"}, nil)
				entity = sendTo + "/Subscriptions/sub"
				spec["name"] = entity
				p.call(t, "POST", "/entities", spec, nil)
			} else {
				entity = p.entity(t, spec)
				sendTo = entity
			}
			const n = 6
			deadLetter(t, p, sendTo, entity, n)
			dlq := entity + "/$DeadLetterQueue"

			var mu sync.Mutex
			calls := map[string]int{}
			finished := map[string]bool{}
			running := 0
			allRunning := make(chan struct{})
			s, err := amqpsub.New(sbConnector(t, p), dlq, amqpsub.HandlerFunc(func(ctx context.Context, d *amqpsub.Delivery) error {
				id := fmt.Sprint(d.MessageID())
				mu.Lock()
				calls[id]++
				if running++; running == n {
					close(allRunning)
				}
				mu.Unlock()
				select {
				case <-time.After(lock + lock/2):
				case <-ctx.Done():
					return context.Cause(ctx)
				}
				mu.Lock()
				finished[id] = true
				mu.Unlock()
				return nil
			}), amqpsub.Workers(n), amqpsub.Backoff(50*time.Millisecond, 200*time.Millisecond), amqpsub.Logger(logger(t)))
			if err != nil {
				t.Fatal(err)
			}
			stop, wait := runSub(t, s)
			select {
			case <-allRunning:
			case <-time.After(30 * time.Second):
				t.Fatal("the handlers did not all start")
			}
			claimsDeadLetterQueue(t, p, dlq)
			if row.detach {
				var out struct{ Detached int }
				p.call(t, "POST", "/faults/detach", map[string]any{"entity": dlq}, &out)
				if out.Detached != 1 {
					t.Fatalf("detached %d links, want 1", out.Detached)
				}
			}
			waitFor(t, 30*time.Second, "the dead letters completed", func() bool {
				e := p.info(t, dlq)
				return e.Stats["completed"] == n && e.Available == 0 && e.Locked == 0
			})
			stop()
			if err := wait(); err != nil {
				t.Fatal(err)
			}
			st := s.Stats()
			e := p.info(t, dlq)
			mu.Lock()
			defer mu.Unlock()
			t.Logf("handler calls %v; locks %+v; dead-letter queue %+v", calls, st.Locks, e)
			if len(calls) != n || len(finished) != n {
				t.Fatalf("%d messages handled, %d finished, want %d", len(calls), len(finished), n)
			}
			for id, c := range calls {
				if c != 1 {
					t.Fatalf("%s handled %d times, want once", id, c)
				}
			}
			if st.Locks.Renewed == 0 || st.Locks.Lost != 0 || e.Stats["lock_expired"] != 0 {
				t.Fatalf("locks renewed %d, lost %d, expired on the peer %d: want renewed, none lost",
					st.Locks.Renewed, st.Locks.Lost, e.Stats["lock_expired"])
			}
			if row.detach && st.Locks.SettledByToken != n {
				t.Fatalf("settled by lock token %d, want all %d (their link was detached)", st.Locks.SettledByToken, n)
			}
		})
	}
}

// claimsDeadLetterQueue checks that a connection of the peer holds claims
// for the dead-letter queue dlq and for its own $management node, as
// azservicebus puts them (internal/amqpLinks.go).
func claimsDeadLetterQueue(t *testing.T, p *sbPeer, dlq string) {
	t.Helper()
	var out struct {
		Connections []struct {
			Claims map[string]float64 `json:"claims"`
		} `json:"connections"`
	}
	p.call(t, "GET", "/connections", nil, &out)
	for _, c := range out.Connections {
		_, entity := c.Claims[strings.ToLower(dlq)]
		_, node := c.Claims[strings.ToLower(dlq+"/$management")]
		if entity && node {
			return
		}
	}
	t.Fatalf("no connection claims %s and %s/$management: %+v", dlq, dlq, out.Connections)
}

// deadLetter sends n messages to sendTo and dead-letters them from entity
// (sendTo, or a subscription of it).
func deadLetter(t *testing.T, p *sbPeer, sendTo, entity string, n int) {
	t.Helper()
	p.call(t, "POST", "/messages", map[string]any{"entity": sendTo, "count": n, "message_id_prefix": "m"}, nil)
	s, err := amqpsub.New(sbConnector(t, p), entity, amqpsub.HandlerFunc(func(context.Context, *amqpsub.Delivery) error {
		return amqpsub.RejectWith("poison", "sent to the dead-letter queue by the test")
	}), amqpsub.Logger(logger(t)))
	if err != nil {
		t.Fatal(err)
	}
	stop, wait := runSub(t, s)
	waitFor(t, 30*time.Second, "the messages dead-lettered", func() bool { return p.info(t, entity).DeadLetter == n })
	stop()
	if err := wait(); err != nil {
		t.Fatal(err)
	}
}

// MaxMessageSize on Service Bus dead-letters through
// com.microsoft:dead-letter: the message in the dead-letter sub-queue
// carries amqpsub's DeadLetterReason and DeadLetterErrorDescription.
func TestServiceBusMaxMessageSizeDeadLettersWithAReason(t *testing.T) {
	p := serviceBusPeer(t)
	q := p.entity(t, map[string]any{"lock_duration_ms": 5000})
	p.call(t, "POST", "/messages", map[string]any{"entity": q, "messages": []map[string]any{
		{"message_id": "big", "body": strings.Repeat("x", 2000)},
		{"message_id": "small", "body": "ok"},
	}}, nil)
	var handled sync.Map
	s, err := amqpsub.New(sbConnector(t, p), q, amqpsub.HandlerFunc(func(_ context.Context, d *amqpsub.Delivery) error {
		handled.Store(fmt.Sprint(d.MessageID()), true)
		return nil
	}), amqpsub.MaxMessageSize(1000), amqpsub.Logger(logger(t)))
	if err != nil {
		t.Fatal(err)
	}
	stop, wait := runSub(t, s)
	waitFor(t, 30*time.Second, "1 dead letter and 1 handled", func() bool {
		_, ok := handled.Load("small")
		return ok && p.info(t, q).DeadLetter == 1
	})
	stop()
	if err := wait(); err != nil {
		t.Fatal(err)
	}
	if _, ok := handled.Load("big"); ok {
		t.Fatal("the oversized message reached the handler")
	}
	dead := p.messages(t, q+"/$DeadLetterQueue")
	if len(dead) != 1 || dead[0].MessageID != "big" {
		t.Fatalf("dead letters %+v", dead)
	}
	reason, desc := dead[0].AppProps["DeadLetterReason"], dead[0].AppProps["DeadLetterErrorDescription"]
	t.Logf("dead-lettered with reason %v, description %v", reason, desc)
	if reason != "MaxMessageSizeExceeded" || !strings.Contains(fmt.Sprint(desc), "2000 bytes") {
		t.Fatalf("dead-lettered with reason %v, description %v", reason, desc)
	}
	if st := s.Stats(); st.Results.Oversize != 1 {
		t.Fatalf("Oversize = %d, want 1", st.Results.Oversize)
	}
}
