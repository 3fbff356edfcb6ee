package amqpprom_test

import (
	"runtime"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/amqpsub/amqpsub/amqpsub"
	"github.com/amqpsub/amqpsub/contrib/amqpprom"
	"github.com/amqpsub/amqpsub/internal/golden"
)

// series returns every series family a Metrics exports, with a Subscriber
// whose series are all resolved, as "name type labels": its type, and the
// label names its series have, sorted.
func series(t *testing.T) []string {
	t.Helper()
	reg := prometheus.NewRegistry()
	m := amqpprom.New(reg)
	r := m.Recorder(amqpsub.MetricsInfo{Queue: "q", System: "activemq", Credit: 1, Lanes: 1, Batch: true,
		Stats: func() amqpsub.Stats { return amqpsub.Stats{Lanes: []amqpsub.LaneStats{{}}} }})
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	runtime.KeepAlive(r) // the gauges hold recorders weakly
	var out []string
	for _, mf := range mfs {
		var labels []string
		for _, s := range mf.GetMetric() {
			for _, l := range s.GetLabel() {
				labels = append(labels, l.GetName())
			}
		}
		slices.Sort(labels)
		out = append(out, mf.GetName()+" "+strings.ToLower(mf.GetType().String())+" "+strings.Join(slices.Compact(labels), ","))
	}
	return out
}

// Every series of 85a6eb9 (testdata, written by that commit's adapter) is
// still exported, of its type and with its labels; the series added since
// are listed here, so that none comes or goes unseen.
func TestSeriesOf85a6eb9Stay(t *testing.T) {
	base := "gauge messaging_destination_name,messaging_system"
	added := []string{
		"amqpsub_parked_deliveries " + base,
		// The table's other gauges, since the adapter ranges over it.
		"amqpsub_buffered " + base,
		"amqpsub_handling " + base,
		"amqpsub_settling " + base,
		"amqpsub_longest_lane " + base,
		"amqpsub_max_held " + base,
		"amqpsub_max_bytes_held " + base,
		"amqpsub_round_trip_seconds " + base,
	}
	golden.Check(t, "testdata/series-85a6eb9.txt", 16, added, series(t))
}

// Every row of amqpsub.StatFields but the counters (which the recorder
// counts as they happen) is a gauge with the row's help: a row of a unit
// the adapter does not know fails here rather than go missing.
func TestEveryStatGaugeIsASeries(t *testing.T) {
	reg := prometheus.NewRegistry()
	m := amqpprom.New(reg)
	r := m.Recorder(amqpsub.MetricsInfo{Queue: "q", System: "activemq", Stats: func() amqpsub.Stats { return amqpsub.Stats{} }})
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	runtime.KeepAlive(r)
	help := map[string]string{}
	for _, mf := range mfs {
		if mf.GetType() == dto.MetricType_GAUGE {
			help[mf.GetHelp()] = mf.GetName()
		}
	}
	gauges := 0
	for _, f := range amqpsub.StatFields() {
		if f.Kind == amqpsub.StatCounter {
			continue
		}
		gauges++
		if _, ok := help[f.Help]; !ok {
			t.Errorf("row %s (%s, unit %s) has no gauge", f.Name, f.Kind, f.Unit)
		}
	}
	if len(help) != gauges { // amqpsub_lane_load has no lane without one
		t.Errorf("%d gauges exported, the table has %d: %v", len(help), gauges, help)
	}
}

// A gauge of nanoseconds is a series of seconds; a StatMaxGauge of two
// Subscribers of one queue is the higher, a StatGauge the sum.
func TestGaugesScaleAndCombine(t *testing.T) {
	reg := prometheus.NewRegistry()
	m := amqpprom.New(reg)
	st := func(rt time.Duration, load int) func() amqpsub.Stats {
		return func() amqpsub.Stats {
			return amqpsub.Stats{RoundTrip: rt, Buffered: 2, Lanes: []amqpsub.LaneStats{{Load: load}}}
		}
	}
	recs := []amqpsub.Recorder{
		m.Recorder(amqpsub.MetricsInfo{Queue: "q", System: "amqp", Stats: st(3*time.Millisecond, 4)}),
		m.Recorder(amqpsub.MetricsInfo{Queue: "q", System: "amqp", Stats: st(5*time.Millisecond, 1)}),
	}
	for name, want := range map[string]float64{
		"amqpsub_round_trip_seconds": 0.005,
		"amqpsub_longest_lane":       4,
		"amqpsub_buffered":           4,
	} {
		if got := gaugeValue(t, reg, name); got != want {
			t.Errorf("%s = %v, want %v", name, got, want)
		}
	}
	runtime.KeepAlive(recs)
}
