package pump_test

import (
	"context"
	"errors"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"

	"github.com/Azure/go-amqp"

	"github.com/amqpsub/amqpsub/internal/driver"
	"github.com/amqpsub/amqpsub/internal/fake"
	"github.com/amqpsub/amqpsub/internal/pump"
)

// A second Settle of the same delivery is refused: were it applied, the
// entry would be freed twice and two later deliveries would share it, one
// settled with the other's outcome.
func TestSecondSettleIsRefused(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		src := fake.New(true, fake.Messages(20)...)
		p := pump.New(pump.Config{Credit: 4})
		cancel, errc := start(t, p, attachTo(src))
		d := <-p.Out()
		if !p.Settle(d, driver.Outcome{Kind: driver.Accept}) {
			t.Fatal("first Settle refused")
		}
		if p.Settle(d, driver.Outcome{Kind: driver.Reject}) {
			t.Fatal("second Settle before the first was applied taken")
		}
		synctest.Wait()
		if p.Settle(d, driver.Outcome{Kind: driver.Reject}) {
			t.Fatal("second Settle after the first was applied taken")
		}
		// Every later delivery has an entry of its own, and is settled
		// once, with its own outcome.
		var held []driver.Ticket
		for range 4 {
			held = append(held, <-p.Out())
		}
		for _, e := range held {
			p.Settle(e, driver.Outcome{Kind: driver.Accept})
		}
		synctest.Wait()
		settled := map[*amqp.Message]int{}
		for _, s := range src.Settlements() {
			settled[s.Msg]++
		}
		if len(settled) != 5 {
			t.Fatalf("%d messages settled, want 5", len(settled))
		}
		for m, n := range settled {
			if n != 1 {
				t.Fatalf("message %v settled %d times", m.Value, n)
			}
		}
		st := p.Stats()
		if st.DoubleSettles != 2 || st.Accepted != 5 || st.Rejected != 0 || src.Count(fake.Rejected) != 0 {
			t.Fatalf("stats %+v, broker saw %d rejects", st, src.Count(fake.Rejected))
		}
		cancel()
		<-errc
	})
}

// Deliveries of a lost link that wait for a consumer stop counting as held
// at once, so the new link gets the whole credit; the consumer that finds
// one later is told not to handle it, and settling it only frees its entry.
func TestLostLinkDropsWhatWaitsAtOnce(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		first := fake.New(true, fake.Messages(4)...)
		second := fake.New(true, fake.Messages(10)...)
		p := pump.New(pump.Config{Credit: 4})
		cancel, errc := start(t, p, attachTo(first, second))
		synctest.Wait() // the 4 of the first link wait in Out
		busy := <-p.Out()
		if !busy.Begin() {
			t.Fatal("Begin refused")
		}
		first.Fail(fake.ErrLinkLost)
		synctest.Wait()
		// Held: the one in a handler; the 3 left in Out were dropped, and
		// the second link got 3 credits.
		st := p.Stats()
		if st.Held != 4 || st.Dropped != 3 || st.Links != 2 || second.Credit() != 0 {
			t.Fatalf("after the loss: %+v, credit left on the new link %d", st, second.Credit())
		}
		var fresh, stale int
		for range 6 {
			d := <-p.Out()
			if d.Begin() {
				fresh++
				p.Settle(d, driver.Outcome{Kind: driver.Accept})
			} else {
				stale++
				if d.State() != driver.Dropped {
					t.Fatalf("a stale delivery in state %s", d.State())
				}
				p.Settle(d, driver.Outcome{Kind: driver.Drop})
			}
		}
		p.Settle(busy, driver.Outcome{Kind: driver.Accept}) // its link is gone
		synctest.Wait()
		st = p.Stats()
		if fresh != 3 || stale != 3 || st.Stale != 1 || st.Dropped != 3 || st.Accepted != 3 {
			t.Fatalf("fresh %d stale %d, stats %+v", fresh, stale, st)
		}
		cancel()
		if err := <-errc; !errors.Is(err, context.Canceled) {
			t.Fatalf("Run = %v", err)
		}
	})
}

// A dropped delivery handed to Settle is not held, and is not counted as
// settling either: not while the pump frees its entry, nor after the pump
// has returned, when nothing frees it any more (the census then said
// "held=0 settling=2").
func TestDroppedHandedToSettleIsNotSettling(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		first := fake.New(true, fake.Messages(3)...)
		second := fake.New(true)
		p := pump.New(pump.Config{Credit: 3})
		cancel, errc := start(t, p, attachTo(first, second))
		synctest.Wait() // the 3 of the first link wait in Out
		first.Fail(fake.ErrLinkLost)
		synctest.Wait()
		cancel()
		if err := <-errc; !errors.Is(err, context.Canceled) {
			t.Fatalf("Run = %v", err)
		}
		for range 3 {
			d := <-p.Out()
			if d.Begin() || d.State() != driver.Dropped {
				t.Fatalf("a delivery of the lost link: Begin took it, or its state is %s", d.State())
			}
			p.Settle(d, driver.Outcome{Kind: driver.Drop})
			if d.State() != driver.Reclaiming {
				t.Fatalf("a dropped delivery handed to Settle is %s, want reclaiming", d.State())
			}
		}
		if st := p.Stats(); st.Held != 0 || st.Settling != 0 || st.Buffered != 0 || st.Handling != 0 {
			t.Fatalf("after Run returned: %+v, want nothing held, settling, buffered or handling", st)
		}
	})
}

// LoseLease reports whether it acted, which decides whether amqpsub reports
// a lost lock (EventLockLost, the warning): true for a buffered or handled
// delivery of the ticket's generation, false once it settles or its entry
// holds the next delivery.
func TestLoseLockReportsWhetherItActed(t *testing.T) {
	src := fake.New(false, fake.Messages(3)...)
	p := pump.New(pump.Config{Credit: 1})
	cancel, errc := start(t, p, attachTo(src))
	defer func() { cancel(); <-errc }()

	a := <-p.Out()
	a.Begin()
	if !p.LoseLease(a) {
		t.Error("LoseLease of a delivery in a handler = false, want true")
	}
	if p.LoseLease(a) {
		t.Error("second LoseLease of the same delivery = true, want false")
	}
	p.Settle(a, driver.Outcome{Kind: driver.Accept})
	b := <-p.Out() // the same entry, the next delivery
	if b.Entry() != a.Entry() {
		t.Fatal("entry not reused")
	}
	if p.LoseLease(a) {
		t.Error("LoseLease of a settled delivery whose entry holds the next = true, want false")
	}
	if !p.LoseLease(b) {
		t.Error("LoseLease of a buffered delivery = false, want true")
	}
	if b.Begin() {
		t.Error("Begin after its lock was lost")
	}
	p.Settle(b, driver.Outcome{Kind: driver.Drop})
	c := <-p.Out()
	c.Begin()
	p.Settle(c, driver.Outcome{Kind: driver.Accept})
	if p.LoseLease(c) {
		t.Error("LoseLease of a settling or settled delivery = true, want false")
	}
}

// Goroutines a handler left behind, calling OnSettled for its delivery
// while it settles and after its entry holds the next delivery, never make
// a delivery's own function go unheard: a call that lands after the
// settlement began puts back what it replaced, and one for an earlier
// delivery never replaces a later one's.
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
		f := func(driver.Kind, error) { once.Do(func() { close(heard) }) }
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
		p.Settle(tk, driver.Outcome{Kind: driver.Accept})
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

type countMeter struct {
	mu                         sync.Mutex
	received, settled, dropped int
}

func (m *countMeter) Received()                  { m.mu.Lock(); m.received++; m.mu.Unlock() }
func (m *countMeter) Settled(driver.Kind, error) { m.mu.Lock(); m.settled++; m.mu.Unlock() }
func (m *countMeter) Dropped(n int)              { m.mu.Lock(); m.dropped += n; m.mu.Unlock() }

// A delivery whose lock is lost before a handler takes it reaches the
// Meter as dropped: received = settled + dropped on that path too.
func TestMeterHearsOfALockLostBeforeAHandler(t *testing.T) {
	src := fake.New(false, fake.Messages(3)...)
	m := &countMeter{}
	p := pump.New(pump.Config{Credit: 3, Meter: m})
	_, errc := start(t, p, attachTo(src))
	a, b, c := <-p.Out(), <-p.Out(), <-p.Out()
	if !p.LoseLease(b) { // buffered: dropped
		t.Fatal("LoseLease of a buffered delivery = false")
	}
	for _, tk := range []driver.Ticket{a, b, c} {
		if tk.Begin() {
			p.Settle(tk, driver.Outcome{Kind: driver.Accept})
		} else {
			p.Settle(tk, driver.Outcome{Kind: driver.Drop})
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

// leaseLog records what the pump tells its Leases.
type leaseLog struct {
	mu      sync.Mutex
	held    map[*driver.Delivery]driver.Ticket
	adds    int
	removes int
}

func (l *leaseLog) Add(t driver.Ticket) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.held[t.Entry()] = t
	l.adds++
}

func (*leaseLog) LostAnswer(error) bool { return false }

func (l *leaseLog) Remove(d *driver.Delivery) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if _, ok := l.held[d]; ok {
		delete(l.held, d)
		l.removes++
	}
}

// Leases hear of every delivery entering and leaving the book; a lost lock
// drops a delivery no handler has, and skips the settlement of one a
// handler has.
func TestLeasesAndLostLocks(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		src := fake.New(true, fake.Messages(10)...)
		leases := &leaseLog{held: map[*driver.Delivery]driver.Ticket{}}
		p := pump.New(pump.Config{Credit: 4, Leases: leases})
		cancel, errc := start(t, p, attachTo(src))
		synctest.Wait()
		inHandler := <-p.Out()
		if !inHandler.Begin() {
			t.Fatal("Begin refused")
		}
		waiting := <-p.Out()
		p.LoseLease(waiting)
		p.LoseLease(inHandler)
		synctest.Wait()
		if st := p.Stats(); st.LockLostDropped != 1 || st.Held != 4 {
			// 4 held: the dropped one made room for one more.
			t.Fatalf("after the lost locks: %+v", st)
		}
		if waiting.Begin() || waiting.State() != driver.Dropped {
			t.Fatalf("a delivery whose lock was lost can still be handled (%s)", waiting.State())
		}
		p.Settle(waiting, driver.Outcome{Kind: driver.Drop})
		p.Settle(inHandler, driver.Outcome{Kind: driver.Accept})
		for range 8 {
			p.Settle(<-p.Out(), driver.Outcome{Kind: driver.Accept})
		}
		synctest.Wait()
		st := p.Stats()
		if st.LockLostSkipped != 1 || st.Accepted != 8 || src.Count(fake.Accepted) != 8 || st.Held != 0 {
			t.Fatalf("stats %+v, broker accepted %d", st, src.Count(fake.Accepted))
		}
		leases.mu.Lock()
		if leases.adds != 10 || leases.removes != 10 || len(leases.held) != 0 {
			t.Fatalf("leases: %d added, %d removed, %d left", leases.adds, leases.removes, len(leases.held))
		}
		leases.mu.Unlock()
		cancel()
		<-errc
	})
}

// liveRemoves counts Leases.Remove calls for an entry that holds a live
// delivery (Buffered or Handling): the lease book would forget a delivery
// it must renew.
type liveRemoves struct{ n atomic.Int64 }

func (w *liveRemoves) Add(driver.Ticket)   {}
func (*liveRemoves) LostAnswer(error) bool { return false }
func (w *liveRemoves) Remove(d *driver.Delivery) {
	if s := d.State(); s == driver.Buffered || s == driver.Handling {
		w.n.Add(1)
	}
}

// LoseLease drops a buffered delivery and then queues its lost-lock note; a
// consumer that sees it dropped in between reclaims the entry, which the
// pump reuses for the next delivery before it applies the note. The note
// must not then remove the next delivery's lease.
func TestLoseLockRacingReclaimKeepsTheNextLease(t *testing.T) {
	src := fake.New(false)
	src.Recycle = true
	src.Push(fake.Messages(30000)...) // a dropped delivery does not come back
	leases := &liveRemoves{}
	p := pump.New(pump.Config{Credit: 8, Leases: leases})
	cancel, errc := start(t, p, attachTo(src))
	var wg sync.WaitGroup
	var handled atomic.Int64
	for range 4 {
		wg.Go(func() {
			for handled.Add(1) <= 20000 {
				tk := <-p.Out()
				lost := make(chan struct{})
				go func() { defer close(lost); p.LoseLease(tk) }() // the lease book's goroutine
				for tk.State() == driver.Buffered {
					runtime.Gosched()
				}
				if tk.Begin() {
					p.Settle(tk, driver.Outcome{Kind: driver.Accept})
				} else {
					p.Settle(tk, driver.Outcome{Kind: driver.Drop})
				}
				<-lost
			}
		})
	}
	wg.Wait()
	cancel()
	<-errc
	if n := leases.n.Load(); n > 0 {
		t.Fatalf("Leases.Remove called %d times for an entry holding a live delivery; stats %+v", n, p.Stats())
	}
	if st := p.Stats(); st.LockLostDropped == 0 {
		t.Fatalf("no lock lost while buffered: the race was not exercised; stats %+v", st)
	}
}

// A ticket's Stale may be called after its delivery was settled and its
// entry reused (a handler that kept its Delivery): it reads nothing the
// pump rewrites for the next delivery (a data race under -race before).
func TestStaleOfAnOldTicketDoesNotRace(t *testing.T) {
	src := fake.New(false)
	src.Recycle = true
	src.Push(fake.Messages(16)...)
	p := pump.New(pump.Config{Credit: 4})
	cancel, errc := start(t, p, attachTo(src))
	old := <-p.Out()
	p.Settle(old, driver.Outcome{Kind: driver.Accept})
	done := make(chan struct{})
	go func() {
		defer close(done)
		for range 20000 {
			p.Settle(<-p.Out(), driver.Outcome{Kind: driver.Accept})
		}
	}()
	for stale := false; !stale; {
		select {
		case <-done:
			stale = true
		default:
			if old.Stale() {
				t.Fatal("a ticket of the live link is stale")
			}
		}
	}
	cancel()
	<-errc
}
