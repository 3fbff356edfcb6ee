package amqpprom_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/Azure/go-amqp"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"github.com/amqpsub/amqpsub/amqpsub"
	"github.com/amqpsub/amqpsub/contrib/amqpprom"
)

// After a run on a real Artemis, a scrape of the metrics handler counts
// exactly what was published: every delivery received, accepted or
// rejected as the handler said; with DeadLetterCopy, the rejections are
// accepted copies, counted as such, and each copy is on the dead-letter
// queue.
func TestScrapeAfterArtemisRun(t *testing.T) {
	url := os.Getenv("AMQPSUB_ARTEMIS_URL")
	if url == "" {
		t.Skip("AMQPSUB_ARTEMIS_URL is not set (make test sets it)")
	}
	t.Run("reject", func(t *testing.T) { scrapeAfterRun(t, url, false) })
	t.Run("DeadLetterCopy", func(t *testing.T) { scrapeAfterRun(t, url, true) })
}

func scrapeAfterRun(t *testing.T, url string, copyRejected bool) {
	const n, rejectEvery = 2000, 10
	queue := "amqpprom-" + randomSuffix(t)
	publish(t, url, queue, n)
	opts := []amqpsub.Option{amqpsub.WorkersByKey(8)}
	dlq := queue + ".dead"
	if copyRejected {
		// An address of its own, which Artemis creates as a queue when the
		// subscriber attaches its sender, so that no reason is lost.
		opts = append(opts, amqpsub.DeadLetterCopy(dlq))
	}

	reg := prometheus.NewRegistry()
	srv := httptest.NewServer(promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	defer srv.Close()
	var handled atomic.Int64
	done := make(chan struct{})
	h := amqpsub.HandlerFunc(func(_ context.Context, d *amqpsub.Delivery) error {
		defer func() {
			if handled.Add(1) == n {
				close(done)
			}
		}()
		if i, _ := d.ApplicationProperties()["i"].(int64); i%rejectEvery == 0 {
			return amqpsub.Reject("every tenth")
		}
		return nil
	})
	sub, err := amqpsub.New(amqpsub.Dial(url, nil), queue, h, append(opts, amqpsub.WithMetrics(amqpprom.New(reg)))...)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(t.Context())
	errc := make(chan error, 1)
	go func() { errc <- sub.Run(ctx) }()
	select {
	case <-done:
	case err := <-errc:
		t.Fatalf("Run: %v", err)
	case <-time.After(2 * time.Minute):
		t.Fatalf("handled %d of %d in 2 min", handled.Load(), n)
	}
	// Scraped while the subscriber runs, once the last settlement is out,
	// so that its gauges are there too.
	for deadline := time.Now().Add(30 * time.Second); sub.Stats().Held != 0; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("still %d held 30 s after the last handler returned", sub.Stats().Held)
		}
	}
	fams := scrape(t, srv.URL)
	cancel()
	if err := <-errc; err != nil {
		t.Fatalf("Run: %v", err)
	}

	rejected, copies := float64(n/rejectEvery), 0.0
	if copyRejected {
		rejected, copies = 0, n/rejectEvery
	}
	labels := fmt.Sprintf(`messaging_destination_name=%q,messaging_system="activemq"`, queue)
	for _, c := range []struct {
		series string
		want   float64
	}{
		{`messaging_client_consumed_messages_total{` + labels + `,messaging_operation_name="receive"}`, n},
		{`amqpsub_settlements_total{` + labels + `,outcome="accepted",error_type=""}`, n - rejected},
		{`amqpsub_settlements_total{` + labels + `,outcome="rejected",error_type=""}`, rejected},
		{`amqpsub_dead_letter_copies_total{` + labels + `}`, copies},
		{`amqpsub_dead_letter_copy_failures_total{` + labels + `}`, 0},
		{`amqpsub_events_total{` + labels + `,kind="dead-letter-copied"}`, copies},
		{`amqpsub_settlements_total{` + labels + `,outcome="released",error_type=""}`, 0},
		{`amqpsub_settlements_total{` + labels + `,outcome="accepted",error_type="failed"}`, 0},
		{`messaging_process_duration_seconds_count{` + labels + `,messaging_operation_name="process",result="accept",error_type=""}`, n - n/rejectEvery},
		{`messaging_process_duration_seconds_count{` + labels + `,messaging_operation_name="process",result="reject",error_type="reject"}`, n / rejectEvery},
		{`amqpsub_held_deliveries{` + labels + `}`, 0},
		{`amqpsub_credit_limit{` + labels + `}`, 256},
	} {
		got, ok := fams[normalize(c.series)]
		if !ok {
			t.Errorf("%s: not in the scrape", c.series)
			continue
		}
		if got != c.want {
			t.Errorf("%s = %v, want %v", c.series, got, c.want)
		}
	}
	if copyRejected {
		if got := countQueue(t, url, dlq, n/rejectEvery); got != n/rejectEvery {
			t.Errorf("%d copies on %s, want %d", got, dlq, n/rejectEvery)
		}
	}
	// The adaptive credit, idle now: at least the 8 lanes, at most the
	// limit.
	if c := fams[normalize(`amqpsub_credit{`+labels+`}`)]; c < 8 || c > 256 {
		t.Errorf("amqpsub_credit = %v, want between the 8 lanes and 256", c)
	}
	t.Logf("scraped %d series after %d messages", len(fams), n)
}

// session returns a session on a connection to url, both closed when
// the test ends, and a context bounded by a minute for what is done on it.
func session(t *testing.T, url string) (context.Context, *amqp.Session) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	t.Cleanup(cancel)
	conn, err := amqp.Dial(ctx, url, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	sess, err := conn.NewSession(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	return ctx, sess
}

// countQueue takes the messages on queue, want of them or until none has
// come for a second, and returns how many it took. The broker has them
// all once the subscriber has settled (a copy is taken before its
// original is accepted), so the wait is for none past want.
func countQueue(t *testing.T, url, queue string, want int) int {
	t.Helper()
	ctx, sess := session(t, url)
	rcv, err := sess.NewReceiver(ctx, queue, &amqp.ReceiverOptions{SourceCapabilities: []string{"queue"}, Credit: 100})
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for {
		wait := 10 * time.Second
		if n >= want {
			wait = time.Second
		}
		rctx, rcancel := context.WithTimeout(ctx, wait)
		m, err := rcv.Receive(rctx, nil)
		rcancel()
		if err != nil {
			if ctx.Err() == nil && errors.Is(err, context.DeadlineExceeded) {
				return n
			}
			t.Fatal(err)
		}
		if err := rcv.AcceptMessage(ctx, m); err != nil {
			t.Fatal(err)
		}
		n++
	}
}

func publish(t *testing.T, url, queue string, n int) {
	t.Helper()
	ctx, sess := session(t, url)
	snd, err := sess.NewSender(ctx, queue, &amqp.SenderOptions{TargetCapabilities: []string{"queue"}})
	if err != nil {
		t.Fatal(err)
	}
	for i := range n {
		g := fmt.Sprintf("g%02d", i%50)
		m := amqp.NewMessage([]byte("x"))
		m.Properties = &amqp.MessageProperties{GroupID: &g}
		m.ApplicationProperties = map[string]any{"i": int64(i)}
		if err := snd.Send(ctx, m, nil); err != nil {
			t.Fatal(err)
		}
	}
}

// scrape GETs the handler and returns every sample by its series, labels
// sorted.
func scrape(t *testing.T, url string) map[string]float64 {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	p := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := p.TextToMetricFamilies(strings.NewReader(string(body)))
	if err != nil {
		t.Fatalf("parse the scrape: %v", err)
	}
	out := map[string]float64{}
	for name, mf := range fams {
		for _, m := range mf.GetMetric() {
			var pairs []string
			for _, l := range m.GetLabel() {
				pairs = append(pairs, fmt.Sprintf("%s=%q", l.GetName(), l.GetValue()))
			}
			key := func(n string) string { return normalize(n + "{" + strings.Join(pairs, ",") + "}") }
			switch {
			case m.GetCounter() != nil:
				out[key(name)] = m.GetCounter().GetValue()
			case m.GetGauge() != nil:
				out[key(name)] = m.GetGauge().GetValue()
			case m.GetHistogram() != nil:
				out[key(name+"_count")] = float64(m.GetHistogram().GetSampleCount())
			}
		}
	}
	return out
}

// normalize sorts a series' labels.
func normalize(series string) string {
	i := strings.IndexByte(series, '{')
	if i < 0 {
		return series
	}
	labels := strings.Split(strings.TrimSuffix(series[i+1:], "}"), ",")
	for a := 1; a < len(labels); a++ {
		for b := a; b > 0 && labels[b] < labels[b-1]; b-- {
			labels[b], labels[b-1] = labels[b-1], labels[b]
		}
	}
	return series[:i] + "{" + strings.Join(labels, ",") + "}"
}

func randomSuffix(t *testing.T) string {
	b := make([]byte, 4)
	if _, err := rand.Read(b); err != nil {
		t.Fatal(err)
	}
	return hex.EncodeToString(b)
}
