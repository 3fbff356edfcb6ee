package amqpotel

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"weak"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"

	"github.com/amqpsub/amqpsub/amqpsub"
)

// ScopeName is the instrumentation scope of the meter and the tracer this
// package uses.
const ScopeName = "github.com/amqpsub/amqpsub/contrib/amqpotel"

// The instruments' names.
const (
	// ConsumedMessagesName counts deliveries received (the conventions'
	// messaging.client.consumed.messages, operation "receive").
	ConsumedMessagesName = "messaging.client.consumed.messages"
	// ProcessDurationName is how long handler calls took, in seconds (the
	// conventions' messaging.process.duration, operation "process").
	ProcessDurationName = "messaging.process.duration"
	// SettlementsName counts settlements by outcome.
	SettlementsName = "amqpsub.settlements"
	// BatchSizeName is the size of BatchHandler calls.
	BatchSizeName = "amqpsub.batch.size"
	// EventsName counts amqpsub.Events by kind.
	EventsName = "amqpsub.events"
	// DeadLetterCopiesName counts rejected deliveries that
	// amqpsub.DeadLetterCopy copied, with their reason, to the dead-letter
	// address; they are settled, and counted in SettlementsName, as
	// accepted.
	DeadLetterCopiesName = "amqpsub.dead_letter.copies"
	// DeadLetterCopyFailuresName counts the copies the broker did not
	// take; those deliveries were rejected without their reason (or, their
	// link lost with the copy, not settled at all, and delivered again).
	DeadLetterCopyFailuresName = "amqpsub.dead_letter.copy_failures"
	// LocksRenewedName counts Service Bus message locks renewed.
	LocksRenewedName = "amqpsub.locks.renewed"
	// DroppedName counts deliveries freed unsettled before a handler saw
	// them (their link or lock was lost); the broker delivers them again.
	DroppedName = "amqpsub.deliveries.dropped"
	// HeldName is the deliveries held in the process now.
	HeldName = "amqpsub.messages.held"
	// CreditName is the subscriber's credit now: the most it lets the
	// broker send ahead and holds at once (adaptive, within
	// CreditLimitName, unless amqpsub.FixedCredit).
	CreditName = "amqpsub.credit" //nolint:gosec // G101 reads "cred" in a metric name, which is no credential
	// CreditLimitName is the credit's bound: the amqpsub.Credit option.
	CreditLimitName = "amqpsub.credit.limit" //nolint:gosec // as CreditName
	// LaneLoadName is each lane's load now (deliveries waiting for it and
	// in its handler).
	LaneLoadName = "amqpsub.lane.load"
	// GroupsHeldName is the groups with deliveries in the lanes now
	// (BalanceKeys).
	GroupsHeldName = "amqpsub.groups.held"
	// ParkedName is the held deliveries that wait behind an earlier
	// delivery of their own group, or behind a handler call that has run
	// for over four times the mean (amqpsub.Stats.Parked): a hot, slow or
	// stuck group shows here.
	ParkedName = "amqpsub.messages.parked"
	// BytesHeldName is the size of the bodies held now.
	BytesHeldName = "amqpsub.bytes.held"
	// LocksHeldName is the Service Bus message locks kept now.
	LocksHeldName = "amqpsub.locks.held"
)

// processBuckets are the bucket boundaries the messaging conventions
// recommend for messaging.process.duration, in seconds.
var processBuckets = []float64{0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10}

// batchBuckets cover Batch sizes from 1 to past the default credit.
var batchBuckets = []float64{1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024}

// Metrics is an amqpsub.Metrics that records what subscribers do on
// OpenTelemetry instruments (see the package documentation for their names
// and attributes). Give it to any number of subscribers with
// amqpsub.WithMetrics; it is safe for concurrent use.
type Metrics struct {
	consumed     metric.Int64Counter
	process      metric.Float64Histogram
	settlements  metric.Int64Counter
	batchSize    metric.Int64Histogram
	events       metric.Int64Counter
	locksRenewed metric.Int64Counter
	dropped      metric.Int64Counter
	dlCopies     metric.Int64Counter
	dlFailures   metric.Int64Counter

	stats    []statGauge // the gauges of amqpsub.StatFields
	laneLoad metric.Int64ObservableUpDownCounter
	reg      metric.Registration

	mu sync.Mutex
	// recs are the recorders made, weakly: a subscriber that is garbage
	// collected drops out of the gauges without being told to.
	recs []weak.Pointer[recorder]
}

var _ amqpsub.Metrics = (*Metrics)(nil)

// NewMetrics creates the instruments with the meter provider given
// (WithMeterProvider) and registers the callback that reads the gauges.
// Options that do not apply to it are ignored. It returns an error wrapping
// ErrInvalidOption for an invalid option, or the meter's error.
func NewMetrics(opts ...Option) (*Metrics, error) {
	c, err := newConfig(opts)
	if err != nil {
		return nil, err
	}
	meter := c.meters.Meter(ScopeName, metric.WithSchemaURL(semconv.SchemaURL))
	m := &Metrics{}
	var errs []error
	add := func(err error) { errs = append(errs, err) }
	m.consumed, err = meter.Int64Counter(ConsumedMessagesName, metric.WithUnit("{message}"),
		metric.WithDescription("Number of messages that were delivered to the application."))
	add(err)
	m.process, err = meter.Float64Histogram(ProcessDurationName, metric.WithUnit("s"),
		metric.WithDescription("Duration of processing operation."),
		metric.WithExplicitBucketBoundaries(processBuckets...))
	add(err)
	m.settlements, err = meter.Int64Counter(SettlementsName, metric.WithUnit("{settlement}"),
		metric.WithDescription("Settlements applied, by outcome; error.type is set on those the broker did not take."))
	add(err)
	m.batchSize, err = meter.Int64Histogram(BatchSizeName, metric.WithUnit("{message}"),
		metric.WithDescription("Deliveries per BatchHandler call."),
		metric.WithExplicitBucketBoundaries(batchBuckets...))
	add(err)
	m.events, err = meter.Int64Counter(EventsName, metric.WithUnit("{event}"),
		metric.WithDescription("Subscriber events (links lost, reconnects, credit overshoot, locks lost...), by kind."))
	add(err)
	m.locksRenewed, err = meter.Int64Counter(LocksRenewedName, metric.WithUnit("{lock}"),
		metric.WithDescription("Service Bus message locks renewed."))
	add(err)
	m.dropped, err = meter.Int64Counter(DroppedName, metric.WithUnit("{message}"),
		metric.WithDescription("Deliveries freed unsettled before a handler saw them (their link or lock was lost); the broker delivers them again."))
	add(err)
	m.dlCopies, err = meter.Int64Counter(DeadLetterCopiesName, metric.WithUnit("{message}"),
		metric.WithDescription("Rejected deliveries copied with their reason to the dead-letter address (amqpsub.DeadLetterCopy); they are settled as accepted."))
	add(err)
	m.dlFailures, err = meter.Int64Counter(DeadLetterCopyFailuresName, metric.WithUnit("{message}"),
		metric.WithDescription("Dead-letter copies the broker did not take; those deliveries were rejected without their reason."))
	add(err)
	m.laneLoad, err = meter.Int64ObservableUpDownCounter(LaneLoadName, metric.WithUnit("{message}"),
		metric.WithDescription("Deliveries waiting for a lane and in its handler now."))
	add(err)
	observed := []metric.Observable{m.laneLoad}
	for _, f := range amqpsub.StatFields() {
		if f.Kind == amqpsub.StatCounter {
			continue
		}
		g := statGauge{f: f}
		unit, desc := metric.WithUnit(f.Unit), metric.WithDescription(f.Help)
		if f.Kind == amqpsub.StatMaxGauge { // a value that does not add up across attributes
			g.inst, err = meter.Int64ObservableGauge(InstrumentName(f), unit, desc)
		} else {
			g.inst, err = meter.Int64ObservableUpDownCounter(InstrumentName(f), unit, desc)
		}
		add(err)
		m.stats = append(m.stats, g)
		observed = append(observed, g.inst)
	}
	if err := errors.Join(errs...); err != nil {
		return nil, fmt.Errorf("amqpotel: creating instruments: %w", err)
	}
	m.reg, err = meter.RegisterCallback(m.observe, observed...)
	if err != nil {
		return nil, fmt.Errorf("amqpotel: registering the gauges' callback: %w", err)
	}
	return m, nil
}

// statGauge is a row of amqpsub.StatFields as an instrument.
type statGauge struct {
	f    amqpsub.StatField
	inst metric.Int64Observable
}

// legacyNames are the instrument names of the rows that had one before
// amqpsub.StatFields named them; they keep them.
var legacyNames = map[string]string{
	"held":         HeldName,
	"credit":       CreditName,
	"credit_limit": CreditLimitName,
	"groups_held":  GroupsHeldName,
	"parked":       ParkedName,
	"bytes_held":   BytesHeldName,
	"locks_held":   LocksHeldName,
}

// InstrumentName returns the name of the instrument NewMetrics makes of a
// row of amqpsub.StatFields that is no counter: "amqpsub." and the row's
// name, or the constant above of a row that had an instrument before the
// table (HeldName for "held", ParkedName for "parked"...).
func InstrumentName(f amqpsub.StatField) string {
	if n, ok := legacyNames[f.Name]; ok {
		return n
	}
	return "amqpsub." + f.Name
}

// Close unregisters the callback that reads the gauges, so that the meter
// provider drops its reference to m; the recorders' other instruments keep
// working. Call it when m is no longer used and the provider lives on.
// It is idempotent.
func (m *Metrics) Close() error {
	m.mu.Lock()
	reg := m.reg
	m.reg = nil
	m.recs = nil
	m.mu.Unlock()
	if reg == nil {
		return nil
	}
	return reg.Unregister()
}

// Recorder returns the recorder of one subscriber, with every attribute set
// it records with made here, so that its methods look nothing up. The
// subscriber's gauges are read (info.Stats) until it is garbage collected
// or m is closed; an info without Stats has no gauges.
func (m *Metrics) Recorder(info amqpsub.MetricsInfo) amqpsub.Recorder {
	r := newRecorder(m, info)
	m.mu.Lock()
	if m.reg != nil && info.Stats != nil {
		m.recs = append(m.recs, weak.Make(r))
	}
	m.mu.Unlock()
	return r
}

// bg is the context measurements are made in: a Recorder's methods are not
// given one, and no exemplar or baggage belongs to them.
var bg = context.Background()

// panicked indexes recorder.process after the four Results.
const panicked = 4

// recorder is one subscriber's amqpsub.Recorder. Its option slices are
// built once and passed with ..., which makes no copy: a call allocates
// nothing of its own.
type recorder struct {
	m      *Metrics
	system string
	stats  func() amqpsub.Stats
	done   <-chan struct{} // closed when the subscriber's Run returned
	base   attribute.Set
	lanes  []attribute.Set // base and amqpsub.lane, for the gauges

	received   []metric.AddOption
	process    [panicked + 1][]metric.RecordOption // by Result; panicked
	batch      []metric.RecordOption               // nil for a Handler
	settled    [4][]metric.AddOption               // by Outcome, taken
	notSettled [4][]metric.AddOption               // by Outcome, ErrNotSettled
	events     [][]metric.AddOption                // by EventKind, the kinds known
	plain      []metric.AddOption                  // base

	mu     sync.Mutex
	failed map[failKey][]metric.AddOption // other settlement errors, made when first seen
}

type failKey struct {
	o       amqpsub.Outcome
	errType string
}

func newRecorder(m *Metrics, info amqpsub.MetricsInfo) *recorder {
	base := []attribute.KeyValue{
		semconv.MessagingSystemKey.String(info.System),
		semconv.MessagingDestinationNameKey.String(info.Queue),
	}
	set := func(kv ...attribute.KeyValue) attribute.Set {
		return attribute.NewSet(append(append([]attribute.KeyValue{}, base...), kv...)...)
	}
	add := func(kv ...attribute.KeyValue) []metric.AddOption {
		return []metric.AddOption{metric.WithAttributeSet(set(kv...))}
	}
	rec := func(kv ...attribute.KeyValue) []metric.RecordOption {
		return []metric.RecordOption{metric.WithAttributeSet(set(kv...))}
	}
	r := &recorder{m: m, system: info.System, stats: info.Stats, done: info.Done, base: set()}
	r.plain = add()
	r.received = add(semconv.MessagingOperationNameKey.String("receive"))
	process := semconv.MessagingOperationNameKey.String("process")
	for res := amqpsub.ResultAccept; res <= amqpsub.ResultRetry; res++ {
		kv := []attribute.KeyValue{process, ResultKey.String(res.String())}
		if et := processErrorType(res, false); et != "" {
			kv = append(kv, semconv.ErrorTypeKey.String(et))
		}
		r.process[res] = rec(kv...)
	}
	r.process[panicked] = rec(process, ResultKey.String(amqpsub.ResultRetry.String()),
		semconv.ErrorTypeKey.String(ErrorTypePanic))
	if info.Batch {
		r.batch = rec(process)
	}
	for o := amqpsub.OutcomeAccepted; o <= amqpsub.OutcomeRejected; o++ {
		r.settled[o] = add(settleAttrs(info.System, o, "")...)
		r.notSettled[o] = add(settleAttrs(info.System, o, ErrorTypeNotSettled)...)
	}
	r.events = append(r.events, nil) // no kind 0
	for k := amqpsub.EventKind(1); k != 0 && !unknownKind(k); k++ {
		r.events = append(r.events, add(EventKey.String(k.String())))
	}
	for i := range info.Lanes {
		r.lanes = append(r.lanes, set(LaneKey.Int(i)))
	}
	return r
}

// unknownKind reports a kind that EventKind.String does not name, so that
// the recorder prepares sets for every kind amqpsub has, however many.
func unknownKind(k amqpsub.EventKind) bool { return strings.HasPrefix(k.String(), "EventKind(") }

func settleAttrs(system string, o amqpsub.Outcome, errType string) []attribute.KeyValue {
	kv := []attribute.KeyValue{
		semconv.MessagingOperationNameKey.String(settleOp(system, o)),
		OutcomeKey.String(o.String()),
	}
	if errType != "" {
		kv = append(kv, semconv.ErrorTypeKey.String(errType))
	}
	return kv
}

func (r *recorder) Received() { r.m.consumed.Add(bg, 1, r.received...) }

func (r *recorder) Handled(c amqpsub.HandlerCall) {
	i := int(c.Result)
	if c.Panicked {
		i = panicked
	}
	if i < len(r.process) {
		r.m.process.Record(bg, c.Took.Seconds(), r.process[i]...)
	}
	if r.batch != nil {
		r.m.batchSize.Record(bg, int64(c.Deliveries), r.batch...)
	}
}

func (r *recorder) Settled(o amqpsub.Outcome, err error) {
	if int(o) >= len(r.settled) {
		return
	}
	switch {
	case err == nil:
		r.m.settlements.Add(bg, 1, r.settled[o]...)
	case errors.Is(err, amqpsub.ErrNotSettled):
		r.m.settlements.Add(bg, 1, r.notSettled[o]...)
	default:
		r.m.settlements.Add(bg, 1, r.failedOpts(o, settleErrorType(err))...)
	}
}

// failedOpts returns the options of a settlement that failed with an error
// of type errType, made the first time it is seen. The broker refusing a
// settlement is rare, and error.type has few values.
func (r *recorder) failedOpts(o amqpsub.Outcome, errType string) []metric.AddOption {
	k := failKey{o, errType}
	r.mu.Lock()
	defer r.mu.Unlock()
	opts, ok := r.failed[k]
	if !ok {
		if r.failed == nil {
			r.failed = map[failKey][]metric.AddOption{}
		}
		set := attribute.NewSet(append(r.base.ToSlice(), settleAttrs(r.system, o, errType)...)...)
		opts = []metric.AddOption{metric.WithAttributeSet(set)}
		r.failed[k] = opts
	}
	return opts
}

func (r *recorder) Event(e amqpsub.Event) {
	switch e.Kind {
	case amqpsub.EventDeadLetterCopied:
		r.m.dlCopies.Add(bg, 1, r.plain...)
	case amqpsub.EventDeadLetterCopyFailed:
		r.m.dlFailures.Add(bg, 1, r.plain...)
	}
	if int(e.Kind) < len(r.events) && e.Kind > 0 {
		r.m.events.Add(bg, 1, r.events[e.Kind]...)
		return
	}
	set := attribute.NewSet(append(r.base.ToSlice(), EventKey.String(e.Kind.String()))...)
	r.m.events.Add(bg, 1, metric.WithAttributeSet(set))
}

func (r *recorder) LocksRenewed(n int) { r.m.locksRenewed.Add(bg, int64(n), r.plain...) }

func (r *recorder) Dropped(n int) { r.m.dropped.Add(bg, int64(n), r.plain...) }

// ended reports whether the subscriber's Run has returned: its gauges are
// no longer read.
func (r *recorder) ended() bool {
	if r.done == nil {
		return false
	}
	select {
	case <-r.done:
		return true
	default:
		return false
	}
}

// gauges sums the gauges of the subscribers of one queue.
type gauges struct {
	base  attribute.Set
	lanes []attribute.Set
	stats []int64 // by Metrics.stats
	load  []int64
}

// observe reads every live subscriber's Stats, once each per collection,
// and reports the sums per queue: subscribers of one queue in one process
// (replicas, say) add up, as the instruments are additive.
func (m *Metrics) observe(_ context.Context, o metric.Observer) error {
	m.mu.Lock()
	live := make([]*recorder, 0, len(m.recs))
	kept := m.recs[:0]
	for _, w := range m.recs {
		if r := w.Value(); r != nil && !r.ended() {
			live = append(live, r)
			kept = append(kept, w)
		}
	}
	clear(m.recs[len(kept):])
	m.recs = kept
	m.mu.Unlock()

	sums := map[attribute.Distinct]*gauges{}
	var order []*gauges
	for _, r := range live {
		g := sums[r.base.Equivalent()]
		if g == nil {
			g = &gauges{base: r.base, stats: make([]int64, len(m.stats))}
			sums[r.base.Equivalent()] = g
			order = append(order, g)
		}
		st := r.stats()
		for i, sg := range m.stats {
			if v := sg.f.Value(st); sg.f.Kind == amqpsub.StatMaxGauge {
				g.stats[i] = max(g.stats[i], v)
			} else {
				g.stats[i] += v
			}
		}
		for i, l := range st.Lanes {
			if i == len(g.load) {
				g.load = append(g.load, 0)
				if i < len(r.lanes) {
					g.lanes = append(g.lanes, r.lanes[i])
				} else {
					g.lanes = append(g.lanes, attribute.NewSet(append(r.base.ToSlice(), LaneKey.Int(i))...))
				}
			}
			g.load[i] += int64(l.Load)
		}
	}
	for _, g := range order {
		at := metric.WithAttributeSet(g.base)
		for i, sg := range m.stats {
			o.ObserveInt64(sg.inst, g.stats[i], at)
		}
		for i, n := range g.load {
			o.ObserveInt64(m.laneLoad, n, metric.WithAttributeSet(g.lanes[i]))
		}
	}
	return nil
}
