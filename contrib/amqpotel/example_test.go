package amqpotel_test

import (
	"context"
	"fmt"
	"time"

	"github.com/Azure/go-amqp"
	"go.opentelemetry.io/otel/attribute"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/amqpsub/amqpsub/amqpsub"
	"github.com/amqpsub/amqpsub/amqpsubtest"
	"github.com/amqpsub/amqpsub/contrib/amqpotel"
)

// Metrics for a subscriber: give NewMetrics's result to amqpsub.WithMetrics.
// In production the meter provider is the application's, with a periodic
// reader and an exporter (OTLP, Prometheus); here a manual reader shows
// what was recorded.
func ExampleNewMetrics() {
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	defer mp.Shutdown(context.Background())

	metrics, err := amqpotel.NewMetrics(amqpotel.WithMeterProvider(mp))
	if err != nil {
		panic(err)
	}
	q := amqpsubtest.NewQueue() // the broker; amqpsub.Dial(url, nil) in production
	q.Publish(amqpsubtest.Message("", "a"), amqpsubtest.Message("", "b"), amqpsubtest.Message("", "malformed"))
	h := amqpsub.HandlerFunc(func(_ context.Context, d *amqpsub.Delivery) error {
		if body, _ := d.Body(); string(body) == "malformed" {
			return amqpsub.Reject("malformed")
		}
		return nil
	})
	sub, err := amqpsub.New(q.Connector(), "orders", h, amqpsub.WithMetrics(metrics))
	if err != nil {
		panic(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := q.Drain(ctx, sub); err != nil {
		panic(err)
	}

	var rm metricdata.ResourceMetrics
	if err := reader.Collect(ctx, &rm); err != nil {
		panic(err)
	}
	for _, m := range rm.ScopeMetrics[0].Metrics {
		switch m.Name {
		case amqpotel.ConsumedMessagesName, amqpotel.SettlementsName:
			for _, p := range m.Data.(metricdata.Sum[int64]).DataPoints {
				outcome, _ := p.Attributes.Value(amqpotel.OutcomeKey)
				fmt.Println(m.Name, outcome.String(), p.Value)
			}
		}
	}
	// Unordered output:
	// messaging.client.consumed.messages  3
	// amqpsub.settlements accepted 2
	// amqpsub.settlements rejected 1
}

// Tracing a handler: the message carries its producer's W3C traceparent
// in its application properties, and is processed in a span of that
// trace, then settled in a child span.
func ExampleHandler() {
	spans := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(spans))
	defer tp.Shutdown(context.Background())

	q := amqpsubtest.NewQueue()
	m := amqp.NewMessage([]byte(`{"amount": 5}`))
	m.Properties = &amqp.MessageProperties{MessageID: "order-1"}
	m.ApplicationProperties = map[string]any{"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}
	q.Publish(m)

	h := amqpsub.HandlerFunc(func(ctx context.Context, d *amqpsub.Delivery) error {
		// ctx holds the process span: spans started from it are its children.
		return nil
	})
	sub, err := amqpsub.New(q.Connector(), "orders", amqpotel.Handler("orders", h, amqpotel.WithTracerProvider(tp)))
	if err != nil {
		panic(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := q.Drain(ctx, sub); err != nil {
		panic(err)
	}
	for _, s := range spans.Ended() {
		fmt.Printf("%s (%s) trace %s: %s %s\n", s.Name(), s.SpanKind(), s.SpanContext().TraceID(),
			value(s, "messaging.message.id"), value(s, amqpotel.ResultKey)+value(s, amqpotel.OutcomeKey))
	}
	// Output:
	// process orders (consumer) trace 4bf92f3577b34da6a3ce929d0e0e4736: order-1 accept
	// accept orders (client) trace 4bf92f3577b34da6a3ce929d0e0e4736: order-1 accepted
}

// Tracing a batch handler: one span per call, linked to each message's
// producer, and a settle span per delivery.
func ExampleBatchHandler() {
	spans := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(spans))
	defer tp.Shutdown(context.Background())

	q := amqpsubtest.NewQueue()
	for _, tid := range []string{"4bf92f3577b34da6a3ce929d0e0e4736", "0af7651916cd43dd8448eb211c80319c"} {
		m := amqp.NewMessage([]byte("x"))
		m.ApplicationProperties = map[string]any{"traceparent": "00-" + tid + "-00f067aa0ba902b7-01"}
		q.Publish(m)
	}
	h := amqpsub.BatchHandlerFunc(func(ctx context.Context, batch []*amqpsub.Delivery) []error { return nil })
	sub, err := amqpsub.NewBatch(q.Connector(), "orders", amqpotel.BatchHandler("orders", h, amqpotel.WithTracerProvider(tp)),
		amqpsub.Batch(2, time.Hour))
	if err != nil {
		panic(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := q.Drain(ctx, sub); err != nil {
		panic(err)
	}
	for _, s := range spans.Ended() {
		fmt.Printf("%s: %d links, outcome %q, batch of %q\n", s.Name(), len(s.Links()),
			value(s, amqpotel.OutcomeKey), value(s, "messaging.batch.message_count"))
	}
	// Output:
	// process orders: 2 links, outcome "", batch of "2"
	// accept orders: 0 links, outcome "accepted", batch of ""
	// accept orders: 0 links, outcome "accepted", batch of ""
}

// value returns a span's attribute, "" when unset.
func value(s sdktrace.ReadOnlySpan, key attribute.Key) string {
	for _, kv := range s.Attributes() {
		if kv.Key == key {
			return kv.Value.String()
		}
	}
	return ""
}
