package amqpsub_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/amqpsub/amqpsub/amqpsub"
	"github.com/amqpsub/amqpsub/amqpsubtest"
)

// countingMetrics is a Recorder that counts everything it hears.
type countingMetrics struct {
	mu       sync.Mutex
	info     amqpsub.MetricsInfo
	received int
	calls    map[amqpsub.Result]int
	panics   int
	settled  map[amqpsub.Outcome]int
	failed   int
	dropped  int
	events   map[amqpsub.EventKind]int
	batches  []int
	lanes    map[int]bool
}

func (m *countingMetrics) Recorder(info amqpsub.MetricsInfo) amqpsub.Recorder {
	m.info = info
	m.calls = map[amqpsub.Result]int{}
	m.settled = map[amqpsub.Outcome]int{}
	m.events = map[amqpsub.EventKind]int{}
	m.lanes = map[int]bool{}
	return m
}

func (m *countingMetrics) Received() { m.mu.Lock(); m.received++; m.mu.Unlock() }

func (m *countingMetrics) Handled(c amqpsub.HandlerCall) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.calls[c.Result]++
	if c.Panicked {
		m.panics++
	}
	if c.Took < 0 {
		panic("negative duration")
	}
	m.batches = append(m.batches, c.Deliveries)
	m.lanes[c.Lane] = true
}

func (m *countingMetrics) Settled(o amqpsub.Outcome, err error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if err != nil {
		m.failed++
		return
	}
	m.settled[o]++
}

func (m *countingMetrics) Event(e amqpsub.Event) { m.mu.Lock(); m.events[e.Kind]++; m.mu.Unlock() }
func (m *countingMetrics) LocksRenewed(int)      {}
func (m *countingMetrics) Dropped(n int)         { m.mu.Lock(); m.dropped += n; m.mu.Unlock() }

// The recorder hears, call by call, what Stats counts in total.
func TestRecorderAgreesWithStats(t *testing.T) {
	q := amqpsubtest.NewQueue(amqpsubtest.MaxDeliveryAttempts(2))
	for _, body := range []string{"ok", "ok", "release-once", "reject", "retry", "panic-once", "ok"} {
		q.Publish(amqpsubtest.Message("g-"+body, body))
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
	m := &countingMetrics{}
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
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.info.Queue != "orders" || m.info.System != "activemq" || m.info.Credit != 256 || m.info.Lanes != 3 || m.info.Batch {
		t.Errorf("info = %+v", m.info)
	}
	if got := m.info.Stats(); got.Received != st.Received {
		t.Errorf("info.Stats().Received = %d, Stats().Received = %d", got.Received, st.Received)
	}
	if uint64(m.received) != st.Received || st.Received != 10 {
		t.Errorf("received: recorder %d, Stats %d, want 10 (7 messages, a release, a panic, a retry)", m.received, st.Received)
	}
	want := map[amqpsub.Outcome]uint64{
		amqpsub.OutcomeAccepted: st.Settled.Accepted, amqpsub.OutcomeReleased: st.Settled.Released,
		amqpsub.OutcomeModified: st.Settled.Modified, amqpsub.OutcomeRejected: st.Settled.Rejected,
	}
	for o, n := range want {
		if uint64(m.settled[o]) != n {
			t.Errorf("settled %v: recorder %d, Stats %d", o, m.settled[o], n)
		}
	}
	if st.Settled.Accepted != 5 || st.Settled.Modified != 3 || st.Settled.Rejected != 1 || st.Settled.Released != 1 {
		t.Errorf("Stats.Settled = %+v", st.Settled)
	}
	if m.failed != 0 {
		t.Errorf("%d settlements failed", m.failed)
	}
	calls := map[amqpsub.Result]uint64{amqpsub.ResultAccept: st.Results.Accept, amqpsub.ResultRelease: st.Results.Release,
		amqpsub.ResultReject: st.Results.Reject, amqpsub.ResultRetry: st.Results.Retry}
	for r, n := range calls {
		if uint64(m.calls[r]) != n {
			t.Errorf("handler calls with result %v: recorder %d, Stats %d", r, m.calls[r], n)
		}
	}
	if m.panics != 1 || st.Results.Panics != 1 {
		t.Errorf("panics: recorder %d, Stats %d", m.panics, st.Results.Panics)
	}
	// Two failed deliveries of "retry", and the panic, which is a Retry too.
	if m.events[amqpsub.EventHandlerPanicked] != 1 || m.events[amqpsub.EventHandlerFailed] != 3 {
		t.Errorf("events = %v", m.events)
	}
	for _, n := range m.batches {
		if n != 1 {
			t.Fatalf("a Handler call reported %d deliveries", n)
		}
	}
}

// A batch call reports its size and its most severe result.
func TestRecorderHearsBatches(t *testing.T) {
	q := amqpsubtest.NewQueue()
	for range 10 {
		q.Publish(amqpsubtest.Message("", "x"))
	}
	m := &countingMetrics{}
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
	m.mu.Lock()
	defer m.mu.Unlock()
	if !m.info.Batch || len(m.batches) != 1 || m.batches[0] != 10 || m.calls[amqpsub.ResultReject] != 1 {
		t.Errorf("batch=%v batches=%v calls=%v", m.info.Batch, m.batches, m.calls)
	}
	if m.settled[amqpsub.OutcomeAccepted] != 9 || m.settled[amqpsub.OutcomeRejected] != 1 {
		t.Errorf("settled = %v", m.settled)
	}
}

// OnSettled hears the settlement of its own delivery, once, with the
// outcome sent.
func TestOnSettledHearsEachSettlement(t *testing.T) {
	q := amqpsubtest.NewQueue(amqpsubtest.MaxDeliveryAttempts(1))
	bodies := []string{"a", "r", "x", "f"}
	for _, b := range bodies {
		q.Publish(amqpsubtest.Message("", b))
	}
	var mu sync.Mutex
	heard := map[string][]amqpsub.Outcome{}
	h := amqpsub.HandlerFunc(func(_ context.Context, d *amqpsub.Delivery) error {
		body, _ := d.Body()
		b := string(body)
		if !d.OnSettled(func(o amqpsub.Outcome, err error) {
			if err != nil {
				t.Errorf("%s: %v", b, err)
			}
			mu.Lock()
			heard[b] = append(heard[b], o)
			mu.Unlock()
		}) {
			t.Errorf("%s: OnSettled refused in the handler", b)
		}
		switch b {
		case "r":
			return amqpsub.Reject("r")
		case "f":
			return errors.New("f")
		case "x":
			// A second call replaces the first.
			d.OnSettled(func(o amqpsub.Outcome, _ error) {
				mu.Lock()
				heard["x2"] = append(heard["x2"], o)
				mu.Unlock()
			})
		}
		return nil
	})
	var kept *amqpsub.Delivery
	sub, err := amqpsub.New(q.Connector(), "q", amqpsub.HandlerFunc(func(ctx context.Context, d *amqpsub.Delivery) error {
		kept = d
		return h(ctx, d)
	}))
	if err != nil {
		t.Fatal(err)
	}
	if err := q.Drain(t.Context(), sub); err != nil {
		t.Fatal(err)
	}
	if kept.OnSettled(func(amqpsub.Outcome, error) { t.Error("called after the settlement") }) {
		t.Error("OnSettled after the settlement reported true")
	}
	mu.Lock()
	defer mu.Unlock()
	want := map[string][]amqpsub.Outcome{
		"a": {amqpsub.OutcomeAccepted}, "r": {amqpsub.OutcomeRejected},
		"x2": {amqpsub.OutcomeAccepted}, "f": {amqpsub.OutcomeModified},
	}
	if len(heard) != len(want) {
		t.Errorf("heard %v, want %v", heard, want)
	}
	for k, w := range want {
		if len(heard[k]) != 1 || heard[k][0] != w[0] {
			t.Errorf("%s: heard %v, want %v", k, heard[k], w)
		}
	}
}

func TestWithMetricsNilIsInvalid(t *testing.T) {
	q := amqpsubtest.NewQueue()
	_, err := amqpsub.New(q.Connector(), "q", amqpsub.HandlerFunc(func(context.Context, *amqpsub.Delivery) error { return nil }), amqpsub.WithMetrics(nil))
	if !errors.Is(err, amqpsub.ErrInvalidOption) {
		t.Fatalf("err = %v", err)
	}
}

type infoCatcher struct{ info amqpsub.MetricsInfo }

func (m *infoCatcher) Recorder(i amqpsub.MetricsInfo) amqpsub.Recorder { m.info = i; return nil }

// MetricsInfo.Credit is what the adapters export as the credit gauge, to
// read Held against: for a session consumer, the sum of the sessions'
// shares, max(1, Credit/n) each: 8 for Credit(2) and Sessions(8), 8 for
// Credit(10) and Sessions(4).
func TestMetricsInfoCreditOfASessionConsumer(t *testing.T) {
	c, err := amqpsub.ServiceBus("Endpoint=sb://example.servicebus.windows.net/;SharedAccessKeyName=k;SharedAccessKey=dmFsdWU=")
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct{ credit, sessions int }{{2, 8}, {10, 4}} {
		m := &infoCatcher{}
		s, err := amqpsub.New(c, "q", amqpsub.HandlerFunc(func(context.Context, *amqpsub.Delivery) error { return nil }),
			amqpsub.Credit(tc.credit), amqpsub.Sessions(tc.sessions), amqpsub.WithMetrics(m))
		if err != nil {
			t.Fatal(err)
		}
		total := amqpsub.PumpCredit(s)
		if total != m.info.Credit {
			t.Errorf("Credit(%d) Sessions(%d): MetricsInfo.Credit %d, the pumps' credit %d", tc.credit, tc.sessions, m.info.Credit, total)
		}
	}
}
