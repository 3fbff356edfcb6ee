package amqpsub_test

import (
	"context"
	"fmt"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/Azure/go-amqp"

	"github.com/amqpsub/amqpsub/amqpsub"
	"github.com/amqpsub/amqpsub/internal/fake"
)

// benchShape is one pipeline configuration under benchmark.
type benchShape struct {
	name  string
	batch bool
	opts  []amqpsub.Option
}

var benchShapes = []benchShape{
	{name: "Workers(1)", opts: []amqpsub.Option{amqpsub.Workers(1)}},
	{name: "Workers(8)", opts: []amqpsub.Option{amqpsub.Workers(8)}},
	{name: "WorkersByKey(8)", opts: []amqpsub.Option{amqpsub.WorkersByKey(8)}},
	{name: "WorkersByKey(8)+BalanceKeys", opts: []amqpsub.Option{amqpsub.WorkersByKey(8), amqpsub.BalanceKeys()}},
	{name: "Batch(100,10ms)", batch: true, opts: []amqpsub.Option{amqpsub.Batch(100, 10*time.Millisecond)}},
}

// benchKeys are the group-ids of the fake's messages: 100 groups, as in the
// broker benchmark.
func benchKeys() []string {
	keys := make([]string, 100)
	for i := range keys {
		keys[i] = fmt.Sprintf("g%03d", i)
	}
	return keys
}

// goal is a count of handled deliveries to wait for.
type goal struct {
	n    int64
	once sync.Once
	ch   chan struct{}
}

func newGoal(n int64) *goal { return &goal{n: n, ch: make(chan struct{})} }

func (g *goal) reached(count int64) {
	if count >= g.n {
		g.once.Do(func() { close(g.ch) })
	}
}

// pipeline runs a subscriber on src with a handler that calls onHandle (if
// set) and counts deliveries; wait blocks until the count reaches n more
// than at the call, stop ends the subscriber and waits for Run.
type pipeline struct {
	handled atomic.Int64
	goal    atomic.Pointer[goal]
	cancel  context.CancelFunc
	errc    chan error
}

func startPipeline(tb testing.TB, src *fake.Source, shape benchShape, onHandle func(d *amqpsub.Delivery)) *pipeline {
	tb.Helper()
	p := &pipeline{errc: make(chan error, 1)}
	p.goal.Store(newGoal(1 << 62))
	note := func(k int) { p.goal.Load().reached(p.handled.Add(int64(k))) }
	opts := append([]amqpsub.Option(nil), shape.opts...)
	var s *amqpsub.Subscriber
	var err error
	if shape.batch {
		s, err = amqpsub.NewBatch(amqpsub.SourceOf(src), "q", amqpsub.BatchHandlerFunc(
			func(ctx context.Context, batch []*amqpsub.Delivery) []error {
				if onHandle != nil {
					for _, d := range batch {
						onHandle(d)
					}
				}
				note(len(batch))
				return nil
			}), opts...)
	} else {
		s, err = amqpsub.New(amqpsub.SourceOf(src), "q", amqpsub.HandlerFunc(
			func(ctx context.Context, d *amqpsub.Delivery) error {
				if onHandle != nil {
					onHandle(d)
				}
				note(1)
				return nil
			}), opts...)
	}
	if err != nil {
		tb.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	p.cancel = cancel
	go func() { p.errc <- s.Run(ctx) }()
	return p
}

// wait blocks until n more deliveries than now were handled.
func (p *pipeline) wait(n int) {
	g := newGoal(p.handled.Load() + int64(n))
	p.goal.Store(g)
	g.reached(p.handled.Load())
	<-g.ch
}

func (p *pipeline) stop(tb testing.TB) {
	tb.Helper()
	p.cancel()
	if err := <-p.errc; err != nil {
		tb.Fatalf("Run: %v", err)
	}
}

// newBenchSource is an endless fake holding four times the default credit.
func newBenchSource() *fake.Source {
	src := fake.New(false, fake.Messages(4*256, benchKeys()...)...)
	src.Recycle = true
	return src
}

// BenchmarkPipeline measures the whole of amqpsub on the fake source with a
// no-op handler: receive loop, pump, lanes, handler call, settlement and
// credit. One op is one delivery.
func BenchmarkPipeline(b *testing.B) {
	for _, shape := range benchShapes {
		b.Run(shape.name, func(b *testing.B) {
			p := startPipeline(b, newBenchSource(), shape, nil)
			defer p.stop(b)
			p.wait(4 * 256) // warm up

			var before, after runtime.MemStats
			runtime.ReadMemStats(&before)
			b.ReportAllocs()
			b.ResetTimer()
			p.wait(b.N)
			b.StopTimer()
			runtime.ReadMemStats(&after)
			b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "deliveries/s")
			b.ReportMetric(float64(after.Mallocs-before.Mallocs)/float64(b.N), "allocs/delivery")
		})
	}
}

var (
	maxRateMu sync.Mutex
	maxRate   = map[string]float64{}
)

// measuredMaxRate is the unpaced rate of the shape's pipeline, measured
// once per process over 200,000 deliveries.
func measuredMaxRate(b *testing.B, shape benchShape) float64 {
	maxRateMu.Lock()
	defer maxRateMu.Unlock()
	if r, ok := maxRate[shape.name]; ok {
		return r
	}
	p := startPipeline(b, newBenchSource(), shape, nil)
	p.wait(4 * 256)
	const n = 200000
	start := time.Now()
	p.wait(n)
	r := n / time.Since(start).Seconds()
	p.stop(b)
	maxRate[shape.name] = r
	return r
}

// BenchmarkLatency measures the latency the pipeline adds: from the fake
// handing a message to the receive loop (Receive returning it) until the
// handler starts. The fake is paced at half the pipeline's measured maximum
// rate ("half"), and at 20,000 msgs/s, about what one broker sends here
// ("20k"). It reports the 50th, 90th and 99th percentiles, the rate offered
// and the rate delivered: when delivered falls short of offered, the
// pipeline did not keep up and the latency is mostly queueing. One op is one
// delivery.
func BenchmarkLatency(b *testing.B) {
	for _, shape := range []benchShape{benchShapes[0], benchShapes[2]} {
		for _, load := range []string{"half", "20k"} {
			b.Run(shape.name+"/"+load, func(b *testing.B) {
				rate := 20000.0
				if load == "half" {
					rate = measuredMaxRate(b, shape) / 2
				}
				benchLatency(b, shape, rate)
			})
		}
	}
}

func benchLatency(b *testing.B, shape benchShape, rate float64) {
	msgs := fake.Messages(4*256, benchKeys()...)
	src := fake.New(false, msgs...)
	src.Recycle = true
	src.Interval = time.Duration(float64(time.Second) / rate)
	// A message is handed over again only after it was settled, so one
	// stamp per message is enough.
	base := time.Now()
	stamps := make([]atomic.Int64, len(msgs))
	src.OnReceive = func(m *amqp.Message) {
		stamps[m.Value.(int)].Store(int64(time.Since(base)))
	}
	samples := make([]int64, b.N)
	var next atomic.Int64
	var record atomic.Bool
	p := startPipeline(b, src, shape, func(d *amqpsub.Delivery) {
		now := int64(time.Since(base))
		if !record.Load() {
			return
		}
		if i := next.Add(1) - 1; i < int64(len(samples)) {
			samples[i] = now - stamps[d.Message().Value.(int)].Load()
		}
	})
	p.wait(256) // warm up

	b.ResetTimer()
	record.Store(true)
	p.wait(b.N)
	b.StopTimer()
	// Once Run has returned no handler writes samples any more.
	p.stop(b)
	n := min(int(next.Load()), len(samples))
	if n == 0 {
		b.Fatal("no samples")
	}
	got := samples[:n]
	slices.Sort(got)
	b.ReportMetric(float64(got[n/2]), "p50-ns")
	b.ReportMetric(float64(got[min(n-1, n*9/10)]), "p90-ns")
	b.ReportMetric(float64(got[min(n-1, n*99/100)]), "p99-ns")
	b.ReportMetric(rate, "offered/s")
	b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "delivered/s")
}

// nopMetrics is a Recorder that does nothing: the cost of the hook itself.
type nopMetrics struct{}

func (nopMetrics) Recorder(amqpsub.MetricsInfo) amqpsub.Recorder { return nopMetrics{} }
func (nopMetrics) Received()                                     {}
func (nopMetrics) Handled(amqpsub.HandlerCall)                   {}
func (nopMetrics) Settled(amqpsub.Outcome, error)                {}
func (nopMetrics) Event(amqpsub.Event)                           {}
func (nopMetrics) LocksRenewed(int)                              {}
func (nopMetrics) Dropped(int)                                   {}

// BenchmarkMetricsHook is BenchmarkPipeline without WithMetrics ("none")
// and with a Recorder that does nothing ("nop"): the difference is what the
// hook costs per delivery before an adapter does any work.
func BenchmarkMetricsHook(b *testing.B) {
	for _, shape := range []benchShape{benchShapes[0], benchShapes[2], benchShapes[4]} {
		for _, hook := range []string{"none", "nop"} {
			b.Run(shape.name+"/"+hook, func(b *testing.B) {
				if hook == "nop" {
					shape.opts = append(slices.Clip(shape.opts), amqpsub.WithMetrics(nopMetrics{}))
				}
				p := startPipeline(b, newBenchSource(), shape, nil)
				defer p.stop(b)
				p.wait(4 * 256)
				var before, after runtime.MemStats
				runtime.ReadMemStats(&before)
				b.ReportAllocs()
				b.ResetTimer()
				p.wait(b.N)
				b.StopTimer()
				runtime.ReadMemStats(&after)
				b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "deliveries/s")
				b.ReportMetric(float64(after.Mallocs-before.Mallocs)/float64(b.N), "allocs/delivery")
			})
		}
	}
}
