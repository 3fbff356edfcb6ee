package amqpotel_test

import (
	"fmt"
	"runtime"
	"slices"
	"strings"
	"testing"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/amqpsub/amqpsub/amqpsub"
	"github.com/amqpsub/amqpsub/contrib/amqpotel"
	"github.com/amqpsub/amqpsub/internal/golden"
)

// describe returns an instrument as "name unit kind attributes": its data's
// kind, and the attribute keys its points have, sorted.
func describe(m metricdata.Metrics) string {
	var keys []string
	add := func(s attribute.Set) {
		for _, kv := range s.ToSlice() {
			keys = append(keys, string(kv.Key))
		}
	}
	var kind string
	switch d := m.Data.(type) {
	case metricdata.Sum[int64]:
		kind = fmt.Sprintf("sum_int64 monotonic=%v", d.IsMonotonic)
		for _, p := range d.DataPoints {
			add(p.Attributes)
		}
	case metricdata.Gauge[int64]:
		kind = "gauge_int64"
		for _, p := range d.DataPoints {
			add(p.Attributes)
		}
	case metricdata.Histogram[int64]:
		kind = "histogram_int64"
		for _, p := range d.DataPoints {
			add(p.Attributes)
		}
	case metricdata.Histogram[float64]:
		kind = "histogram_float64"
		for _, p := range d.DataPoints {
			add(p.Attributes)
		}
	default:
		kind = fmt.Sprintf("%T", d)
	}
	slices.Sort(keys)
	return m.Name + " " + m.Unit + " " + kind + " " + strings.Join(slices.Compact(keys), ",")
}

// instruments returns every instrument a Metrics reports, each recorded
// once, described.
func instruments(t *testing.T) []string {
	t.Helper()
	m, reader := newMetrics(t)
	r := m.Recorder(amqpsub.MetricsInfo{Queue: "q", System: "activemq", Credit: 1, Lanes: 1, Batch: true,
		Stats: func() amqpsub.Stats { return amqpsub.Stats{Lanes: []amqpsub.LaneStats{{}}} }})
	r.Received()
	r.Handled(amqpsub.HandlerCall{Deliveries: 1, Took: time.Millisecond, Result: amqpsub.ResultRetry})
	r.Settled(amqpsub.OutcomeRejected, amqpsub.ErrNotSettled)
	r.Event(amqpsub.Event{Kind: amqpsub.EventDeadLetterCopied})
	r.Event(amqpsub.Event{Kind: amqpsub.EventDeadLetterCopyFailed})
	r.LocksRenewed(1)
	r.Dropped(1)
	var out []string
	for _, md := range collect(t, reader) {
		out = append(out, describe(md))
	}
	runtime.KeepAlive(r) // the gauges hold recorders weakly
	slices.Sort(out)
	return out
}

// Every instrument of 85a6eb9 (testdata, written by that commit's adapter)
// is still made, of its unit and kind and with its attributes; those added
// since are listed here, so that none comes or goes unseen.
func TestInstrumentsOf85a6eb9Stay(t *testing.T) {
	base := "messaging.destination.name,messaging.system"
	added := []string{
		"amqpsub.messages.parked {message} sum_int64 monotonic=false " + base,
		// The table's other gauges, since the adapter ranges over it.
		"amqpsub.max_held {message} sum_int64 monotonic=false " + base,
		"amqpsub.max_bytes_held By sum_int64 monotonic=false " + base,
		"amqpsub.buffered {message} sum_int64 monotonic=false " + base,
		"amqpsub.handling {message} sum_int64 monotonic=false " + base,
		"amqpsub.settling {message} sum_int64 monotonic=false " + base,
		"amqpsub.longest_lane {message} gauge_int64 " + base,
		"amqpsub.round_trip ns gauge_int64 " + base,
	}
	golden.Check(t, "testdata/instruments-85a6eb9.txt", 16, added, instruments(t))
}

// Every row of amqpsub.StatFields but the counters (which the recorder
// counts as they happen) is an instrument of the row's name, unit and
// help; a StatMaxGauge of two subscribers of one queue is the higher, a
// StatGauge the sum.
func TestEveryStatGaugeIsAnInstrument(t *testing.T) {
	m, reader := newMetrics(t)
	st := func(rt time.Duration, load int) func() amqpsub.Stats {
		return func() amqpsub.Stats {
			return amqpsub.Stats{RoundTrip: rt, Buffered: 2, Lanes: []amqpsub.LaneStats{{Load: load}}}
		}
	}
	recs := []amqpsub.Recorder{m.Recorder(info("q", st(3*time.Millisecond, 4))), m.Recorder(info("q", st(5*time.Millisecond, 1)))}
	c := collect(t, reader)
	for _, f := range amqpsub.StatFields() {
		if f.Kind == amqpsub.StatCounter {
			continue
		}
		md, ok := c[amqpotel.InstrumentName(f)]
		if !ok || md.Unit != f.Unit || md.Description != f.Help {
			t.Errorf("row %s: instrument %q, unit %q, description %q", f.Name, amqpotel.InstrumentName(f), md.Unit, md.Description)
		}
		_, isGauge := md.Data.(metricdata.Gauge[int64])
		if isGauge != (f.Kind == amqpsub.StatMaxGauge) {
			t.Errorf("row %s, a %s: data %T", f.Name, f.Kind, md.Data)
		}
	}
	gauge := func(name string) int64 {
		g, _ := c[name].Data.(metricdata.Gauge[int64])
		if len(g.DataPoints) != 1 {
			t.Fatalf("%s: %d points", name, len(g.DataPoints))
		}
		return g.DataPoints[0].Value
	}
	if got := gauge("amqpsub.round_trip"); got != int64(5*time.Millisecond) {
		t.Errorf("round trip = %d ns, want the higher, 5 ms", got)
	}
	if got := gauge("amqpsub.longest_lane"); got != 4 {
		t.Errorf("longest lane = %d, want the higher, 4", got)
	}
	if got := c.sum("amqpsub.buffered"); got != 4 {
		t.Errorf("buffered = %d, want 2 + 2", got)
	}
	runtime.KeepAlive(recs)
}
