package pump_test

import (
	"errors"
	"sync"
	"testing"

	"github.com/amqpsub/amqpsub/internal/fake"
	"github.com/amqpsub/amqpsub/pump"
)

type countMeter struct {
	mu                         sync.Mutex
	received, settled, dropped int
}

func (m *countMeter) Received()                { m.mu.Lock(); m.received++; m.mu.Unlock() }
func (m *countMeter) Settled(pump.Kind, error) { m.mu.Lock(); m.settled++; m.mu.Unlock() }
func (m *countMeter) Dropped(n int)            { m.mu.Lock(); m.dropped += n; m.mu.Unlock() }

// A delivery whose lock is lost before a handler takes it reaches the
// Meter as dropped: received = settled + dropped on that path too. (Pinned
// after an outside review.)
func TestMeterHearsOfALockLostBeforeAHandler(t *testing.T) {
	src := fake.New(false, fake.Messages(3)...)
	m := &countMeter{}
	p := pump.New(pump.Config{Credit: 3, Meter: m})
	_, errc := start(t, p, attachTo(src))
	a, b, c := <-p.Out(), <-p.Out(), <-p.Out()
	if !p.LoseLock(b) { // buffered: dropped
		t.Fatal("LoseLock of a buffered delivery = false")
	}
	for _, tk := range []pump.Ticket{a, b, c} {
		if tk.Begin() {
			p.Settle(tk, pump.Outcome{Kind: pump.Accept})
		} else {
			p.Settle(tk, pump.Outcome{Kind: pump.Drop})
		}
	}
	p.Stop()
	if err := <-errc; !errors.Is(err, pump.ErrStopped) {
		t.Fatalf("Run = %v", err)
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.received != 3 || m.settled != 2 || m.dropped != 1 {
		t.Fatalf("Meter heard %d received, %d settled, %d dropped; want 3, 2, 1", m.received, m.settled, m.dropped)
	}
}
