package amqpotel_test

import (
	"context"
	"fmt"
	"runtime"
	"sync"
	"testing"

	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/embedded"

	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/amqpsub/amqpsub/amqpsub"
	"github.com/amqpsub/amqpsub/amqpsubtest"
	"github.com/amqpsub/amqpsub/contrib/amqpotel"
)

// A collection running while New makes a subscriber calls its Stats
// (registered by Recorder) before New has finished: it must not race.
// (Found by an outside review.)
func TestCollectDuringNewDoesNotRace(t *testing.T) {
	m, reader := newMetrics(t)
	stop, done := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(done)
		for {
			select {
			case <-stop:
				return
			default:
				var rm metricdata.ResourceMetrics
				_ = reader.Collect(context.Background(), &rm)
			}
		}
	}()
	nop := amqpsub.HandlerFunc(func(context.Context, *amqpsub.Delivery) error { return nil })
	subs := make([]*amqpsub.Subscriber, 0, 200)
	for i := range 200 {
		q := amqpsubtest.NewQueue()
		s, err := amqpsub.New(q.Connector(), fmt.Sprint("q", i), nop, amqpsub.WithMetrics(m))
		if err != nil {
			t.Fatal(err)
		}
		subs = append(subs, s)
	}
	close(stop)
	<-done
	runtime.KeepAlive(subs) // the Metrics holds them weakly: alive while collected
}

// countingProvider counts the spans started through it, recorded or not.
type countingProvider struct {
	embedded.TracerProvider
	inner trace.TracerProvider
	mu    sync.Mutex
	names []string
}

type countingTracer struct {
	embedded.Tracer
	p     *countingProvider
	inner trace.Tracer
}

func (p *countingProvider) Tracer(name string, opts ...trace.TracerOption) trace.Tracer {
	return countingTracer{p: p, inner: p.inner.Tracer(name, opts...)}
}

func (t countingTracer) Start(ctx context.Context, name string, opts ...trace.SpanStartOption) (context.Context, trace.Span) {
	t.p.mu.Lock()
	t.p.names = append(t.p.names, name)
	t.p.mu.Unlock()
	return t.inner.Start(ctx, name, opts...)
}

// A process span that is sampled out asks for no settle span: counted at
// the provider, since a span recorder behind a NeverSample provider sees
// no span whatever the code does. (An outside review found that
// TestNotRecorded alone cannot fail on this.)
func TestNotRecordedStartsNoSettleSpan(t *testing.T) {
	rec := tracetest.NewSpanRecorder()
	never := &countingProvider{inner: sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec), sdktrace.WithSampler(sdktrace.NeverSample()))}
	q := amqpsubtest.NewQueue()
	q.Publish(message("a", "x", nil), message("r", "x", nil))
	drain(t, q, amqpotel.Handler("orders", amqpsub.HandlerFunc(func(context.Context, *amqpsub.Delivery) error { return nil }),
		amqpotel.WithTracerProvider(never)))
	never.mu.Lock()
	defer never.mu.Unlock()
	if len(never.names) != 2 || never.names[0] != "process orders" || never.names[1] != "process orders" {
		t.Fatalf("spans started: %v; want only the two process spans", never.names)
	}
}
