package lanes_test

import (
	"fmt"
	"runtime"
	"testing"
	"time"

	"github.com/amqpsub/amqpsub/internal/lanes"
)

type benchItem struct{ key string }

// benchItems returns n items whose keys rotate over groups keys ("" for all
// when groups is 0).
func benchItems(n, groups int) []*benchItem {
	items := make([]*benchItem, n)
	for i := range items {
		items[i] = &benchItem{}
		if groups > 0 {
			items[i].key = fmt.Sprintf("g%03d", i%groups)
		}
	}
	return items
}

// BenchmarkDispatch measures lanes.Run alone: the benchmark feeds an input
// channel as deep as the default credit (256), lanes hand each item to a
// no-op handler. One op is one item.
func BenchmarkDispatch(b *testing.B) {
	key := func(it *benchItem) string { return it.key }
	for _, tc := range []struct {
		name     string
		lanes    int
		key      func(*benchItem) string
		groups   int
		batch    int
		balanced bool
	}{
		{name: "Workers(1)", lanes: 1},
		{name: "Workers(8)", lanes: 8},
		{name: "WorkersByKey(8)/100-groups", lanes: 8, key: key, groups: 100},
		{name: "WorkersByKey(8)/no-key", lanes: 8, key: key},
		{name: "WorkersByKey(8)+Balanced/100-groups", lanes: 8, key: key, groups: 100, balanced: true},
		{name: "WorkersByKey(8)+Balanced/no-key", lanes: 8, key: key, balanced: true},
		{name: "Workers(1)/batch-100", lanes: 1, batch: 100},
		{name: "WorkersByKey(8)/100-groups/batch-100", lanes: 8, key: key, groups: 100, batch: 100},
		{name: "WorkersByKey(8)+Balanced/100-groups/batch-100", lanes: 8, key: key, groups: 100, batch: 100, balanced: true},
	} {
		b.Run(tc.name, func(b *testing.B) {
			items := benchItems(1024, tc.groups)
			in := make(chan *benchItem, 256)
			cfg := lanes.Config[*benchItem]{
				Lanes:    tc.lanes,
				Key:      tc.key,
				Balanced: tc.balanced,
				Handle:   func(int, *benchItem) {},
				Drop:     func(*benchItem) { b.Error("dropped") },
			}
			if tc.batch > 0 {
				cfg.Handle = nil
				cfg.BatchSize, cfg.BatchWait = tc.batch, 10*time.Millisecond
				cfg.HandleBatch = func(int, []*benchItem) {}
			}
			done := make(chan struct{})
			go func() {
				defer close(done)
				lanes.Run(in, cfg)
			}()
			var before, after runtime.MemStats
			runtime.ReadMemStats(&before)
			b.ReportAllocs()
			b.ResetTimer()
			for i := range b.N {
				in <- items[i%len(items)]
			}
			close(in)
			<-done
			b.StopTimer()
			runtime.ReadMemStats(&after)
			b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "items/s")
			b.ReportMetric(float64(after.Mallocs-before.Mallocs)/float64(b.N), "allocs/item")
		})
	}
}
