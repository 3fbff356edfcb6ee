package amqpprom_test

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/prometheus/client_golang/prometheus/testutil"
	dto "github.com/prometheus/client_model/go"

	"github.com/amqpsub/amqpsub/amqpsub"
	"github.com/amqpsub/amqpsub/amqpsubtest"
	"github.com/amqpsub/amqpsub/contrib/amqpprom"
)

func TestCountsMatchWhatTheQueueSaw(t *testing.T) {
	reg := prometheus.NewRegistry()
	m := amqpprom.New(reg)
	q := amqpsubtest.NewQueue(amqpsubtest.MaxDeliveryAttempts(3))
	for i := range 20 {
		body := "ok"
		switch i % 5 {
		case 1:
			body = "reject"
		case 2:
			body = "retry"
		}
		q.Publish(amqpsubtest.Message("", body))
	}
	h := amqpsub.HandlerFunc(func(_ context.Context, d *amqpsub.Delivery) error {
		b, _ := d.Body()
		switch string(b) {
		case "reject":
			return amqpsub.Reject("bad")
		case "retry":
			return errors.New("down")
		}
		return nil
	})
	sub, err := amqpsub.New(q.Connector(), "orders", h, amqpsub.Workers(4), amqpsub.WithMetrics(m))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
	defer cancel()
	if err := q.Drain(ctx, sub); err != nil {
		t.Fatal(err)
	}
	// 20 messages: 12 ok, 4 rejected, 4 retried three times each. Every
	// series is there from the start, at 0 until it counts.
	want := `
# HELP amqpsub_settlements_total Settlements applied, by outcome; error_type is empty when the broker took it.
# TYPE amqpsub_settlements_total counter
amqpsub_settlements_total{error_type="",messaging_destination_name="orders",messaging_system="activemq",outcome="accepted"} 12
amqpsub_settlements_total{error_type="",messaging_destination_name="orders",messaging_system="activemq",outcome="modified"} 12
amqpsub_settlements_total{error_type="",messaging_destination_name="orders",messaging_system="activemq",outcome="rejected"} 4
amqpsub_settlements_total{error_type="",messaging_destination_name="orders",messaging_system="activemq",outcome="released"} 0
amqpsub_settlements_total{error_type="failed",messaging_destination_name="orders",messaging_system="activemq",outcome="accepted"} 0
amqpsub_settlements_total{error_type="failed",messaging_destination_name="orders",messaging_system="activemq",outcome="modified"} 0
amqpsub_settlements_total{error_type="failed",messaging_destination_name="orders",messaging_system="activemq",outcome="rejected"} 0
amqpsub_settlements_total{error_type="failed",messaging_destination_name="orders",messaging_system="activemq",outcome="released"} 0
amqpsub_settlements_total{error_type="not_settled",messaging_destination_name="orders",messaging_system="activemq",outcome="accepted"} 0
amqpsub_settlements_total{error_type="not_settled",messaging_destination_name="orders",messaging_system="activemq",outcome="modified"} 0
amqpsub_settlements_total{error_type="not_settled",messaging_destination_name="orders",messaging_system="activemq",outcome="rejected"} 0
amqpsub_settlements_total{error_type="not_settled",messaging_destination_name="orders",messaging_system="activemq",outcome="released"} 0
# HELP messaging_client_consumed_messages_total Deliveries received from the broker.
# TYPE messaging_client_consumed_messages_total counter
messaging_client_consumed_messages_total{messaging_destination_name="orders",messaging_operation_name="receive",messaging_system="activemq"} 28
`
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want),
		"messaging_client_consumed_messages_total", "amqpsub_settlements_total"); err != nil {
		t.Error(err)
	}
	if n := histogramCount(t, reg, "messaging_process_duration_seconds", "retry"); n != 12 {
		t.Errorf("process calls with error_type retry = %d, want 12", n)
	}
	if n := histogramCount(t, reg, "messaging_process_duration_seconds", ""); n != 12 {
		t.Errorf("process calls without error = %d, want 12", n)
	}
	if n := counterValue(t, reg, "amqpsub_events_total", "handler-failed"); n != 12 {
		t.Errorf("handler-failed events = %v, want 12", n)
	}
	// Run has returned: the subscriber's gauges are gone.
	if fams := gather(t, reg, "amqpsub_credit"); len(fams) != 0 {
		t.Errorf("credit gauge of a subscriber whose Run returned: %v", fams)
	}
}

// Two subscribers share one Metrics: each has its own series.
func TestSubscribersShareMetrics(t *testing.T) {
	reg := prometheus.NewRegistry()
	m := amqpprom.New(reg, amqpprom.ConstLabels(prometheus.Labels{"service": "billing"}))
	for _, name := range []string{"a", "b"} {
		q := amqpsubtest.NewQueue()
		q.Publish(amqpsubtest.Message("", "x"))
		if name == "b" {
			q.Publish(amqpsubtest.Message("", "y"))
		}
		sub, err := amqpsub.NewBatch(q.Connector(), name, amqpsub.BatchHandlerFunc(func(context.Context, []*amqpsub.Delivery) []error { return nil }),
			amqpsub.WithMetrics(m), amqpsub.WorkersByKey(2))
		if err != nil {
			t.Fatal(err)
		}
		if err := q.Drain(t.Context(), sub); err != nil {
			t.Fatal(err)
		}
	}
	want := `
# HELP messaging_client_consumed_messages_total Deliveries received from the broker.
# TYPE messaging_client_consumed_messages_total counter
messaging_client_consumed_messages_total{messaging_destination_name="a",messaging_operation_name="receive",messaging_system="activemq",service="billing"} 1
messaging_client_consumed_messages_total{messaging_destination_name="b",messaging_operation_name="receive",messaging_system="activemq",service="billing"} 2
`
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want), "messaging_client_consumed_messages_total"); err != nil {
		t.Error(err)
	}
	if fams := gather(t, reg, "amqpsub_lane_load"); len(fams) != 0 {
		t.Errorf("lane gauges of subscribers whose Run returned: %v", fams)
	}
}

// The recorder's calls on the delivery path allocate nothing.
func TestRecorderDoesNotAllocate(t *testing.T) {
	m := amqpprom.New(prometheus.NewRegistry())
	r := m.Recorder(amqpsub.MetricsInfo{Queue: "q", System: "activemq", Credit: 1, Lanes: 1, Batch: true})
	call := amqpsub.HandlerCall{Deliveries: 3, Took: time.Millisecond, Result: amqpsub.ResultRetry}
	ev := amqpsub.Event{Kind: amqpsub.EventLinkLost}
	if n := testing.AllocsPerRun(1000, func() {
		r.Received()
		r.Handled(call)
		r.Settled(amqpsub.OutcomeAccepted, nil)
		r.Settled(amqpsub.OutcomeRejected, amqpsub.ErrNotSettled)
		r.Event(ev)
		r.LocksRenewed(2)
		r.Dropped(1)
	}); n != 0 {
		t.Fatalf("%v allocations per round", n)
	}
}

// Each gauge is its Stats field, summed over the subscribers of one queue;
// another queue has series of its own.
func TestGaugesSumStatsPerQueue(t *testing.T) {
	reg := prometheus.NewRegistry()
	m := amqpprom.New(reg)
	st := func() amqpsub.Stats {
		return amqpsub.Stats{Held: 5, Credit: 8, BytesHeld: 500, GroupsHeld: 2, Parked: 3, Locks: amqpsub.Locks{Held: 4},
			Lanes: []amqpsub.LaneStats{{Load: 1}, {Load: 4}}}
	}
	recs := []amqpsub.Recorder{
		m.Recorder(amqpsub.MetricsInfo{Queue: "orders", System: "activemq", Credit: 10, Lanes: 2, Stats: st}),
		m.Recorder(amqpsub.MetricsInfo{Queue: "orders", System: "activemq", Credit: 10, Lanes: 2, Stats: st}),
		m.Recorder(amqpsub.MetricsInfo{Queue: "audit", System: "activemq", Credit: 10, Lanes: 1,
			Stats: func() amqpsub.Stats { return amqpsub.Stats{Parked: 7} }}),
	}
	want := `
# HELP amqpsub_groups_held Groups with deliveries in the lanes now (BalanceKeys).
# TYPE amqpsub_groups_held gauge
amqpsub_groups_held{messaging_destination_name="audit",messaging_system="activemq"} 0
amqpsub_groups_held{messaging_destination_name="orders",messaging_system="activemq"} 4
# HELP amqpsub_held_bytes Bytes of the message bodies held now.
# TYPE amqpsub_held_bytes gauge
amqpsub_held_bytes{messaging_destination_name="audit",messaging_system="activemq"} 0
amqpsub_held_bytes{messaging_destination_name="orders",messaging_system="activemq"} 1000
# HELP amqpsub_held_deliveries Deliveries held in the process now: waiting for a handler, in one, or waiting for their settlement (at most the credit on a broker that keeps within it).
# TYPE amqpsub_held_deliveries gauge
amqpsub_held_deliveries{messaging_destination_name="audit",messaging_system="activemq"} 0
amqpsub_held_deliveries{messaging_destination_name="orders",messaging_system="activemq"} 10
# HELP amqpsub_lane_load Deliveries waiting for each lane and in its handler.
# TYPE amqpsub_lane_load gauge
amqpsub_lane_load{lane="0",messaging_destination_name="orders",messaging_system="activemq"} 2
amqpsub_lane_load{lane="1",messaging_destination_name="orders",messaging_system="activemq"} 8
# HELP amqpsub_locks_held Service Bus deliveries whose locks are kept now.
# TYPE amqpsub_locks_held gauge
amqpsub_locks_held{messaging_destination_name="audit",messaging_system="activemq"} 0
amqpsub_locks_held{messaging_destination_name="orders",messaging_system="activemq"} 8
# HELP amqpsub_parked_deliveries Deliveries held now that wait behind an earlier one of their group, or behind a handler call running over four times the mean (a hot, slow or stuck group).
# TYPE amqpsub_parked_deliveries gauge
amqpsub_parked_deliveries{messaging_destination_name="audit",messaging_system="activemq"} 7
amqpsub_parked_deliveries{messaging_destination_name="orders",messaging_system="activemq"} 6
`
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want),
		"amqpsub_held_deliveries", "amqpsub_held_bytes", "amqpsub_groups_held", "amqpsub_parked_deliveries",
		"amqpsub_locks_held", "amqpsub_lane_load"); err != nil {
		t.Error(err)
	}
	runtime.KeepAlive(recs) // the gauges hold recorders weakly
}

func TestSecondNewOnARegistryPanics(t *testing.T) {
	reg := prometheus.NewRegistry()
	amqpprom.New(reg)
	defer func() {
		if recover() == nil {
			t.Fatal("no panic")
		}
	}()
	amqpprom.New(reg)
}

func counterValue(t *testing.T, g prometheus.Gatherer, name, kind string) float64 {
	t.Helper()
	for _, mf := range gather(t, g, name) {
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "kind" && l.GetValue() == kind {
					return m.GetCounter().GetValue()
				}
			}
		}
	}
	return 0
}

func histogramCount(t *testing.T, g prometheus.Gatherer, name, errType string) uint64 {
	t.Helper()
	for _, mf := range gather(t, g, name) {
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "error_type" && l.GetValue() == errType {
					return m.GetHistogram().GetSampleCount()
				}
			}
		}
	}
	return 0
}

func gaugeValue(t *testing.T, g prometheus.Gatherer, name string) float64 {
	t.Helper()
	for _, mf := range gather(t, g, name) {
		for _, m := range mf.GetMetric() {
			return m.GetGauge().GetValue()
		}
	}
	t.Fatalf("no %s", name)
	return 0
}

func gather(t *testing.T, g prometheus.Gatherer, name string) []*dto.MetricFamily {
	t.Helper()
	mfs, err := g.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var out []*dto.MetricFamily
	for _, mf := range mfs {
		if mf.GetName() == name {
			out = append(out, mf)
		}
	}
	return out
}

// Two running subscribers of one queue in one process (replicas) share a
// Metrics, as the package documentation says: their gauges are summed into
// one series each (two series with the same labels would fail the whole
// scrape), and a subscriber whose Run returned is forgotten.
func TestTwoSubscribersOfOneQueueShareTheirGauges(t *testing.T) {
	reg := prometheus.NewRegistry()
	m := amqpprom.New(reg)
	q := amqpsubtest.NewQueue()
	q.Publish(amqpsubtest.Message("", "x"), amqpsubtest.Message("", "y"))
	nop := amqpsub.HandlerFunc(func(context.Context, *amqpsub.Delivery) error { return nil })
	ctx, cancel := context.WithCancel(t.Context())
	var runs []chan error
	for range 2 {
		sub, err := amqpsub.New(q.Connector(), "orders", nop, amqpsub.WithMetrics(m), amqpsub.Credit(100), amqpsub.FixedCredit())
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
		t.Errorf("credit gauge %v, want the two subscribers' fixed 100 + 100", c)
	}
	if c := gaugeValue(t, reg, "amqpsub_credit_limit"); c != 200 {
		t.Errorf("credit limit gauge %v, want 100 + 100", c)
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

// A subscriber closed before it ran, or made and dropped (a start-up that
// failed further on), is not reported for ever: the gauges forget the first
// at once (its Done is closed by Close) and the others once they are
// garbage collected (they are held weakly).
func TestNeverRunSubscribersLeaveTheGauges(t *testing.T) {
	reg := prometheus.NewRegistry()
	m := amqpprom.New(reg)
	nop := amqpsub.HandlerFunc(func(context.Context, *amqpsub.Delivery) error { return nil })
	sub, err := amqpsub.New(amqpsubtest.NewQueue().Connector(), "orders", nop, amqpsub.WithMetrics(m), amqpsub.Credit(100))
	if err != nil {
		t.Fatal(err)
	}
	_ = sub.Close() // never run
	for range 10 {
		if _, err := amqpsub.New(amqpsubtest.NewQueue().Connector(), "orders", nop, amqpsub.WithMetrics(m), amqpsub.Credit(100)); err != nil {
			t.Fatal(err)
		}
	}
	runtime.GC()
	if fams := gather(t, reg, "amqpsub_credit"); len(fams) != 0 {
		t.Errorf("amqpsub_credit reported with no subscriber running (one closed before Run, ten dropped): %v", fams)
	}
}
