package amqpotel_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/Azure/go-amqp"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	"github.com/amqpsub/amqpsub/amqpsub"
	"github.com/amqpsub/amqpsub/contrib/amqpotel"
)

// artemisURL returns the Artemis broker's URL, or skips the test.
func artemisURL(t *testing.T) string {
	t.Helper()
	u := os.Getenv("AMQPSUB_ARTEMIS_URL")
	if u == "" {
		t.Skip("no Artemis configured (AMQPSUB_ARTEMIS_URL is empty): start one with " +
			"`bash integration/artemis.sh start` and set AMQPSUB_ARTEMIS_URL=amqp://127.0.0.1:5672; `make test` does both")
	}
	return u
}

// publish sends msgs to queue on Artemis, each waiting for the broker's
// acceptance, with the queue capability so that Artemis creates an anycast
// queue.
func publish(t *testing.T, url, queue string, msgs ...*amqp.Message) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	conn, err := amqp.Dial(ctx, url, nil)
	if err != nil {
		t.Fatalf("dial %s: %v", url, err)
	}
	defer conn.Close()
	sess, err := conn.NewSession(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	snd, err := sess.NewSender(ctx, queue, &amqp.SenderOptions{TargetCapabilities: []string{"queue"}})
	if err != nil {
		t.Fatal(err)
	}
	defer snd.Close(ctx)
	for _, m := range msgs {
		if err := snd.Send(ctx, m, nil); err != nil {
			t.Fatal(err)
		}
	}
}

// On Artemis: the process spans carry the producers' traces and the
// handlers' results, a retried message's second delivery has a span of its
// own with its delivery count, the settle spans the outcomes sent, and the
// metrics count what was published.
func TestArtemisTracesAndMetrics(t *testing.T) {
	url := artemisURL(t)
	queue := fmt.Sprintf("amqpotel.%s.%d.%08x", t.Name(), time.Now().UnixNano(), rand.Uint32())
	tp, rec := spans()
	m, reader := newMetrics(t)

	producers := map[string]trace.SpanContext{}
	var msgs []*amqp.Message
	for i, id := range []string{"ok", "reject", "retry-once", "release-once", "plain"} {
		var props map[string]any
		if id != "plain" {
			sc, traceparent := producerContext(byte(100 + i))
			producers[id] = sc
			props = map[string]any{"traceparent": traceparent}
		}
		msgs = append(msgs, message(id, id, props))
	}
	publish(t, url, queue, msgs...)

	var mu sync.Mutex
	seen := map[string]int{}
	h := amqpsub.HandlerFunc(func(_ context.Context, d *amqpsub.Delivery) error {
		id, _ := d.MessageID().(string)
		mu.Lock()
		seen[id]++
		n := seen[id]
		mu.Unlock()
		switch {
		case id == "reject":
			return amqpsub.Reject("malformed")
		case id == "retry-once" && n == 1:
			return errors.New("payment service down")
		case id == "release-once" && n == 1:
			return amqpsub.Release()
		}
		return nil
	})
	sub, err := amqpsub.New(amqpsub.Dial(url, nil), queue, amqpotel.Handler(queue, h, amqpotel.WithTracerProvider(tp)),
		amqpsub.WithMetrics(m))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() { done <- sub.Run(ctx) }()
	// 7 deliveries: 4 accepted, a reject, a retry, a release.
	deadline := time.Now().Add(60 * time.Second)
	for {
		st := sub.Stats().Settled
		if st.Accepted == 4 && st.Rejected == 1 && st.Modified == 1 && st.Released == 1 {
			break
		}
		if time.Now().After(deadline) {
			cancel()
			<-done
			t.Fatalf("settled %+v after 60 s", st)
		}
		select {
		case err := <-done:
			t.Fatalf("Run returned %v", err)
		case <-time.After(20 * time.Millisecond):
		}
	}
	cancel()
	if err := <-done; err != nil && !errors.Is(err, context.Canceled) {
		t.Fatalf("Run: %v", err)
	}

	type delivery struct {
		count, result, errType, settle string
	}
	got := map[string][]delivery{}
	process, settle := byName(rec)
	for _, p := range process {
		id := attrString(p, "messaging.message.id")
		if sc, ok := producers[id]; ok {
			if p.SpanContext().TraceID() != sc.TraceID() || p.Parent().SpanID() != sc.SpanID() || len(p.Links()) != 1 {
				t.Errorf("%s: span %v parent %v links %d, producer %v", id, p.SpanContext(), p.Parent(), len(p.Links()), sc)
			}
		} else if p.Parent().IsValid() {
			t.Errorf("%s: parent %v", id, p.Parent())
		}
		if attrString(p, "messaging.destination.name") != queue || attrString(p, "messaging.system") != "activemq" {
			t.Errorf("%s: attributes %v", id, p.Attributes())
		}
		s := settleOf(settle, p)
		if len(s) != 1 {
			t.Errorf("%s: %d settle spans", id, len(s))
			continue
		}
		got[id] = append(got[id], delivery{attrString(p, amqpotel.DeliveryCountKey), attrString(p, amqpotel.ResultKey),
			attrString(p, "error.type"), strings.TrimSuffix(s[0].Name(), " "+queue)})
	}
	want := map[string][]delivery{
		"ok":           {{"0", "accept", "", "accept"}},
		"reject":       {{"0", "reject", "reject", "reject"}},
		"retry-once":   {{"0", "retry", "retry", "modify"}, {"1", "accept", "", "accept"}},
		"release-once": {{"0", "release", "", "release"}, {"0", "accept", "", "accept"}},
		"plain":        {{"0", "accept", "", "accept"}},
	}
	for id, w := range want {
		g := got[id]
		sort.Slice(g, func(i, j int) bool { return g[i].count+g[i].result > g[j].count+g[j].result })
		sort.Slice(w, func(i, j int) bool { return w[i].count+w[i].result > w[j].count+w[j].result })
		if fmt.Sprint(g) != fmt.Sprint(w) {
			t.Errorf("%s: deliveries %v, want %v", id, g, w)
		}
	}

	c := collect(t, reader)
	dest := destKey.String(queue)
	if got := c.sum(amqpotel.ConsumedMessagesName, dest); got != 7 {
		t.Errorf("consumed %d, want 7 (5 published, a retry and a release)", got)
	}
	for outcome, want := range map[string]int64{"accepted": 4, "rejected": 1, "modified": 1, "released": 1} {
		if got := c.sum(amqpotel.SettlementsName, dest, amqpotel.OutcomeKey.String(outcome), noError); got != want {
			t.Errorf("settlements %s = %d, want %d:\n%s", outcome, got, want, c.attrSets(amqpotel.SettlementsName))
		}
	}
	for _, w := range []struct {
		result string
		want   uint64
	}{{"accept", 4}, {"reject", 1}, {"retry", 1}, {"release", 1}} {
		if got := c.count(amqpotel.ProcessDurationName, dest, amqpotel.ResultKey.String(w.result)); got != w.want {
			t.Errorf("process %s = %d, want %d", w.result, got, w.want)
		}
	}
	if got := c.count(amqpotel.ProcessDurationName, dest, errKey.String("retry")) +
		c.count(amqpotel.ProcessDurationName, dest, errKey.String("reject")); got != 2 {
		t.Errorf("%d failed process calls with error.type, want 2:\n%s", got, c.attrSets(amqpotel.ProcessDurationName))
	}
	// The subscriber has stopped: its gauges are no longer reported.
	if got := c.points(amqpotel.CreditName, dest); got != 0 {
		t.Errorf("credit reported after Run returned: %d points", got)
	}
}

// On Artemis, with DeadLetterCopy: a rejection whose copy the broker took
// is a "dead_letter_copy" settle span, outcome accepted, with the address,
// and is counted as a copy; one whose copy the broker refused (its queue
// deleted after the subscriber attached to it) is a "reject" span carrying
// the copy's error, and is counted as a failure.
func TestArtemisDeadLetterCopySpans(t *testing.T) {
	url := artemisURL(t)
	for _, c := range []struct {
		name, address, span string
		copies, failures    int64
	}{
		{"taken", "{queue}.dead", "dead_letter_copy", 1, 0},
		{"refused", "DLQ::gone.{queue}", "reject", 0, 1},
	} {
		t.Run(c.name, func(t *testing.T) {
			queue := fmt.Sprintf("amqpotel.dlc.%d.%08x", time.Now().UnixNano(), rand.Uint32())
			address := strings.ReplaceAll(c.address, "{queue}", queue)
			gone := strings.TrimPrefix(address, "DLQ::")
			if c.failures > 0 {
				artemisCLI(t, "queue", "create", "--name", gone, "--address", "DLQ", "--anycast",
					"--auto-create-address", "--preserve-on-no-consumers", "--silent")
			}
			tp, rec := spans()
			m, reader := newMetrics(t)
			publish(t, url, queue, message("first", "first", nil))
			h := amqpsub.HandlerFunc(func(_ context.Context, d *amqpsub.Delivery) error {
				if d.MessageID() == "bad" {
					return amqpsub.RejectWith("malformed", "no customer")
				}
				return nil
			})
			sub, err := amqpsub.New(amqpsub.Dial(url, nil), queue, amqpotel.Handler(queue, h, amqpotel.WithTracerProvider(tp)),
				amqpsub.WithMetrics(m), amqpsub.DeadLetterCopy(c.address))
			if err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithCancel(t.Context())
			done := make(chan error, 1)
			go func() { done <- sub.Run(ctx) }()
			// Attached (the dead-letter sender with it) once the first is
			// settled: then the copies' queue goes, for the refused case.
			for deadline := time.Now().Add(60 * time.Second); sub.Stats().Settled.Accepted != 1; time.Sleep(10 * time.Millisecond) {
				if time.Now().After(deadline) {
					t.Fatalf("first message not settled after 60 s: %v", sub.Stats())
				}
			}
			if c.failures > 0 {
				artemisCLI(t, "queue", "delete", "--name", gone, "--removeConsumers", "--silent")
			}
			publish(t, url, queue, message("ok", "ok", nil), message("bad", "bad", nil))
			for deadline := time.Now().Add(60 * time.Second); ; {
				st := sub.Stats()
				if st.Settled.Accepted+st.Settled.Rejected == 3 {
					break
				}
				if time.Now().After(deadline) {
					cancel()
					<-done
					t.Fatalf("settled %+v after 60 s", st.Settled)
				}
				select {
				case err := <-done:
					t.Fatalf("Run returned %v", err)
				case <-time.After(20 * time.Millisecond):
				}
			}
			cancel()
			if err := <-done; err != nil {
				t.Fatalf("Run: %v", err)
			}

			process, settle := byName(rec)
			names := map[string]string{}
			for _, p := range process {
				id := attrString(p, "messaging.message.id")
				s := settleOf(settle, p)
				if len(s) != 1 {
					t.Fatalf("%s: %d settle spans", id, len(s))
				}
				names[id] = strings.TrimSuffix(s[0].Name(), " "+queue)
				if id != "bad" {
					continue
				}
				if got := attrString(p, amqpotel.ResultKey); got != "reject" {
					t.Errorf("process span's result %q, want reject", got)
				}
				want := "accepted"
				if c.failures > 0 {
					want = "rejected"
				}
				if got := attrString(s[0], amqpotel.OutcomeKey); got != want {
					t.Errorf("settle span's outcome %q, want %q", got, want)
				}
				if got := attrString(s[0], "messaging.operation.name"); got != c.span {
					t.Errorf("settle span's operation %q, want %q", got, c.span)
				}
				if got := attrString(s[0], amqpotel.DeadLetterAddressKey); got != address {
					t.Errorf("settle span's dead-letter address %q, want %q", got, address)
				}
				var exceptions int
				for _, e := range s[0].Events() {
					if e.Name == "exception" {
						exceptions++
					}
				}
				if exceptions != int(c.failures) {
					t.Errorf("settle span has %d exception events, want %d: %v", exceptions, c.failures, s[0].Events())
				}
				if s[0].Status().Code == codes.Error {
					t.Errorf("settle span's status is Error: %v", s[0].Status())
				}
			}
			if names["first"] != "accept" || names["ok"] != "accept" || names["bad"] != c.span {
				t.Errorf("settle spans %v, want first and ok: accept, bad: %s", names, c.span)
			}

			col := collect(t, reader)
			dest := destKey.String(queue)
			if got := col.sum(amqpotel.DeadLetterCopiesName, dest); got != c.copies {
				t.Errorf("%s = %d, want %d", amqpotel.DeadLetterCopiesName, got, c.copies)
			}
			if got := col.sum(amqpotel.DeadLetterCopyFailuresName, dest); got != c.failures {
				t.Errorf("%s = %d, want %d", amqpotel.DeadLetterCopyFailuresName, got, c.failures)
			}
			if got := col.sum(amqpotel.SettlementsName, dest, amqpotel.OutcomeKey.String("accepted"), noError); got != 2+c.copies {
				t.Errorf("accepted settlements %d, want %d", got, 2+c.copies)
			}
		})
	}
}

// artemisCLI runs the test broker's CLI (integration/artemis.sh cli, which
// `make test` names in AMQPSUB_ARTEMIS_CTL), or skips the test.
func artemisCLI(t *testing.T, args ...string) {
	t.Helper()
	ctl := os.Getenv("AMQPSUB_ARTEMIS_CTL")
	if ctl == "" {
		t.Skip("AMQPSUB_ARTEMIS_CTL is not set: this test runs the broker's CLI (`make test` sets it)")
	}
	if out, err := exec.Command("bash", append([]string{ctl, "cli"}, args...)...).CombinedOutput(); err != nil {
		t.Fatalf("artemis %v: %v\n%s", args, err, out)
	}
}
