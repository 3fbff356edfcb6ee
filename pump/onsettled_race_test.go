package pump_test

import (
	"sync"
	"testing"

	"github.com/amqpsub/amqpsub/internal/fake"
	"github.com/amqpsub/amqpsub/pump"
)

// Goroutines a handler left behind, calling OnSettled for its delivery
// while it settles and after its entry holds the next delivery, never make
// a delivery's own function go unheard: a call that lands after the
// settlement began puts back what it replaced, and one for an earlier
// delivery never replaces a later one's. (An outside review found both.)
func TestOnSettledFromLeftBehindGoroutines(t *testing.T) {
	const n = 3000
	src := fake.New(false, fake.Messages(n)...)
	p := pump.New(pump.Config{Credit: 1}) // one entry, reused by every delivery
	cancel, errc := start(t, p, attachTo(src))
	var leftBehind sync.WaitGroup
	lost := 0
	for i := range n {
		tk := <-p.Out()
		tk.Begin()
		heard := make(chan struct{})
		var once sync.Once
		f := func(pump.Kind, error) { once.Do(func() { close(heard) }) }
		if !tk.OnSettled(f) {
			t.Fatal("OnSettled refused in the handler")
		}
		// Goroutines the handler left behind, asking for its delivery.
		for range 2 {
			leftBehind.Go(func() {
				for tk.OnSettled(f) {
				}
			})
		}
		p.Settle(tk, pump.Outcome{Kind: pump.Accept})
		for p.Stats().Accepted != uint64(i+1) {
		}
		select {
		case <-heard:
		default:
			lost++
		}
	}
	leftBehind.Wait()
	cancel()
	<-errc
	if lost > 0 {
		t.Fatalf("%d of %d deliveries settled without their OnSettled function being called", lost, n)
	}
}
