package pump_test

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"testing"

	"github.com/amqpsub/amqpsub/internal/driver"
	"github.com/amqpsub/amqpsub/internal/fake"
	"github.com/amqpsub/amqpsub/internal/pump"
)

// BenchmarkPump measures the pump alone: the fake source hands a message to
// the receive loop, the pump books it and puts it in Out, the benchmark
// takes it and settles it, the pump applies the settlement and grants credit
// back. One op is one delivery. The fake is endless (Recycle) and holds four
// times the credit, so it never runs dry.
func BenchmarkPump(b *testing.B) {
	for _, credit := range []int{16, 256} {
		b.Run(fmt.Sprintf("credit=%d", credit), func(b *testing.B) {
			src := fake.New(false, fake.Messages(4*credit)...)
			src.Recycle = true
			p := pump.New(pump.Config{Credit: credit})
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			errc := make(chan error, 1)
			go func() { errc <- p.Run(ctx, attachTo(src)) }()
			accept := driver.Outcome{Kind: driver.Accept}
			for range 4 * credit { // warm up: every entry and channel in use
				p.Settle(<-p.Out(), accept)
			}

			var before, after runtime.MemStats
			runtime.ReadMemStats(&before)
			b.ReportAllocs()
			b.ResetTimer()
			for range b.N {
				p.Settle(<-p.Out(), accept)
			}
			b.StopTimer()
			runtime.ReadMemStats(&after)
			reportPerDelivery(b, before, after)

			p.Stop()
			if err := <-errc; !errors.Is(err, pump.ErrStopped) {
				b.Fatalf("Run = %v, want ErrStopped", err)
			}
			if st := p.Stats(); st.MaxHeld > credit {
				b.Fatalf("held %d, above the credit %d", st.MaxHeld, credit)
			}
		})
	}
}

// reportPerDelivery adds deliveries/s and the exact (fractional)
// allocations per delivery, which -benchmem rounds down to an integer.
func reportPerDelivery(b *testing.B, before, after runtime.MemStats) {
	b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "deliveries/s")
	b.ReportMetric(float64(after.Mallocs-before.Mallocs)/float64(b.N), "allocs/delivery")
}
