package amqpotel_test

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"sync"
	"testing"
	"time"

	"github.com/Azure/go-amqp"
	"go.opentelemetry.io/otel/attribute"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"

	"github.com/amqpsub/amqpsub/amqpsub"
	"github.com/amqpsub/amqpsub/amqpsubtest"
	"github.com/amqpsub/amqpsub/contrib/amqpotel"
)

var (
	opKey     = attribute.Key("messaging.operation.name")
	errKey    = attribute.Key("error.type")
	systemKey = attribute.Key("messaging.system")
	destKey   = attribute.Key("messaging.destination.name")
	noError   = errKey.String("") // has: error.type absent
)

func newMetrics(t testing.TB) (*amqpotel.Metrics, *sdkmetric.ManualReader) {
	t.Helper()
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	t.Cleanup(func() { _ = mp.Shutdown(context.Background()) })
	m, err := amqpotel.NewMetrics(amqpotel.WithMeterProvider(mp))
	if err != nil {
		t.Fatal(err)
	}
	return m, reader
}

// The instruments count what was published and what became of it, as the
// subscriber's Stats do.
func TestMetricsCountWhatWasPublished(t *testing.T) {
	m, reader := newMetrics(t)
	q := amqpsubtest.NewQueue(amqpsubtest.MaxDeliveryAttempts(2))
	bodies := []string{"ok", "ok", "release-once", "reject", "retry", "panic-once", "ok"}
	for _, b := range bodies {
		q.Publish(amqpsubtest.Message("g-"+b, b))
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
		case "release-once":
			if n == 1 {
				return amqpsub.Release()
			}
		case "reject":
			return amqpsub.Reject("no")
		case "retry":
			return errors.New("down")
		case "panic-once":
			if n == 1 {
				panic("boom")
			}
		}
		return nil
	})
	sub, err := amqpsub.New(q.Connector(), "orders", h, amqpsub.WorkersByKey(3), amqpsub.WithMetrics(m))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
	defer cancel()
	if err := q.Drain(ctx, sub); err != nil {
		t.Fatal(err)
	}
	st := sub.Stats()
	c := collect(t, reader)
	base := []attribute.KeyValue{systemKey.String("activemq"), destKey.String("orders")}
	with := func(kv ...attribute.KeyValue) []attribute.KeyValue {
		return append(append([]attribute.KeyValue{}, base...), kv...)
	}

	// 7 messages; "release-once", "panic-once" and "retry" come twice.
	if got := c.sum(amqpotel.ConsumedMessagesName, with(opKey.String("receive"))...); got != 10 || uint64(got) != st.Received {
		t.Errorf("consumed = %d, Stats.Received = %d, want 10", got, st.Received)
	}
	for _, w := range []struct {
		result, errType string
		want            uint64
	}{
		{"accept", "", st.Results.Accept},
		{"release", "", st.Results.Release},
		{"reject", "reject", st.Results.Reject},
		{"retry", "retry", st.Results.Retry - st.Results.Panics},
		{"retry", "panic", st.Results.Panics},
	} {
		got := c.count(amqpotel.ProcessDurationName, with(opKey.String("process"),
			amqpotel.ResultKey.String(w.result), errKey.String(w.errType))...)
		if got != w.want || w.want == 0 {
			t.Errorf("process %s (error.type %q): %d calls, Stats %d\n%s", w.result, w.errType, got, w.want,
				c.attrSets(amqpotel.ProcessDurationName))
		}
	}
	for _, w := range []struct {
		outcome, op string
		want        uint64
	}{
		{"accepted", "accept", st.Settled.Accepted},
		{"released", "release", st.Settled.Released},
		{"modified", "modify", st.Settled.Modified},
		{"rejected", "reject", st.Settled.Rejected},
	} {
		got := c.sum(amqpotel.SettlementsName, with(amqpotel.OutcomeKey.String(w.outcome), opKey.String(w.op), noError)...)
		if uint64(got) != w.want || w.want == 0 {
			t.Errorf("settlements %s: %d, Stats %d\n%s", w.outcome, got, w.want, c.attrSets(amqpotel.SettlementsName))
		}
	}
	if got := c.sum(amqpotel.SettlementsName, errKey.String(amqpotel.ErrorTypeNotSettled)); got != 0 {
		t.Errorf("%d settlements not sent", got)
	}
	if got := c.sum(amqpotel.EventsName, with(amqpotel.EventKey.String("handler-panicked"))...); got != 1 {
		t.Errorf("handler-panicked events = %d\n%s", got, c.attrSets(amqpotel.EventsName))
	}
	if got := c.sum(amqpotel.EventsName, with(amqpotel.EventKey.String("handler-failed"))...); got != 3 {
		t.Errorf("handler-failed events = %d\n%s", got, c.attrSets(amqpotel.EventsName))
	}
	if _, ok := c[amqpotel.BatchSizeName]; ok {
		t.Errorf("a Handler's subscriber recorded batch sizes: %s", c.attrSets(amqpotel.BatchSizeName))
	}
	// Run has returned: the subscriber's gauges are no longer reported.
	for _, name := range []string{amqpotel.CreditName, amqpotel.HeldName, amqpotel.LaneLoadName} {
		if c.points(name, base...) != 0 {
			t.Errorf("%s still reported after Run returned:\n%s", name, c.attrSets(name))
		}
	}
}

// While a subscriber runs, the gauges read its Stats: nothing held once its
// queue is drained, the credit, a load per lane.
func TestMetricsGaugesWhileRunning(t *testing.T) {
	m, reader := newMetrics(t)
	q := amqpsubtest.NewQueue()
	q.Publish(amqpsubtest.Message("a", "x"), amqpsubtest.Message("b", "y"))
	sub, err := amqpsub.New(q.Connector(), "orders", amqpsub.HandlerFunc(func(context.Context, *amqpsub.Delivery) error { return nil }),
		amqpsub.WorkersByKey(3), amqpsub.WithMetrics(m))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(t.Context())
	errc := make(chan error, 1)
	go func() { errc <- sub.Run(ctx) }()
	if err := q.Wait(t.Context()); err != nil {
		t.Fatal(err)
	}
	for sub.Stats().Held != 0 { // the last settlement applied
		runtime.Gosched()
	}
	c := collect(t, reader)
	cancel()
	if err := <-errc; err != nil {
		t.Fatal(err)
	}
	base := []attribute.KeyValue{semconv.MessagingSystemKey.String("activemq"), semconv.MessagingDestinationNameKey.String("orders")}
	// The adaptive credit: at least the 3 lanes, within the limit.
	if got := c.sum(amqpotel.CreditName, base...); got < 3 || got > 256 {
		t.Errorf("credit = %d, want between 3 and 256", got)
	}
	if got := c.sum(amqpotel.CreditLimitName, base...); got != 256 {
		t.Errorf("credit limit = %d", got)
	}
	if got := c.sum(amqpotel.HeldName, base...); got != 0 {
		t.Errorf("held = %d after the drain", got)
	}
	for lane := range 3 {
		if c.points(amqpotel.LaneLoadName, amqpotel.LaneKey.Int(lane)) != 1 {
			t.Errorf("no load for lane %d:\n%s", lane, c.attrSets(amqpotel.LaneLoadName))
		}
	}
	for _, name := range []string{amqpotel.GroupsHeldName, amqpotel.ParkedName, amqpotel.BytesHeldName, amqpotel.LocksHeldName} {
		if c.points(name, base...) != 1 {
			t.Errorf("no %s", name)
		}
	}
}

// A batch subscriber records each call's size and its most severe result.
func TestMetricsBatch(t *testing.T) {
	m, reader := newMetrics(t)
	q := amqpsubtest.NewQueue()
	for range 10 {
		q.Publish(amqpsubtest.Message("", "x"))
	}
	first := true
	h := amqpsub.BatchHandlerFunc(func(_ context.Context, b []*amqpsub.Delivery) []error {
		res := make([]error, len(b))
		if first {
			first = false
			res[len(res)-1] = amqpsub.Reject("last")
		}
		return res
	})
	sub, err := amqpsub.NewBatch(q.Connector(), "q", h, amqpsub.Batch(10, time.Hour), amqpsub.WithMetrics(m))
	if err != nil {
		t.Fatal(err)
	}
	if err := q.Drain(t.Context(), sub); err != nil {
		t.Fatal(err)
	}
	c := collect(t, reader)
	if got := c.count(amqpotel.BatchSizeName, opKey.String("process")); got != 1 {
		t.Errorf("%d batch sizes recorded:\n%s", got, c.attrSets(amqpotel.BatchSizeName))
	}
	if got := c.count(amqpotel.ProcessDurationName, amqpotel.ResultKey.String("reject"), errKey.String("reject")); got != 1 {
		t.Errorf("batch calls with result reject = %d:\n%s", got, c.attrSets(amqpotel.ProcessDurationName))
	}
	if got := c.sum(amqpotel.SettlementsName, amqpotel.OutcomeKey.String("accepted")); got != 9 {
		t.Errorf("accepted = %d", got)
	}
	if got := c.sum(amqpotel.SettlementsName, amqpotel.OutcomeKey.String("rejected")); got != 1 {
		t.Errorf("rejected = %d", got)
	}
}

// A settlement that was not sent, its link lost while the handler had the
// delivery, is counted with error.type not_settled; the link lost and the
// reconnect are counted as events.
func TestMetricsSettlementNotSent(t *testing.T) {
	m, reader := newMetrics(t)
	q := amqpsubtest.NewQueue()
	q.Publish(amqpsubtest.Message("", "x"))
	sub, inHandler := loseLinkInHandler(t, q, nil, amqpsub.WithMetrics(m))
	go func() {
		<-inHandler
		q.LoseLinks(nil)
	}()
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
	defer cancel()
	if err := q.Drain(ctx, sub); err != nil {
		t.Fatal(err)
	}
	c := collect(t, reader)
	if got := c.sum(amqpotel.SettlementsName, amqpotel.OutcomeKey.String("accepted"),
		opKey.String("accept"), errKey.String(amqpotel.ErrorTypeNotSettled)); got != 1 {
		t.Errorf("accepted but not sent = %d:\n%s", got, c.attrSets(amqpotel.SettlementsName))
	}
	if got := c.sum(amqpotel.SettlementsName, amqpotel.OutcomeKey.String("accepted"), noError); got != 1 {
		t.Errorf("accepted = %d:\n%s", got, c.attrSets(amqpotel.SettlementsName))
	}
	if got := c.sum(amqpotel.EventsName, amqpotel.EventKey.String("link-lost")); got != 1 {
		t.Errorf("link-lost = %d:\n%s", got, c.attrSets(amqpotel.EventsName))
	}
	if got := c.sum(amqpotel.EventsName, amqpotel.EventKey.String("reconnected")); got != 1 {
		t.Errorf("reconnected = %d:\n%s", got, c.attrSets(amqpotel.EventsName))
	}
}

// loseLinkInHandler returns a subscriber of q whose handler, the first
// time, closes inHandler and then waits until the subscriber has replaced
// its lost link (the caller makes the queue lose it), so that the
// delivery's settlement is not sent. wrap, if not nil, wraps the handler.
func loseLinkInHandler(t *testing.T, q *amqpsubtest.Queue, wrap func(amqpsub.Handler) amqpsub.Handler,
	opts ...amqpsub.Option) (sub *amqpsub.Subscriber, inHandler <-chan struct{}) {
	in := make(chan struct{})
	reconnected := make(chan struct{})
	var once, onceRe sync.Once
	var h amqpsub.Handler = amqpsub.HandlerFunc(func(context.Context, *amqpsub.Delivery) error {
		once.Do(func() {
			close(in)
			<-reconnected
		})
		return nil
	})
	if wrap != nil {
		h = wrap(h)
	}
	opts = append(opts, amqpsub.OnEvent(func(e amqpsub.Event) {
		if e.Kind == amqpsub.EventReconnected {
			onceRe.Do(func() { close(reconnected) })
		}
	}))
	sub, err := amqpsub.New(q.Connector(), "q", h, opts...)
	if err != nil {
		t.Fatal(err)
	}
	return sub, in
}

// fakeStats is a MetricsInfo.Stats that returns what the test sets.
type fakeStats struct {
	mu sync.Mutex
	st amqpsub.Stats
}

func (f *fakeStats) get() amqpsub.Stats { f.mu.Lock(); defer f.mu.Unlock(); return f.st }

func info(queue string, st func() amqpsub.Stats) amqpsub.MetricsInfo {
	return amqpsub.MetricsInfo{Queue: queue, System: "servicebus", Credit: 10, Lanes: 2, Batch: true, Stats: st}
}

// The recorder's every method, called directly: the attributes of each.
func TestRecorderAttributes(t *testing.T) {
	m, reader := newMetrics(t)
	fs := &fakeStats{st: amqpsub.Stats{Held: 3, Credit: 6, CreditLimit: 10, GroupsHeld: 2, Parked: 5, BytesHeld: 300, Locks: amqpsub.Locks{Held: 3},
		Lanes: []amqpsub.LaneStats{{Load: 1}, {Load: 2}}}}
	r := m.Recorder(info("sbq", fs.get))
	r.Received()
	r.Handled(amqpsub.HandlerCall{Deliveries: 4, Took: 20 * time.Millisecond, Result: amqpsub.ResultRelease})
	r.Settled(amqpsub.OutcomeAccepted, nil)
	r.Settled(amqpsub.OutcomeModified, nil)
	r.Settled(amqpsub.OutcomeRejected, nil)
	r.Settled(amqpsub.OutcomeReleased, nil)
	r.Settled(amqpsub.OutcomeAccepted, amqpsub.ErrNotSettled)
	r.Settled(amqpsub.OutcomeAccepted, fmt.Errorf("settling: %w", &amqp.Error{Condition: "com.microsoft:message-lock-lost"}))
	r.Settled(amqpsub.OutcomeAccepted, &amqp.Error{Condition: "com.microsoft:message-lock-lost"})
	r.Settled(amqpsub.OutcomeModified, &amqp.LinkError{})
	r.Settled(amqpsub.OutcomeModified, errors.New("what"))
	r.Event(amqpsub.Event{Kind: amqpsub.EventLockLost})
	r.Event(amqpsub.Event{Kind: amqpsub.EventKind(200)})
	r.LocksRenewed(5)
	r.LocksRenewed(2)

	c := collect(t, reader)
	sb := []attribute.KeyValue{systemKey.String("servicebus"), destKey.String("sbq")}
	for _, w := range []struct {
		name string
		kv   []attribute.KeyValue
		want int64
	}{
		{amqpotel.ConsumedMessagesName, []attribute.KeyValue{opKey.String("receive")}, 1},
		{amqpotel.SettlementsName, []attribute.KeyValue{opKey.String("complete"), amqpotel.OutcomeKey.String("accepted"), noError}, 1},
		{amqpotel.SettlementsName, []attribute.KeyValue{opKey.String("abandon"), amqpotel.OutcomeKey.String("modified"), noError}, 1},
		{amqpotel.SettlementsName, []attribute.KeyValue{opKey.String("dead_letter"), amqpotel.OutcomeKey.String("rejected"), noError}, 1},
		{amqpotel.SettlementsName, []attribute.KeyValue{opKey.String("release"), amqpotel.OutcomeKey.String("released"), noError}, 1},
		{amqpotel.SettlementsName, []attribute.KeyValue{opKey.String("complete"), errKey.String("not_settled")}, 1},
		{amqpotel.SettlementsName, []attribute.KeyValue{opKey.String("complete"), errKey.String("com.microsoft:message-lock-lost")}, 2},
		{amqpotel.SettlementsName, []attribute.KeyValue{opKey.String("abandon"), errKey.String("link_closed")}, 1},
		{amqpotel.SettlementsName, []attribute.KeyValue{opKey.String("abandon"), errKey.String("_OTHER")}, 1},
		{amqpotel.EventsName, []attribute.KeyValue{amqpotel.EventKey.String("lock-lost")}, 1},
		{amqpotel.EventsName, []attribute.KeyValue{amqpotel.EventKey.String("EventKind(200)")}, 1},
		{amqpotel.LocksRenewedName, nil, 7},
		{amqpotel.HeldName, nil, 3},
		{amqpotel.CreditName, nil, 6},
		{amqpotel.CreditLimitName, nil, 10},
		{amqpotel.GroupsHeldName, nil, 2},
		{amqpotel.ParkedName, nil, 5},
		{amqpotel.BytesHeldName, nil, 300},
		{amqpotel.LocksHeldName, nil, 3},
		{amqpotel.LaneLoadName, []attribute.KeyValue{amqpotel.LaneKey.Int(0)}, 1},
		{amqpotel.LaneLoadName, []attribute.KeyValue{amqpotel.LaneKey.Int(1)}, 2},
	} {
		if got := c.sum(w.name, append(w.kv, sb...)...); got != w.want {
			t.Errorf("%s %v = %d, want %d:\n%s", w.name, w.kv, got, w.want, c.attrSets(w.name))
		}
	}
	if got := c.count(amqpotel.ProcessDurationName, append(sb, amqpotel.ResultKey.String("release"), noError)...); got != 1 {
		t.Errorf("process durations:\n%s", c.attrSets(amqpotel.ProcessDurationName))
	}
	if got := c.count(amqpotel.BatchSizeName, sb...); got != 1 {
		t.Errorf("batch sizes:\n%s", c.attrSets(amqpotel.BatchSizeName))
	}
	runtime.KeepAlive(r)
}

// Two subscribers of one queue add up in the gauges; one that is garbage
// collected drops out of them; Close stops them.
func TestGaugesSumAndForget(t *testing.T) {
	m, reader := newMetrics(t)
	st := func() amqpsub.Stats {
		return amqpsub.Stats{Held: 4, Credit: 7, CreditLimit: 10, Lanes: []amqpsub.LaneStats{{Load: 4}, {}}}
	}
	a := m.Recorder(info("q", st))
	b := m.Recorder(info("q", st))
	c := collect(t, reader)
	if got := c.sum(amqpotel.HeldName); got != 8 {
		t.Errorf("held = %d, want 8 (two subscribers of 4)", got)
	}
	if got := c.sum(amqpotel.CreditName); got != 14 {
		t.Errorf("credit = %d, want 14 (7 + 7, now)", got)
	}
	if got := c.sum(amqpotel.CreditLimitName); got != 20 {
		t.Errorf("credit limit = %d, want 20", got)
	}
	if got := c.sum(amqpotel.LaneLoadName, amqpotel.LaneKey.Int(0)); got != 8 {
		t.Errorf("lane 0 = %d, want 8:\n%s", got, c.attrSets(amqpotel.LaneLoadName))
	}
	runtime.KeepAlive(b) // b's last use: the GC may take it from here
	runtime.GC()
	runtime.GC()
	if got := collect(t, reader).sum(amqpotel.HeldName); got != 4 {
		t.Errorf("held = %d after one subscriber was collected, want 4", got)
	}
	runtime.KeepAlive(a)
	if err := m.Close(); err != nil {
		t.Fatal(err)
	}
	if err := m.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
	if got := collect(t, reader).sum(amqpotel.HeldName); got != 0 {
		t.Errorf("held = %d after Close", got)
	}
	runtime.KeepAlive(a)
}

func TestNewMetricsInvalidOptions(t *testing.T) {
	for _, opts := range [][]amqpotel.Option{
		{amqpotel.WithMeterProvider(nil)},
		{nil},
	} {
		if _, err := amqpotel.NewMetrics(opts...); !errors.Is(err, amqpotel.ErrInvalidOption) {
			t.Errorf("NewMetrics(%v) = %v, want ErrInvalidOption", opts, err)
		}
	}
}

// The figures README.md reports: what each Recorder method allocates with
// the SDK's MeterProvider behind it, once its attribute sets have been
// seen. The recorder itself allocates nothing; the SDK's figures are its
// own (aggregation of a known attribute set allocates nothing in v1.47).
func TestRecorderAllocations(t *testing.T) {
	m, reader := newMetrics(t)
	r := m.Recorder(info("q", func() amqpsub.Stats { return amqpsub.Stats{} }))
	call := amqpsub.HandlerCall{Deliveries: 3, Took: 3 * time.Millisecond, Result: amqpsub.ResultRetry}
	for _, c := range []struct {
		name string
		f    func()
		max  float64
	}{
		{"Received", r.Received, 0},
		{"Handled", func() { r.Handled(call) }, 0},
		{"Settled", func() { r.Settled(amqpsub.OutcomeAccepted, nil) }, 0},
		{"Settled(ErrNotSettled)", func() { r.Settled(amqpsub.OutcomeModified, amqpsub.ErrNotSettled) }, 0},
		{"Event", func() { r.Event(amqpsub.Event{Kind: amqpsub.EventLinkLost}) }, 0},
		{"LocksRenewed", func() { r.LocksRenewed(3) }, 0},
		{"Dropped", func() { r.Dropped(2) }, 0},
	} {
		c.f() // the SDK makes the attribute set's aggregator on first sight
		got := testing.AllocsPerRun(1000, c.f)
		t.Logf("%s: %.1f allocations per call", c.name, got)
		if got > c.max {
			t.Errorf("%s: %.1f allocations per call, want ≤ %.0f", c.name, got, c.max)
		}
	}
	collect(t, reader)
}

func BenchmarkRecorder(b *testing.B) {
	m, _ := newMetrics(b)
	r := m.Recorder(info("q", func() amqpsub.Stats { return amqpsub.Stats{} }))
	call := amqpsub.HandlerCall{Deliveries: 1, Took: time.Millisecond}
	b.ReportAllocs()
	for b.Loop() {
		r.Received()
		r.Handled(call)
		r.Settled(amqpsub.OutcomeAccepted, nil)
	}
}

// A collection running while New makes a subscriber calls its Stats
// (registered by Recorder) before New has finished: it must not race.
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
