package lanes

import (
	"testing"
	"time"
)

// BenchmarkBatcher measures batch assembly alone: Add until full, then
// Flush, asking UntilNext as a lane does. One op is one item.
func BenchmarkBatcher(b *testing.B) {
	type item struct{}
	it := &item{}
	bt := newBatcher[*item](100, 10*time.Millisecond)
	now := time.Now()
	b.ReportAllocs()
	for range b.N {
		if bt.add(now, it) {
			bt.flush()
		}
		bt.untilNext(now)
	}
}
