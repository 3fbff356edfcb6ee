package amqpotel

import (
	"context"
	"encoding/hex"
	"fmt"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/Azure/go-amqp"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
	"go.opentelemetry.io/otel/trace"

	"github.com/amqpsub/amqpsub/amqpsub"
)

// DiagnosticIDProperty is the application property the Azure Service Bus
// SDKs write the producer's trace context to: a W3C traceparent in
// current SDKs. A delivery with no "traceparent" property is read from it.
// Older SDKs wrote a Request-Id ("|...") there, which is not read.
const DiagnosticIDProperty = "Diagnostic-Id"

// tracing is what Handler and BatchHandler share: the tracer, and the
// names and attributes made once.
type tracing struct {
	tracer      trace.Tracer
	prop        propagation.TextMapPropagator
	processName string
	process     []attribute.KeyValue // messaging.system, destination, operation name and type
	settle      [4]settleSpan        // by amqpsub.Outcome
	copied      settleSpan           // a rejection DeadLetterCopy copied, accepted
}

type settleSpan struct {
	name  string
	attrs []attribute.KeyValue
}

func newTracing(queue string, opts []Option) *tracing {
	c, err := newConfig(opts)
	if err == nil && queue == "" {
		err = fmt.Errorf("%w: empty queue name", ErrInvalidOption)
	}
	if err != nil {
		panic(err)
	}
	base := []attribute.KeyValue{
		semconv.MessagingSystemKey.String(c.system),
		semconv.MessagingDestinationNameKey.String(queue),
	}
	t := &tracing{
		tracer:      c.tracers.Tracer(ScopeName, trace.WithSchemaURL(semconv.SchemaURL)),
		prop:        c.prop,
		processName: "process " + queue,
		process: append(base[:len(base):len(base)],
			semconv.MessagingOperationNameKey.String("process"),
			semconv.MessagingOperationTypeProcess),
	}
	for o := amqpsub.OutcomeAccepted; o <= amqpsub.OutcomeRejected; o++ {
		op := settleOp(c.system, o)
		attrs := append(base[:len(base):len(base)],
			semconv.MessagingOperationNameKey.String(op),
			semconv.MessagingOperationTypeSettle,
			OutcomeKey.String(o.String()))
		if ds := dispositionStatus(op); ds != "" && c.system == "servicebus" {
			attrs = append(attrs, semconv.MessagingServiceBusDispositionStatusKey.String(ds))
		}
		t.settle[o] = settleSpan{name: op + " " + queue, attrs: attrs}
	}
	t.copied = settleSpan{name: OperationDeadLetterCopy + " " + queue, attrs: append(base[:len(base):len(base)],
		semconv.MessagingOperationNameKey.String(OperationDeadLetterCopy),
		semconv.MessagingOperationTypeSettle,
		OutcomeKey.String(amqpsub.OutcomeAccepted.String()))}
	return t
}

// Handler returns a Handler that runs h in a span named "process <queue>"
// of kind CONSUMER, and records a settle span for the delivery's
// settlement.
//
// A handler does not see its subscriber's profile: on any broker but
// Artemis, pass WithSystem ("servicebus", "rabbitmq", "amqp"), or the spans
// say "activemq" and name Service Bus settlements in AMQP terms.
//
// The producer's trace context is read from the delivery's application
// properties with the propagator (WithPropagator; W3C "traceparent" and
// "tracestate" by default), or, when there is no "traceparent", from
// "Diagnostic-Id" (DiagnosticIDProperty). The process span is a child of
// the span active in the handler's context, if any, else of the
// producer's context; either way it carries a link to the producer's
// context. Its attributes: messaging.system (WithSystem),
// messaging.destination.name (queue), messaging.operation.name and
// messaging.operation.type "process", messaging.message.id,
// messaging.message.conversation_id (the correlation-id, when set),
// amqpsub.delivery_count and amqpsub.lane; when h returns, amqpsub.result
// (amqpsub.ResultOf of its error). A Retry or Reject sets the span's
// status to Error, error.type to "retry" or "reject", and records the
// error; a panic does the same with error.type "panic", and is then
// panicked again for the subscriber to recover.
//
// The settle span is a child of the process span, of kind CLIENT,
// named "<operation> <queue>", with messaging.operation.type "settle",
// messaging.operation.name the settlement's (accept, release, modify,
// reject; on "servicebus" complete, abandon, dead_letter and release) and
// amqpsub.outcome the outcome on the wire (accepted, released, modified,
// rejected). It starts when h returns and ends when the subscriber has
// applied the settlement, with status Error and error.type when the broker
// did not take it ("not_settled" when it was not sent, the link or lock
// being lost). With amqpsub.DeadLetterCopy, a rejection whose copy the
// broker took settles as accepted: its settle span is named
// "dead_letter_copy <queue>" (OperationDeadLetterCopy), with
// messaging.operation.name "dead_letter_copy", amqpsub.outcome "accepted"
// and amqpsub.dead_letter.address the address the copy went to
// (DeadLetterAddressKey); a rejection whose copy the broker refused is a
// "reject <queue>" span with amqpsub.dead_letter.address and the copy's
// error recorded as an exception event (its status is not Error: the
// rejection was taken). It is recorded through Delivery.OnSettled, on the
// subscriber's receiving goroutine, when the settlement is applied:
// a delivery whose settlement never is (the subscriber stopped before, or
// abandoned the handler) has no settle span, nor has one whose process
// span is not recorded (sampled out), and a handler that calls OnSettled
// itself replaces the function that records it.
//
// Handler panics, with an error wrapping ErrInvalidOption, when h is nil,
// queue is "" or an option is invalid.
func Handler(queue string, h amqpsub.Handler, opts ...Option) amqpsub.Handler {
	if h == nil {
		panic(fmt.Errorf("%w: nil Handler", ErrInvalidOption))
	}
	return &handler{t: newTracing(queue, opts), h: h}
}

type handler struct {
	t *tracing
	h amqpsub.Handler
}

func (th *handler) Handle(ctx context.Context, d *amqpsub.Delivery) (err error) {
	t := th.t
	parent, producer := t.extract(ctx, d)
	opts := []trace.SpanStartOption{
		trace.WithSpanKind(trace.SpanKindConsumer),
		trace.WithAttributes(t.process...),
		trace.WithAttributes(deliveryAttrs(d)...),
	}
	if producer.IsValid() {
		opts = append(opts, trace.WithLinks(trace.Link{SpanContext: producer}))
	}
	ctx, span := t.tracer.Start(parent, t.processName, opts...)
	w := t.watch(span, d)
	defer func() {
		if p := recover(); p != nil {
			w.handlerReturned(time.Now())
			endPanicked(span, p)
			panic(p)
		}
	}()
	err = th.h.Handle(ctx, d)
	w.handlerReturned(time.Now())
	endProcess(span, amqpsub.ResultOf(err), err, true)
	return err
}

// BatchHandler returns a BatchHandler that runs h in a span named
// "process <queue>" of kind CONSUMER, a child of the span active in the
// handler's context if any (else a root), with a link to each delivery's
// producer context that is valid, and messaging.batch.message_count; the
// other attributes are Handler's but for the message's own (id,
// correlation-id, delivery count), which belong to the links' messages.
// amqpsub.result is the batch's most severe result (retry, then reject,
// release, accept), and each delivery that failed has its error recorded
// as an event with its messaging.message.id. Each delivery gets a settle
// span as with Handler, a child of the batch's process span.
//
// BatchHandler panics, with an error wrapping ErrInvalidOption, when h is
// nil, queue is "" or an option is invalid.
func BatchHandler(queue string, h amqpsub.BatchHandler, opts ...Option) amqpsub.BatchHandler {
	if h == nil {
		panic(fmt.Errorf("%w: nil BatchHandler", ErrInvalidOption))
	}
	return &batchHandler{t: newTracing(queue, opts), h: h}
}

type batchHandler struct {
	t *tracing
	h amqpsub.BatchHandler
}

func (bh *batchHandler) HandleBatch(ctx context.Context, batch []*amqpsub.Delivery) (results []error) {
	t := bh.t
	links := make([]trace.Link, 0, len(batch))
	for _, d := range batch {
		if sc := t.producer(d); sc.IsValid() {
			links = append(links, trace.Link{SpanContext: sc})
		}
	}
	attrs := []attribute.KeyValue{semconv.MessagingBatchMessageCountKey.Int(len(batch))}
	if len(batch) > 0 {
		attrs = append(attrs, LaneKey.Int(batch[0].Lane()))
	}
	ctx, span := t.tracer.Start(ctx, t.processName,
		trace.WithSpanKind(trace.SpanKindConsumer),
		trace.WithAttributes(t.process...),
		trace.WithAttributes(attrs...),
		trace.WithLinks(links...))
	ws := make([]*watch, len(batch))
	for i, d := range batch {
		ws[i] = t.watch(span, d)
	}
	returned := func() {
		now := time.Now()
		for _, w := range ws {
			w.handlerReturned(now)
		}
	}
	defer func() {
		if p := recover(); p != nil {
			returned()
			endPanicked(span, p)
			panic(p)
		}
	}()
	results = bh.h.HandleBatch(ctx, batch)
	returned()
	worst := amqpsub.ResultAccept
	var first error
	record := false
	switch {
	case results == nil:
	case len(results) != len(batch):
		// The subscriber retries the whole batch.
		worst = amqpsub.ResultRetry
		first = fmt.Errorf("amqpotel: the BatchHandler returned %d results for %d deliveries", len(results), len(batch))
		record = true
	default:
		for i, err := range results {
			r := amqpsub.ResultOf(err)
			if processErrorType(r, false) != "" {
				if first == nil {
					first = err
				}
				span.RecordError(err, trace.WithAttributes(
					semconv.MessagingMessageIDKey.String(idString(batch[i].MessageID())), ResultKey.String(r.String())))
			}
			worst = mostSevere(worst, r)
		}
	}
	endProcess(span, worst, first, record)
	return results
}

// mostSevere orders results as amqpsub.HandlerCall.Result does.
func mostSevere(a, b amqpsub.Result) amqpsub.Result {
	rank := [...]int{amqpsub.ResultAccept: 0, amqpsub.ResultRelease: 1, amqpsub.ResultReject: 2, amqpsub.ResultRetry: 3}
	if int(b) < len(rank) && int(a) < len(rank) && rank[b] > rank[a] {
		return b
	}
	return a
}

// endProcess records a process span's result and ends it, with err as
// the error of a failure; record says to record it as an event too (a
// batch's are recorded delivery by delivery).
func endProcess(span trace.Span, r amqpsub.Result, err error, record bool) {
	span.SetAttributes(ResultKey.String(r.String()))
	if et := processErrorType(r, false); et != "" {
		span.SetAttributes(semconv.ErrorTypeKey.String(et))
		msg := r.String()
		if err != nil {
			msg = err.Error()
			if record {
				span.RecordError(err)
			}
		}
		span.SetStatus(codes.Error, msg)
	}
	span.End()
}

// endPanicked records a handler's panic on its process span and ends it.
func endPanicked(span trace.Span, p any) {
	err := fmt.Errorf("handler panicked: %v", p)
	span.SetAttributes(ResultKey.String(amqpsub.ResultRetry.String()), semconv.ErrorTypeKey.String(ErrorTypePanic))
	span.RecordError(err, trace.WithStackTrace(true))
	span.SetStatus(codes.Error, err.Error())
	span.End()
}

// extract returns the context to start d's process span in and the
// producer's span context (invalid when d carries none). The parent is
// the span active in ctx when there is one, else the producer's context;
// whatever else the propagator extracts (baggage) is kept either way.
func (t *tracing) extract(ctx context.Context, d *amqpsub.Delivery) (context.Context, trace.SpanContext) {
	props := d.ApplicationProperties()
	if len(props) == 0 {
		return ctx, trace.SpanContext{}
	}
	parent := t.prop.Extract(ctx, carrier(props))
	active := trace.SpanContextFromContext(ctx)
	producer := trace.SpanContextFromContext(parent)
	if producer.Equal(active) {
		producer = trace.SpanContext{} // nothing extracted
	}
	if active.IsValid() {
		parent = trace.ContextWithSpan(parent, trace.SpanFromContext(ctx))
	}
	return parent, producer
}

// producer returns d's producer span context, invalid when it carries none.
func (t *tracing) producer(d *amqpsub.Delivery) trace.SpanContext {
	props := d.ApplicationProperties()
	if len(props) == 0 {
		return trace.SpanContext{}
	}
	return trace.SpanContextFromContext(t.prop.Extract(context.Background(), carrier(props)))
}

// carrier reads a propagator's fields from application properties: string
// values only, "traceparent" falling back to Diagnostic-Id. It is read
// only: the properties belong to the message.
type carrier map[string]any

func (c carrier) Get(key string) string {
	if s, ok := c[key].(string); ok {
		return s
	}
	if key == "traceparent" {
		if s, ok := c[DiagnosticIDProperty].(string); ok {
			return s
		}
	}
	return ""
}

func (c carrier) Set(string, string) {}

func (c carrier) Keys() []string {
	keys := make([]string, 0, len(c))
	for k, v := range c {
		if _, ok := v.(string); ok {
			keys = append(keys, k)
		}
	}
	return keys
}

// deliveryAttrs are the process span's attributes of d's message.
func deliveryAttrs(d *amqpsub.Delivery) []attribute.KeyValue {
	attrs := make([]attribute.KeyValue, 0, 4)
	if id := d.MessageID(); id != nil {
		attrs = append(attrs, semconv.MessagingMessageIDKey.String(idString(id)))
	}
	if p := d.Message().Properties; p != nil && p.CorrelationID != nil {
		attrs = append(attrs, semconv.MessagingMessageConversationIDKey.String(idString(p.CorrelationID)))
	}
	return append(attrs, DeliveryCountKey.Int64(int64(d.DeliveryCount())), LaneKey.Int(d.Lane()))
}

// idString formats a message-id or correlation-id: a string as it is, a
// ulong in decimal, a UUID in its canonical form, binary in hex.
func idString(id any) string {
	switch v := id.(type) {
	case string:
		return v
	case uint64:
		return strconv.FormatUint(v, 10)
	case amqp.UUID:
		return v.String()
	case []byte:
		return hex.EncodeToString(v)
	case nil:
		return ""
	}
	return fmt.Sprint(id)
}

// watch records a delivery's settle span: it is made in the function
// given to OnSettled, starting when the handler returned.
type watch struct {
	t        *tracing
	d        *amqpsub.Delivery
	parent   context.Context // holds the process span only
	id       attribute.KeyValue
	returned atomic.Int64 // UnixNano when the handler returned; 0 before
}

// watch asks d's settlement to be reported, before the handler runs, so
// that a handler calling OnSettled itself wins over the span. It returns
// nil, asking for nothing, when the process span is not recorded (sampled
// out, or no SDK installed): its settle span would not be either, and the
// delivery path is then spared the closure.
func (t *tracing) watch(process trace.Span, d *amqpsub.Delivery) *watch {
	if !process.IsRecording() {
		return nil
	}
	w := &watch{t: t, d: d, parent: trace.ContextWithSpan(context.Background(), process)}
	if id := d.MessageID(); id != nil {
		w.id = semconv.MessagingMessageIDKey.String(idString(id))
	}
	d.OnSettled(w.settled)
	return w
}

// handlerReturned notes when the handler returned: the settle span's
// start. w may be nil.
func (w *watch) handlerReturned(at time.Time) {
	if w != nil {
		w.returned.Store(at.UnixNano())
	}
}

// settled runs on the subscriber's receiving goroutine once the
// settlement was applied: it records the settle span from the handler's
// return to now.
func (w *watch) settled(o amqpsub.Outcome, err error) {
	if int(o) >= len(w.t.settle) {
		return
	}
	s := &w.t.settle[o]
	dlAddr, dlErr := w.d.DeadLetterCopied()
	if dlAddr != "" && dlErr == nil && o == amqpsub.OutcomeAccepted {
		s = &w.t.copied
	}
	start := time.Now()
	if n := w.returned.Load(); n != 0 {
		start = time.Unix(0, n)
	}
	opts := []trace.SpanStartOption{
		trace.WithSpanKind(trace.SpanKindClient),
		trace.WithTimestamp(start),
		trace.WithAttributes(s.attrs...),
	}
	if w.id.Valid() {
		opts = append(opts, trace.WithAttributes(w.id))
	}
	if dlAddr != "" {
		opts = append(opts, trace.WithAttributes(DeadLetterAddressKey.String(dlAddr)))
	}
	_, span := w.t.tracer.Start(w.parent, s.name, opts...)
	if dlErr != nil {
		span.RecordError(dlErr, trace.WithAttributes(EventKey.String(amqpsub.EventDeadLetterCopyFailed.String())))
	}
	if err != nil {
		span.SetAttributes(semconv.ErrorTypeKey.String(settleErrorType(err)))
		span.RecordError(err)
		span.SetStatus(codes.Error, err.Error())
	}
	span.End()
}
