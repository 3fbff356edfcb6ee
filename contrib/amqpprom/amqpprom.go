package amqpprom

import (
	"errors"
	"strconv"
	"strings"
	"sync"
	"weak"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/amqpsub/amqpsub/amqpsub"
)

// Metrics is an amqpsub.Metrics that records into Prometheus collectors.
// Create it with New; it may serve any number of Subscribers.
type Metrics struct {
	consumed *prometheus.CounterVec
	process  *prometheus.HistogramVec
	settled  *prometheus.CounterVec
	batch    *prometheus.HistogramVec
	events   *prometheus.CounterVec
	renewed  *prometheus.CounterVec
	dropped  *prometheus.CounterVec
	dlCopies *prometheus.CounterVec
	dlFailed *prometheus.CounterVec
	gauges   *gauges
}

// Option configures New.
type Option interface{ apply(*config) }

type optionFunc func(*config)

func (f optionFunc) apply(c *config) { f(c) }

type config struct {
	durationBuckets []float64
	batchBuckets    []float64
	constLabels     prometheus.Labels
}

// DurationBuckets sets the buckets, in seconds, of
// messaging_process_duration_seconds. Default: the OpenTelemetry messaging
// conventions' boundaries, 0.005 s to 10 s.
func DurationBuckets(b ...float64) Option {
	return optionFunc(func(c *config) { c.durationBuckets = b })
}

// BatchBuckets sets the buckets of amqpsub_batch_size. Default: 1, 2, 5,
// 10, 20, 50, 100, 200, 500, 1000.
func BatchBuckets(b ...float64) Option {
	return optionFunc(func(c *config) { c.batchBuckets = b })
}

// ConstLabels adds labels with fixed values to every series (for example
// the service's name). Default: none.
func ConstLabels(l prometheus.Labels) Option {
	return optionFunc(func(c *config) { c.constLabels = l })
}

// New returns Metrics whose collectors are registered on reg. It panics if
// they cannot be (a second New on the same registry with the same
// ConstLabels), as prometheus.MustRegister does: give every Subscriber of
// a process the same Metrics, whose gauges sum the Subscribers of one
// queue (replicas in one process); for a series per Subscriber instead,
// give each its own New with a ConstLabels that tells them apart.
func New(reg prometheus.Registerer, opts ...Option) *Metrics {
	cfg := config{
		durationBuckets: []float64{0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10},
		batchBuckets:    []float64{1, 2, 5, 10, 20, 50, 100, 200, 500, 1000},
	}
	for _, o := range opts {
		o.apply(&cfg)
	}
	base := []string{"messaging_system", "messaging_destination_name"}
	with := func(more ...string) []string { return append(append([]string(nil), base...), more...) }
	m := &Metrics{
		consumed: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "messaging_client_consumed_messages_total", ConstLabels: cfg.constLabels,
			Help: "Deliveries received from the broker.",
		}, with("messaging_operation_name")),
		process: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "messaging_process_duration_seconds", ConstLabels: cfg.constLabels,
			Help:    "Duration of handler calls, retries in the lane included.",
			Buckets: cfg.durationBuckets,
		}, with("messaging_operation_name", "result", "error_type")),
		settled: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "amqpsub_settlements_total", ConstLabels: cfg.constLabels,
			Help: "Settlements applied, by outcome; error_type is empty when the broker took it.",
		}, with("outcome", "error_type")),
		batch: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "amqpsub_batch_size", ConstLabels: cfg.constLabels,
			Help:    "Deliveries per BatchHandler call.",
			Buckets: cfg.batchBuckets,
		}, base),
		events: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "amqpsub_events_total", ConstLabels: cfg.constLabels,
			Help: "Subscriber events (amqpsub.EventKind), by kind.",
		}, with("kind")),
		renewed: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "amqpsub_locks_renewed_total", ConstLabels: cfg.constLabels,
			Help: "Service Bus message locks renewed.",
		}, base),
		dropped: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "amqpsub_dropped_total", ConstLabels: cfg.constLabels,
			Help: "Deliveries freed unsettled before a handler saw them (their link or lock was lost); the broker delivers them again.",
		}, base),
		dlCopies: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "amqpsub_dead_letter_copies_total", ConstLabels: cfg.constLabels,
			Help: "Rejected deliveries copied with their reason to the dead-letter address (amqpsub.DeadLetterCopy); they are settled as accepted.",
		}, base),
		dlFailed: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "amqpsub_dead_letter_copy_failures_total", ConstLabels: cfg.constLabels,
			Help: "Dead-letter copies the broker did not take (amqpsub.DeadLetterCopy); those deliveries were rejected without their reason (or, their link lost with the copy, not settled, and delivered again).",
		}, base),
		gauges: newGauges(cfg.constLabels),
	}
	reg.MustRegister(m.consumed, m.process, m.settled, m.batch, m.events, m.renewed, m.dropped, m.dlCopies, m.dlFailed, m.gauges)
	return m
}

// results and outcomes are the values the recorder resolves series for.
var (
	results  = []amqpsub.Result{amqpsub.ResultAccept, amqpsub.ResultRelease, amqpsub.ResultReject, amqpsub.ResultRetry}
	outcomes = []amqpsub.Outcome{amqpsub.OutcomeAccepted, amqpsub.OutcomeReleased, amqpsub.OutcomeModified, amqpsub.OutcomeRejected}
)

// maxEventKind bounds the EventKinds a recorder resolves series for; a
// kind past it is counted as "other".
const maxEventKind = 32

// Recorder implements amqpsub.Metrics: New of amqpsub calls it once per
// Subscriber, and every series that Subscriber reports on is resolved here.
func (m *Metrics) Recorder(info amqpsub.MetricsInfo) amqpsub.Recorder {
	sys, q := info.System, info.Queue
	r := &recorder{
		consumed: m.consumed.WithLabelValues(sys, q, "receive"),
		panicked: m.process.WithLabelValues(sys, q, "process", amqpsub.ResultRetry.String(), "panic"),
		renewed:  m.renewed.WithLabelValues(sys, q),
		dropped:  m.dropped.WithLabelValues(sys, q),
		dlCopies: m.dlCopies.WithLabelValues(sys, q),
		dlFailed: m.dlFailed.WithLabelValues(sys, q),
		other:    m.events.WithLabelValues(sys, q, "other"),
	}
	for _, res := range results {
		errType := ""
		if res == amqpsub.ResultReject || res == amqpsub.ResultRetry {
			errType = res.String()
		}
		r.process[res] = m.process.WithLabelValues(sys, q, "process", res.String(), errType)
	}
	for _, o := range outcomes {
		r.settled[o][taken] = m.settled.WithLabelValues(sys, q, o.String(), "")
		r.settled[o][notSent] = m.settled.WithLabelValues(sys, q, o.String(), "not_settled")
		r.settled[o][failed] = m.settled.WithLabelValues(sys, q, o.String(), "failed")
	}
	for k := range amqpsub.EventKind(maxEventKind) {
		if name := k.String(); k > 0 && name[0] != 'E' { // "EventKind(n)" for kinds that do not exist
			r.events[k] = m.events.WithLabelValues(sys, q, name)
		}
	}
	if info.Batch {
		r.batch = m.batch.WithLabelValues(sys, q)
	}
	if info.Stats != nil {
		r.sub = subscriber{system: sys, queue: q, stats: info.Stats, done: info.Done}
		m.gauges.add(r)
	}
	return r
}

const (
	taken = iota
	notSent
	failed
)

type recorder struct {
	consumed prometheus.Counter
	process  [4]prometheus.Observer
	panicked prometheus.Observer
	batch    prometheus.Observer // nil for a Handler
	settled  [4][3]prometheus.Counter
	events   [maxEventKind]prometheus.Counter
	other    prometheus.Counter
	renewed  prometheus.Counter
	dropped  prometheus.Counter
	dlCopies prometheus.Counter
	dlFailed prometheus.Counter
	sub      subscriber // what the gauges read
}

func (r *recorder) Received() { r.consumed.Inc() }

func (r *recorder) Handled(c amqpsub.HandlerCall) {
	o := r.panicked
	if !c.Panicked && int(c.Result) < len(r.process) {
		o = r.process[c.Result]
	}
	if o != nil {
		o.Observe(c.Took.Seconds())
	}
	if r.batch != nil {
		r.batch.Observe(float64(c.Deliveries))
	}
}

func (r *recorder) Settled(o amqpsub.Outcome, err error) {
	if int(o) >= len(r.settled) {
		return
	}
	i := taken
	switch {
	case errors.Is(err, amqpsub.ErrNotSettled):
		i = notSent
	case err != nil:
		i = failed
	}
	r.settled[o][i].Inc()
}

func (r *recorder) Event(e amqpsub.Event) {
	switch e.Kind {
	case amqpsub.EventDeadLetterCopied:
		r.dlCopies.Inc()
	case amqpsub.EventDeadLetterCopyFailed:
		r.dlFailed.Inc()
	}
	if int(e.Kind) < len(r.events) && r.events[e.Kind] != nil {
		r.events[e.Kind].Inc()
		return
	}
	r.other.Inc()
}

func (r *recorder) LocksRenewed(n int) { r.renewed.Add(float64(n)) }

func (r *recorder) Dropped(n int) { r.dropped.Add(float64(n)) }

// subscriber is what the gauges read at a scrape.
type subscriber struct {
	system, queue string
	stats         func() amqpsub.Stats
	done          <-chan struct{} // closed when its Run returned
}

func (s subscriber) ended() bool {
	if s.done == nil {
		return false
	}
	select {
	case <-s.done:
		return true
	default:
		return false
	}
}

// gauges is a collector that reads each Subscriber's Stats when scraped.
type gauges struct {
	stats []gauge // the gauges of amqpsub.StatFields
	lane  *prometheus.Desc

	mu sync.Mutex
	// recs are the recorders of the subscribers, held weakly: one that is
	// garbage collected (never run, say) drops out without being told to,
	// and one whose Run returned is forgotten at the next scrape.
	recs []weak.Pointer[recorder]
}

// gauge is a row of amqpsub.StatFields as a series.
type gauge struct {
	f     amqpsub.StatField
	desc  *prometheus.Desc
	scale float64 // from the row's unit to the series'
}

// legacyNames are the names the series of these rows had before
// amqpsub.StatFields named them; they keep them.
var legacyNames = map[string]string{
	"held":       "amqpsub_held_deliveries",
	"bytes_held": "amqpsub_held_bytes",
	"parked":     "amqpsub_parked_deliveries",
}

// seriesName returns the series name of a row, amqpsub_<name> with its
// unit's suffix (a legacy name aside), and the scale from the row's unit
// to the series' base unit; ok is false for a unit it does not know.
func seriesName(f amqpsub.StatField) (name string, scale float64, ok bool) {
	name, scale = "amqpsub_"+f.Name, 1
	switch {
	case f.Unit == "ns":
		name, scale = name+"_seconds", 1e-9
	case f.Unit == "By":
		if !strings.Contains(f.Name, "bytes") {
			name += "_bytes"
		}
	case !strings.HasPrefix(f.Unit, "{"): // a count of {things} has no suffix
		return "", 0, false
	}
	if n, ok := legacyNames[f.Name]; ok {
		name = n
	}
	return name, scale, true
}

// newGauges makes a gauge of every row of amqpsub.StatFields that is no
// counter (the counters are counted as they happen, by the recorder, which
// a Subscriber's end does not take back) and of a unit it knows.
func newGauges(constLabels prometheus.Labels) *gauges {
	base := []string{"messaging_system", "messaging_destination_name"}
	g := &gauges{
		lane: prometheus.NewDesc("amqpsub_lane_load", "Deliveries waiting for each lane and in its handler.",
			append(append([]string(nil), base...), "lane"), constLabels),
	}
	for _, f := range amqpsub.StatFields() {
		name, scale, ok := seriesName(f)
		if f.Kind == amqpsub.StatCounter || !ok {
			continue
		}
		g.stats = append(g.stats, gauge{f: f, desc: prometheus.NewDesc(name, f.Help, base, constLabels), scale: scale})
	}
	return g
}

func (g *gauges) add(r *recorder) {
	g.mu.Lock()
	g.recs = append(g.recs, weak.Make(r))
	g.mu.Unlock()
}

// Describe implements prometheus.Collector.
func (g *gauges) Describe(ch chan<- *prometheus.Desc) {
	for _, s := range g.stats {
		ch <- s.desc
	}
	ch <- g.lane
}

// Collect implements prometheus.Collector: one Stats call per Subscriber
// whose Run has not returned (those that have are forgotten), summed over
// the Subscribers of one queue and broker (replicas in one process), or
// the highest of them for a StatMaxGauge, so that each series is collected
// once.
func (g *gauges) Collect(ch chan<- prometheus.Metric) {
	g.mu.Lock()
	var subs []subscriber
	kept := g.recs[:0]
	for _, w := range g.recs {
		if r := w.Value(); r != nil && !r.sub.ended() {
			subs = append(subs, r.sub)
			kept = append(kept, w)
		}
	}
	clear(g.recs[len(kept):])
	g.recs = kept
	g.mu.Unlock()
	type key struct{ system, queue string }
	type sums struct {
		stats, lanes []float64
	}
	var order []key
	byKey := map[key]*sums{}
	for _, s := range subs {
		k := key{s.system, s.queue}
		t := byKey[k]
		if t == nil {
			t = &sums{stats: make([]float64, len(g.stats))}
			byKey[k] = t
			order = append(order, k)
		}
		st := s.stats()
		for i, gs := range g.stats {
			x := float64(gs.f.Value(st)) * gs.scale
			if gs.f.Kind == amqpsub.StatMaxGauge {
				t.stats[i] = max(t.stats[i], x)
			} else {
				t.stats[i] += x
			}
		}
		for i, l := range st.Lanes {
			if i == len(t.lanes) {
				t.lanes = append(t.lanes, 0)
			}
			t.lanes[i] += float64(l.Load)
		}
	}
	for _, k := range order {
		t := byKey[k]
		v := func(d *prometheus.Desc, x float64, more ...string) {
			ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, x, append([]string{k.system, k.queue}, more...)...)
		}
		for i, gs := range g.stats {
			v(gs.desc, t.stats[i])
		}
		for i, l := range t.lanes {
			v(g.lane, l, strconv.Itoa(i))
		}
	}
}
