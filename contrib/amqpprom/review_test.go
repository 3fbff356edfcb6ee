package amqpprom_test

import (
	"context"
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/amqpsub/amqpsub/amqpsub"
	"github.com/amqpsub/amqpsub/amqpsubtest"
	"github.com/amqpsub/amqpsub/contrib/amqpprom"
)

// Two running subscribers of one queue in one process (replicas) share a
// Metrics, as the package documentation says: their gauges are summed into
// one series each (two series with the same labels would fail the whole
// scrape), and a subscriber whose Run returned is forgotten. (An outside
// review found the failing scrape.)
func TestTwoSubscribersOfOneQueueShareTheirGauges(t *testing.T) {
	reg := prometheus.NewRegistry()
	m := amqpprom.New(reg)
	q := amqpsubtest.NewQueue()
	q.Publish(amqpsubtest.Message("", "x"), amqpsubtest.Message("", "y"))
	nop := amqpsub.HandlerFunc(func(context.Context, *amqpsub.Delivery) error { return nil })
	ctx, cancel := context.WithCancel(t.Context())
	var runs []chan error
	for range 2 {
		sub, err := amqpsub.New(q.Connector(), "orders", nop, amqpsub.WithMetrics(m), amqpsub.Credit(100))
		if err != nil {
			t.Fatal(err)
		}
		errc := make(chan error, 1)
		go func() { errc <- sub.Run(ctx) }()
		runs = append(runs, errc)
	}
	if err := q.Wait(t.Context()); err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	defer srv.Close()
	resp, err := http.Get(srv.URL)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if _, err := reg.Gather(); err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("GET /metrics: %s; Gather: %v", resp.Status, err)
	}
	if c := gaugeValue(t, reg, "amqpsub_credit"); c != 200 {
		t.Errorf("credit gauge %v, want the two subscribers' 100 + 100", c)
	}
	cancel()
	for _, errc := range runs {
		if err := <-errc; err != nil {
			t.Fatal(err)
		}
	}
	if fams := gather(t, reg, "amqpsub_credit"); len(fams) != 0 {
		t.Errorf("credit gauge still collected after both Runs returned: %v", fams)
	}
}

// A scrape while a subscriber is being made (a process that serves
// /metrics and starts a subscriber later) must not race with New, which
// hands MetricsInfo.Stats to the adapter before the subscriber is whole.
// (Found by an outside review.)
func TestScrapeDuringNewDoesNotRace(t *testing.T) {
	reg := prometheus.NewRegistry()
	m := amqpprom.New(reg)
	stop := make(chan struct{})
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			select {
			case <-stop:
				return
			default:
				_, _ = reg.Gather()
			}
		}
	}()
	nop := amqpsub.HandlerFunc(func(context.Context, *amqpsub.Delivery) error { return nil })
	for i := range 200 {
		q := amqpsubtest.NewQueue()
		if _, err := amqpsub.New(q.Connector(), "q"+string(rune('a'+i%26))+string(rune('a'+i/26)), nop, amqpsub.WithMetrics(m)); err != nil {
			t.Fatal(err)
		}
	}
	close(stop)
	<-done
}
