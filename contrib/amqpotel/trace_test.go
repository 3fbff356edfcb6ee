package amqpotel_test

import (
	"context"
	"errors"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/baggage"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/embedded"

	"github.com/amqpsub/amqpsub/amqpsub"
	"github.com/amqpsub/amqpsub/amqpsubtest"
	"github.com/amqpsub/amqpsub/contrib/amqpotel"
)

// drain runs h on q until every message is accepted or dead-lettered.
func drain(t *testing.T, q *amqpsubtest.Queue, h amqpsub.Handler, opts ...amqpsub.Option) *amqpsub.Subscriber {
	t.Helper()
	sub, err := amqpsub.New(q.Connector(), "orders", h, opts...)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
	defer cancel()
	if err := q.Drain(ctx, sub); err != nil {
		t.Fatal(err)
	}
	return sub
}

// byName splits ended spans into process and settle spans, in the order
// they ended.
func byName(rec *tracetest.SpanRecorder) (process, settle []sdktrace.ReadOnlySpan) {
	for _, s := range rec.Ended() {
		if strings.HasPrefix(s.Name(), "process ") {
			process = append(process, s)
		} else {
			settle = append(settle, s)
		}
	}
	return process, settle
}

// settleOf returns the settle spans whose parent is the span p.
func settleOf(settle []sdktrace.ReadOnlySpan, p sdktrace.ReadOnlySpan) []sdktrace.ReadOnlySpan {
	var out []sdktrace.ReadOnlySpan
	for _, s := range settle {
		if s.Parent().SpanID() == p.SpanContext().SpanID() {
			out = append(out, s)
		}
	}
	return out
}

// A message published with a traceparent is processed in a span of its
// trace, a child of the producer's span and linked to it, and settled in a
// child of that.
func TestTraceparentPropagated(t *testing.T) {
	tp, rec := spans()
	producer, traceparent := producerContext(1)
	q := amqpsubtest.NewQueue()
	m := message("m-1", "x", map[string]any{"traceparent": traceparent, "tracestate": "vendor=1"})
	m.Properties.CorrelationID = uint64(42)
	q.Publish(m)
	var inHandler trace.SpanContext
	h := amqpsub.HandlerFunc(func(ctx context.Context, d *amqpsub.Delivery) error {
		inHandler = trace.SpanContextFromContext(ctx)
		return nil
	})
	drain(t, q, amqpotel.Handler("orders", h, amqpotel.WithTracerProvider(tp)))

	process, settle := byName(rec)
	if len(process) != 1 || len(settle) != 1 {
		t.Fatalf("%d process spans, %d settle spans", len(process), len(settle))
	}
	p := process[0]
	if p.Name() != "process orders" || p.SpanKind() != trace.SpanKindConsumer {
		t.Errorf("process span %q of kind %v", p.Name(), p.SpanKind())
	}
	if p.SpanContext().TraceID() != producer.TraceID() || p.Parent().SpanID() != producer.SpanID() || !p.Parent().IsRemote() {
		t.Errorf("process span %v, parent %v; producer %v", p.SpanContext(), p.Parent(), producer)
	}
	if p.SpanContext().TraceState().Get("vendor") != "1" {
		t.Errorf("tracestate %q not kept", p.SpanContext().TraceState())
	}
	if !inHandler.Equal(p.SpanContext()) {
		t.Errorf("the handler's ctx has %v, not the process span", inHandler)
	}
	if l := p.Links(); len(l) != 1 || l[0].SpanContext.SpanID() != producer.SpanID() {
		t.Errorf("links = %+v", l)
	}
	for key, want := range map[attribute.Key]string{
		"messaging.system":                  "activemq",
		"messaging.destination.name":        "orders",
		"messaging.operation.name":          "process",
		"messaging.operation.type":          "process",
		"messaging.message.id":              "m-1",
		"messaging.message.conversation_id": "42",
		amqpotel.DeliveryCountKey:           "0",
		amqpotel.LaneKey:                    "0",
		amqpotel.ResultKey:                  "accept",
	} {
		if got := attrString(p, key); got != want {
			t.Errorf("process span %s = %q, want %q", key, got, want)
		}
	}
	if _, ok := attr(p, "error.type"); ok || p.Status().Code == codes.Error {
		t.Errorf("accepted, yet error.type %q, status %v", attrString(p, "error.type"), p.Status())
	}
	s := settle[0]
	if s.Name() != "accept orders" || s.SpanKind() != trace.SpanKindClient || s.Parent().SpanID() != p.SpanContext().SpanID() {
		t.Errorf("settle span %q kind %v parent %v", s.Name(), s.SpanKind(), s.Parent())
	}
	for key, want := range map[attribute.Key]string{
		"messaging.operation.name": "accept",
		"messaging.operation.type": "settle",
		"messaging.message.id":     "m-1",
		amqpotel.OutcomeKey:        "accepted",
	} {
		if got := attrString(s, key); got != want {
			t.Errorf("settle span %s = %q, want %q", key, got, want)
		}
	}
	if s.StartTime().Before(p.EndTime().Add(-time.Millisecond)) || s.EndTime().Before(s.StartTime()) {
		t.Errorf("settle span from %v to %v; process span ended %v", s.StartTime(), s.EndTime(), p.EndTime())
	}
}

// Without a traceparent, the Diagnostic-Id the Service Bus SDKs write is
// read; an old Request-Id there is ignored, and so is a property that is
// not a string.
func TestDiagnosticIDFallback(t *testing.T) {
	tp, rec := spans()
	producer, traceparent := producerContext(2)
	q := amqpsubtest.NewQueue()
	q.Publish(message("diag", "x", map[string]any{amqpotel.DiagnosticIDProperty: traceparent}),
		message("request-id", "x", map[string]any{amqpotel.DiagnosticIDProperty: "|a1b2c3.1."}),
		message("binary", "x", map[string]any{"traceparent": []byte(traceparent)}),
		message("none", "x", nil))
	h := amqpsub.HandlerFunc(func(context.Context, *amqpsub.Delivery) error { return nil })
	drain(t, q, amqpotel.Handler("orders", h, amqpotel.WithTracerProvider(tp), amqpotel.WithSystem("servicebus")))

	process, _ := byName(rec)
	if len(process) != 4 {
		t.Fatalf("%d process spans", len(process))
	}
	for _, p := range process {
		id := attrString(p, "messaging.message.id")
		fromProducer := p.SpanContext().TraceID() == producer.TraceID()
		if fromProducer != (id == "diag") {
			t.Errorf("%s: trace %v (producer's: %v)", id, p.SpanContext().TraceID(), producer.TraceID())
		}
		if id != "diag" && (p.Parent().IsValid() || len(p.Links()) != 0) {
			t.Errorf("%s: parent %v, links %v", id, p.Parent(), p.Links())
		}
		if got := attrString(p, "messaging.system"); got != "servicebus" {
			t.Errorf("%s: messaging.system %q", id, got)
		}
	}
}

// A span active in the handler's context (a wrapping middleware's) is the
// process span's parent; the producer's context is then only linked, and
// the propagator's baggage still reaches the handler.
func TestActiveSpanIsParent(t *testing.T) {
	tp, rec := spans()
	producer, traceparent := producerContext(3)
	q := amqpsubtest.NewQueue()
	q.Publish(message("m", "x", map[string]any{"traceparent": traceparent, "baggage": "tenant=acme"}))
	var gotBaggage string
	inner := amqpotel.Handler("orders", amqpsub.HandlerFunc(func(ctx context.Context, _ *amqpsub.Delivery) error {
		gotBaggage = baggage.FromContext(ctx).Member("tenant").Value()
		return nil
	}), amqpotel.WithTracerProvider(tp),
		amqpotel.WithPropagator(propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{})))
	outer := amqpsub.HandlerFunc(func(ctx context.Context, d *amqpsub.Delivery) error {
		ctx, span := tp.Tracer("test").Start(ctx, "outer")
		defer span.End()
		return inner.Handle(ctx, d)
	})
	drain(t, q, outer)

	process, _ := byName(rec)
	var o sdktrace.ReadOnlySpan
	for _, s := range rec.Ended() {
		if s.Name() == "outer" {
			o = s
		}
	}
	if len(process) != 1 || o == nil {
		t.Fatalf("spans: %d process, outer %v", len(process), o)
	}
	p := process[0]
	if p.Parent().SpanID() != o.SpanContext().SpanID() || p.SpanContext().TraceID() != o.SpanContext().TraceID() {
		t.Errorf("process span's parent %v, want the outer span %v", p.Parent(), o.SpanContext())
	}
	if l := p.Links(); len(l) != 1 || l[0].SpanContext.TraceID() != producer.TraceID() {
		t.Errorf("links = %+v", l)
	}
	if gotBaggage != "acme" {
		t.Errorf("baggage tenant = %q", gotBaggage)
	}
}

// Each handler result is recorded on its process span, and each
// settlement's outcome on its settle span: a Reject, a Retry until
// dead-lettered, a Release, and a panic (panicked again, so that the
// subscriber recovers it as ever).
func TestResultsRecorded(t *testing.T) {
	tp, rec := spans()
	q := amqpsubtest.NewQueue(amqpsubtest.MaxDeliveryAttempts(2))
	for _, id := range []string{"ok", "reject", "retry", "release-once", "panic-once"} {
		q.Publish(message(id, id, nil))
	}
	var mu sync.Mutex
	seen := map[string]int{}
	h := amqpsub.HandlerFunc(func(_ context.Context, d *amqpsub.Delivery) error {
		body, _ := d.Body()
		mu.Lock()
		seen[string(body)]++
		n := seen[string(body)]
		mu.Unlock()
		switch string(body) {
		case "reject":
			return amqpsub.Reject("malformed")
		case "retry":
			return errors.New("payment service down")
		case "release-once":
			if n == 1 {
				return amqpsub.Release()
			}
		case "panic-once":
			if n == 1 {
				panic("boom")
			}
		}
		return nil
	})
	sub := drain(t, q, amqpotel.Handler("orders", h, amqpotel.WithTracerProvider(tp)))
	if st := sub.Stats(); st.Results.Panics != 1 {
		t.Errorf("the subscriber saw %d panics, want 1 (panicked again)", st.Results.Panics)
	}

	process, settle := byName(rec)
	type step struct{ result, errType, settle string }
	got := map[string][]step{}
	for _, p := range process {
		s := settleOf(settle, p)
		if len(s) != 1 {
			t.Fatalf("process span of %s has %d settle spans", attrString(p, "messaging.message.id"), len(s))
		}
		st := step{attrString(p, amqpotel.ResultKey), attrString(p, "error.type"), s[0].Name()}
		if (st.errType != "") != (p.Status().Code == codes.Error) {
			t.Errorf("%+v: status %v", st, p.Status())
		}
		if st.errType != "" && !hasException(p) {
			t.Errorf("%+v: no exception event", st)
		}
		id := attrString(p, "messaging.message.id")
		got[id] = append(got[id], st)
	}
	want := map[string][]step{
		"ok":           {{"accept", "", "accept orders"}},
		"reject":       {{"reject", "reject", "reject orders"}},
		"retry":        {{"retry", "retry", "modify orders"}, {"retry", "retry", "modify orders"}},
		"release-once": {{"release", "", "release orders"}, {"accept", "", "accept orders"}},
		"panic-once":   {{"retry", "panic", "modify orders"}, {"accept", "", "accept orders"}},
	}
	for id, w := range want {
		g := got[id]
		sortSteps := func(s []step) {
			sort.Slice(s, func(i, j int) bool { return s[i].result+s[i].errType > s[j].result+s[j].errType })
		}
		sortSteps(g)
		sortSteps(w)
		if len(g) != len(w) {
			t.Errorf("%s: %+v, want %+v", id, g, w)
			continue
		}
		for i := range w {
			if g[i] != w[i] {
				t.Errorf("%s: %+v, want %+v", id, g, w)
			}
		}
	}
	// The retried message's deliveries carry their counts.
	var counts []string
	for _, p := range process {
		if attrString(p, "messaging.message.id") == "retry" {
			counts = append(counts, attrString(p, amqpotel.DeliveryCountKey))
		}
	}
	sort.Strings(counts)
	if strings.Join(counts, ",") != "0,1" {
		t.Errorf("delivery counts of the retried message: %v", counts)
	}
}

func hasException(s sdktrace.ReadOnlySpan) bool {
	for _, e := range s.Events() {
		if e.Name == "exception" {
			return true
		}
	}
	return false
}

// On Service Bus the settle spans take its operation names and
// disposition status.
func TestServiceBusSettleNames(t *testing.T) {
	tp, rec := spans()
	q := amqpsubtest.NewQueue(amqpsubtest.MaxDeliveryAttempts(1))
	for _, id := range []string{"ok", "reject", "retry"} {
		q.Publish(message(id, id, nil))
	}
	h := amqpsub.HandlerFunc(func(_ context.Context, d *amqpsub.Delivery) error {
		switch d.MessageID() {
		case "reject":
			return amqpsub.Reject("no")
		case "retry":
			return errors.New("later")
		}
		return nil
	})
	drain(t, q, amqpotel.Handler("orders", h, amqpotel.WithTracerProvider(tp), amqpotel.WithSystem("servicebus")))
	_, settle := byName(rec)
	got := map[string]string{}
	for _, s := range settle {
		got[attrString(s, "messaging.message.id")] = s.Name() + " " + attrString(s, "messaging.servicebus.disposition_status")
	}
	want := map[string]string{"ok": "complete orders complete", "reject": "dead_letter orders dead_letter", "retry": "abandon orders abandon"}
	for id, w := range want {
		if got[id] != w {
			t.Errorf("%s: settle span %q, want %q", id, got[id], w)
		}
	}
}

// A settlement not sent, the link lost while the handler had the
// delivery, ends its settle span with an error; the redelivery gets spans
// of its own.
func TestSettleSpanNotSent(t *testing.T) {
	tp, rec := spans()
	q := amqpsubtest.NewQueue()
	q.Publish(message("m", "x", nil))
	sub, inHandler := loseLinkInHandler(t, q, func(h amqpsub.Handler) amqpsub.Handler {
		return amqpotel.Handler("orders", h, amqpotel.WithTracerProvider(tp))
	})
	go func() {
		<-inHandler
		q.LoseLinks(nil)
	}()
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
	defer cancel()
	if err := q.Drain(ctx, sub); err != nil {
		t.Fatal(err)
	}
	_, settle := byName(rec)
	if len(settle) != 2 {
		t.Fatalf("%d settle spans", len(settle))
	}
	var failed, ok int
	for _, s := range settle {
		switch {
		case s.Status().Code == codes.Error && attrString(s, "error.type") == amqpotel.ErrorTypeNotSettled && hasException(s):
			failed++
		case s.Status().Code != codes.Error:
			ok++
		}
	}
	if failed != 1 || ok != 1 {
		for _, s := range settle {
			t.Logf("%s: %v %s", s.Name(), s.Status(), attrString(s, "error.type"))
		}
		t.Errorf("%d settle spans failed with not_settled, %d succeeded", failed, ok)
	}
}

// A batch is processed in one span linked to each message's producer, with
// a settle span per delivery.
func TestBatchSpans(t *testing.T) {
	tp, rec := spans()
	q := amqpsubtest.NewQueue()
	producers := map[trace.TraceID]bool{}
	for i := range 5 {
		sc, traceparent := producerContext(byte(10 + i))
		producers[sc.TraceID()] = true
		q.Publish(message(string(rune('a'+i)), "x", map[string]any{"traceparent": traceparent}))
	}
	q.Publish(message("no-context", "x", nil))
	var calls int
	h := amqpsub.BatchHandlerFunc(func(_ context.Context, b []*amqpsub.Delivery) []error {
		calls++
		res := make([]error, len(b))
		for i, d := range b {
			if d.MessageID() == "c" {
				res[i] = amqpsub.Reject("bad c")
			}
		}
		return res
	})
	sub, err := amqpsub.NewBatch(q.Connector(), "orders", amqpotel.BatchHandler("orders", h, amqpotel.WithTracerProvider(tp)),
		amqpsub.Batch(6, time.Hour))
	if err != nil {
		t.Fatal(err)
	}
	if err := q.Drain(t.Context(), sub); err != nil {
		t.Fatal(err)
	}
	process, settle := byName(rec)
	if calls != 1 || len(process) != 1 {
		t.Fatalf("%d calls, %d process spans", calls, len(process))
	}
	p := process[0]
	if p.Parent().IsValid() || p.SpanKind() != trace.SpanKindConsumer {
		t.Errorf("batch span's parent %v, kind %v", p.Parent(), p.SpanKind())
	}
	if len(p.Links()) != 5 {
		t.Errorf("%d links, want 5", len(p.Links()))
	}
	for _, l := range p.Links() {
		if !producers[l.SpanContext.TraceID()] {
			t.Errorf("a link to %v, no producer's", l.SpanContext)
		}
	}
	if got := attrString(p, "messaging.batch.message_count"); got != "6" {
		t.Errorf("messaging.batch.message_count = %s", got)
	}
	if attrString(p, amqpotel.ResultKey) != "reject" || attrString(p, "error.type") != "reject" || p.Status().Code != codes.Error {
		t.Errorf("result %q, error.type %q, status %v", attrString(p, amqpotel.ResultKey), attrString(p, "error.type"), p.Status())
	}
	var failed []string
	for _, e := range p.Events() {
		for _, kv := range e.Attributes {
			if kv.Key == "messaging.message.id" {
				failed = append(failed, kv.Value.AsString())
			}
		}
	}
	if strings.Join(failed, ",") != "c" {
		t.Errorf("errors recorded for %v, want c", failed)
	}
	mine := settleOf(settle, p)
	names := map[string]int{}
	for _, s := range mine {
		names[s.Name()]++
	}
	if len(mine) != 6 || names["accept orders"] != 5 || names["reject orders"] != 1 {
		t.Errorf("settle spans: %v", names)
	}
}

// A batch handler that returns a slice of the wrong length has its whole
// batch retried: the span says so.
func TestBatchWrongLength(t *testing.T) {
	tp, rec := spans()
	q := amqpsubtest.NewQueue(amqpsubtest.MaxDeliveryAttempts(1))
	q.Publish(message("a", "x", nil), message("b", "x", nil))
	h := amqpsub.BatchHandlerFunc(func(context.Context, []*amqpsub.Delivery) []error { return []error{nil} })
	sub, err := amqpsub.NewBatch(q.Connector(), "orders", amqpotel.BatchHandler("orders", h, amqpotel.WithTracerProvider(tp)),
		amqpsub.Batch(2, time.Hour))
	if err != nil {
		t.Fatal(err)
	}
	if err := q.Drain(t.Context(), sub); err != nil {
		t.Fatal(err)
	}
	process, settle := byName(rec)
	if len(process) != 1 || attrString(process[0], amqpotel.ResultKey) != "retry" || !hasException(process[0]) {
		t.Fatalf("process spans: %v", process)
	}
	for _, s := range settle {
		if s.Name() != "modify orders" {
			t.Errorf("settle span %q", s.Name())
		}
	}
}

func TestHandlerInvalidOptions(t *testing.T) {
	h := amqpsub.HandlerFunc(func(context.Context, *amqpsub.Delivery) error { return nil })
	bh := amqpsub.BatchHandlerFunc(func(context.Context, []*amqpsub.Delivery) []error { return nil })
	for name, f := range map[string]func(){
		"nil handler":        func() { amqpotel.Handler("q", nil) },
		"nil batch handler":  func() { amqpotel.BatchHandler("q", nil) },
		"empty queue":        func() { amqpotel.Handler("", h) },
		"nil tracer":         func() { amqpotel.Handler("q", h, amqpotel.WithTracerProvider(nil)) },
		"nil propagator":     func() { amqpotel.BatchHandler("q", bh, amqpotel.WithPropagator(nil)) },
		"empty system":       func() { amqpotel.Handler("q", h, amqpotel.WithSystem("")) },
		"nil option (batch)": func() { amqpotel.BatchHandler("q", bh, nil) },
	} {
		func() {
			defer func() {
				err, _ := recover().(error)
				if !errors.Is(err, amqpotel.ErrInvalidOption) {
					t.Errorf("%s: panicked with %v, want ErrInvalidOption", name, err)
				}
			}()
			f()
		}()
	}
}

// A process span sampled out records nothing, and asks for no settle span;
// without any option the global provider (here the API's no-op) is used.
// Either way the handler runs and its results settle as ever.
func TestNotRecorded(t *testing.T) {
	rec := tracetest.NewSpanRecorder()
	never := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec), sdktrace.WithSampler(sdktrace.NeverSample()))
	for name, h := range map[string]amqpsub.Handler{
		"never sampled": amqpotel.Handler("orders", amqpsub.HandlerFunc(func(_ context.Context, d *amqpsub.Delivery) error {
			if d.MessageID() == "r" {
				return amqpsub.Reject("r")
			}
			return nil
		}), amqpotel.WithTracerProvider(never)),
		"global no-op": amqpotel.Handler("orders", amqpsub.HandlerFunc(func(context.Context, *amqpsub.Delivery) error {
			return nil
		})),
	} {
		q := amqpsubtest.NewQueue()
		q.Publish(message("a", "x", nil), message("r", "x", nil))
		sub := drain(t, q, h)
		if st := sub.Stats().Settled; st.Accepted+st.Rejected != 2 {
			t.Errorf("%s: settled %+v", name, st)
		}
	}
	if n := len(rec.Ended()) + len(rec.Started()); n != 0 {
		t.Errorf("%d spans recorded", n)
	}
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
// no span whatever the code does: TestNotRecorded, which counts recorded
// spans, cannot fail on this.
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
