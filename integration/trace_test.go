package integration

import (
	"context"
	"os"
	"testing"
	"time"

	"github.com/Azure/go-amqp"

	"github.com/amqpsub/amqpsub/amqpsub"
)

// The delivery traces of docs/design.md ("One delivery's path"): one
// delivery from its receive to its disposition, run once as a test and,
// by integration/trace.sh, twice under a coverage profile, the second time
// without the delivery (AMQPSUB_TRACE_BASELINE=1), so that the blocks only
// the first run executed are the delivery's path. The tests themselves
// poll no Stats while a delivery is held, so that the census of held
// deliveries stays out of the trace.

// traceBaseline says that the trace runs without its delivery.
func traceBaseline() bool { return os.Getenv("AMQPSUB_TRACE_BASELINE") == "1" }

// One Artemis delivery, handled by a handler that does nothing, accepted.
func TestTraceArtemisDelivery(t *testing.T) {
	url := artemisURL(t)
	q := queueName(t)
	handled := make(chan struct{}, 1)
	s, err := amqpsub.New(amqpsub.Dial(url, nil), q, amqpsub.HandlerFunc(func(context.Context, *amqpsub.Delivery) error {
		handled <- struct{}{}
		return nil
	}), amqpsub.Logger(logger(t)))
	if err != nil {
		t.Fatal(err)
	}
	stop, wait := runSub(t, s)
	waitFor(t, 10*time.Second, "attached", func() bool { return s.Stats().Links >= 1 })
	if !traceBaseline() {
		snd := rawSender(t, dial(t, url), q, "queue")
		ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
		defer cancel()
		if err := snd.Send(ctx, amqp.NewMessage([]byte("x")), nil); err != nil {
			t.Fatal(err)
		}
		select {
		case <-handled:
		case <-time.After(10 * time.Second):
			t.Fatal("the delivery was not handled within 10 s")
		}
		// Let the acceptance go out before the stop, whose log line counts
		// what is held: a delivery still settling then would put that
		// census (internal/pump/stats.go) in the trace. The test's result
		// does not depend on it: a stop settles what was decided.
		time.Sleep(200 * time.Millisecond)
	}
	stop()
	if err := wait(); err != nil {
		t.Fatal(err)
	}
	want := uint64(1)
	if traceBaseline() {
		want = 0
	}
	if st := s.Stats(); st.Results.Accept != want {
		t.Fatalf("want %d accepted: %v", want, st)
	}
}

// One Service Bus delivery whose handler holds it past a lock renewal,
// while the service detaches its link; the handler then returns, and the
// settlement goes by lock token on $management.
func TestTraceServiceBusDelivery(t *testing.T) {
	p := serviceBusPeer(t)
	q := p.entity(t, map[string]any{"lock_duration_ms": 2000})
	release := make(chan struct{})
	lost := make(chan struct{}, 1)
	s, err := amqpsub.New(sbConnector(t, p), q, amqpsub.HandlerFunc(func(context.Context, *amqpsub.Delivery) error {
		<-release
		return nil
	}), amqpsub.Logger(logger(t)), amqpsub.OnEvent(func(e amqpsub.Event) {
		if e.Kind == amqpsub.EventLinkLost {
			select {
			case lost <- struct{}{}:
			default:
			}
		}
	}))
	if err != nil {
		t.Fatal(err)
	}
	stop, wait := runSub(t, s)
	waitFor(t, 10*time.Second, "attached", func() bool { return s.Stats().Links >= 1 })
	before := p.counters(t)
	if traceBaseline() {
		time.Sleep(1500 * time.Millisecond) // as long as the renewal takes below
	} else {
		p.send(t, q, 1)
		waitFor(t, 10*time.Second, "a lock renewed", func() bool {
			return p.counters(t)["renew_lock_tokens"] > before["renew_lock_tokens"]
		})
	}
	p.call(t, "POST", "/faults/detach", map[string]any{"entity": q, "condition": "amqp:link:detach-forced"}, nil)
	select {
	case <-lost:
	case <-time.After(10 * time.Second):
		t.Fatal("the detach was not seen within 10 s")
	}
	close(release)
	if !traceBaseline() {
		waitFor(t, 10*time.Second, "completed", func() bool { return p.info(t, q).Stats["completed"] == 1 })
	}
	stop()
	if err := wait(); err != nil {
		t.Fatal(err)
	}
	st := s.Stats()
	if st.LinksLost < 1 {
		t.Fatalf("no link lost: %v", st)
	}
	if !traceBaseline() && (st.Locks.SettledByToken != 1 || st.Locks.Renewed < 1 || st.Results.Accept != 1) {
		t.Fatalf("want one delivery renewed, then accepted by lock token: %v", st)
	}
}
