package amqpotel_test

import (
	"context"
	"fmt"
	"sort"
	"strings"
	"testing"

	"github.com/Azure/go-amqp"
	"go.opentelemetry.io/otel/attribute"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"
	"go.uber.org/goleak"

	"github.com/amqpsub/amqpsub/amqpsubtest"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// collected is one collection of a ManualReader, by instrument name.
type collected map[string]metricdata.Metrics

func collect(t testing.TB, r *sdkmetric.ManualReader) collected {
	t.Helper()
	var rm metricdata.ResourceMetrics
	if err := r.Collect(context.Background(), &rm); err != nil {
		t.Fatal(err)
	}
	c := collected{}
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			c[m.Name] = m
		}
	}
	return c
}

// has reports whether set holds every one of kvs; a kv whose value is the
// empty string means the key must be absent.
func has(set attribute.Set, kvs []attribute.KeyValue) bool {
	for _, kv := range kvs {
		v, ok := set.Value(kv.Key)
		if kv.Value.Type() == attribute.STRING && kv.Value.AsString() == "" {
			if ok {
				return false
			}
			continue
		}
		if !ok || v != kv.Value {
			return false
		}
	}
	return true
}

// sum adds up the points of an int64 sum whose attributes hold kvs.
func (c collected) sum(name string, kvs ...attribute.KeyValue) int64 {
	var n int64
	if s, ok := c[name].Data.(metricdata.Sum[int64]); ok {
		for _, p := range s.DataPoints {
			if has(p.Attributes, kvs) {
				n += p.Value
			}
		}
	}
	return n
}

// points counts an instrument's int64 sum points whose attributes hold
// kvs.
func (c collected) points(name string, kvs ...attribute.KeyValue) int {
	n := 0
	if s, ok := c[name].Data.(metricdata.Sum[int64]); ok {
		for _, p := range s.DataPoints {
			if has(p.Attributes, kvs) {
				n++
			}
		}
	}
	return n
}

// count adds up the counts of a histogram's points whose attributes hold
// kvs.
func (c collected) count(name string, kvs ...attribute.KeyValue) uint64 {
	var n uint64
	switch h := c[name].Data.(type) {
	case metricdata.Histogram[float64]:
		for _, p := range h.DataPoints {
			if has(p.Attributes, kvs) {
				n += p.Count
			}
		}
	case metricdata.Histogram[int64]:
		for _, p := range h.DataPoints {
			if has(p.Attributes, kvs) {
				n += p.Count
			}
		}
	}
	return n
}

// attrSets lists the attribute sets of an instrument's points, for
// failure messages.
func (c collected) attrSets(name string) string {
	var out []string
	add := func(s attribute.Set) { out = append(out, s.Encoded(attribute.DefaultEncoder())) }
	switch d := c[name].Data.(type) {
	case metricdata.Sum[int64]:
		for _, p := range d.DataPoints {
			add(p.Attributes)
			out[len(out)-1] += fmt.Sprintf(" = %d", p.Value)
		}
	case metricdata.Histogram[float64]:
		for _, p := range d.DataPoints {
			add(p.Attributes)
			out[len(out)-1] += fmt.Sprintf(" count %d", p.Count)
		}
	case metricdata.Histogram[int64]:
		for _, p := range d.DataPoints {
			add(p.Attributes)
			out[len(out)-1] += fmt.Sprintf(" count %d", p.Count)
		}
	}
	sort.Strings(out)
	return strings.Join(out, "\n")
}

// producerContext returns a sampled span context of trace n, as a producer
// would have sent, and its traceparent.
func producerContext(n byte) (trace.SpanContext, string) {
	sc := trace.NewSpanContext(trace.SpanContextConfig{
		TraceID:    trace.TraceID{0xa1, 0xb2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, n},
		SpanID:     trace.SpanID{0xc3, 0, 0, 0, 0, 0, 0, n},
		TraceFlags: trace.FlagsSampled,
		Remote:     true,
	})
	return sc, fmt.Sprintf("00-%s-%s-01", sc.TraceID(), sc.SpanID())
}

// message returns a message with body, message-id id and application
// properties props.
func message(id, body string, props map[string]any) *amqp.Message {
	m := amqpsubtest.Message("", body)
	m.Properties = &amqp.MessageProperties{MessageID: id}
	m.ApplicationProperties = props
	return m
}

// spans is a tracer provider that records every span, and its recorder.
func spans() (*sdktrace.TracerProvider, *tracetest.SpanRecorder) {
	rec := tracetest.NewSpanRecorder()
	return sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec)), rec
}

// attr returns a span's attribute key, and whether it is set.
func attr(s sdktrace.ReadOnlySpan, key attribute.Key) (attribute.Value, bool) {
	for _, kv := range s.Attributes() {
		if kv.Key == key {
			return kv.Value, true
		}
	}
	return attribute.Value{}, false
}

func attrString(s sdktrace.ReadOnlySpan, key attribute.Key) string {
	v, _ := attr(s, key)
	return v.String()
}
