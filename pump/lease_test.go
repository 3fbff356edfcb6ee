package pump_test

import (
	"context"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/Azure/go-amqp"

	"github.com/amqpsub/amqpsub/internal/fake"
	"github.com/amqpsub/amqpsub/pump"
)

// With receiver settle mode second every settlement waits a round trip;
// settlers keep many in flight, so the pump is not capped at one per round
// trip.
func TestSettlersKeepSettlementsInFlight(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		const n, rtt = 1000, 5 * time.Millisecond
		src := fake.New(true, fake.Messages(n)...)
		src.SettleDelay = rtt
		p := pump.New(pump.Config{Credit: 64, Settlers: 16})
		cancel, errc := start(t, p, attachTo(src))
		begin := time.Now()
		for range n {
			p.Settle(<-p.Out(), pump.Outcome{Kind: pump.Accept})
		}
		for src.Count(fake.Accepted) < n {
			time.Sleep(rtt)
		}
		took := time.Since(begin)
		// One at a time: n × rtt = 5 s. Sixteen at a time: about n/16 × rtt.
		if took > n*rtt/10 {
			t.Fatalf("%d settlements of %v each took %v", n, rtt, took)
		}
		synctest.Wait()
		if st := p.Stats(); st.Accepted != n || st.Held != 0 || st.MaxHeld > 64 {
			t.Fatalf("stats %+v", st)
		}
		cancel()
		<-errc
	})
}

// A settlement the broker answers late is bounded by SettleTimeout and
// counted; one answered with lock-lost is counted, not retried.
func TestSettlementsAnsweredLateOrWithLockLost(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		msgs := fake.Messages(3)
		src := fake.New(true, msgs...)
		src.SettleErr = func(ctx context.Context, m *amqp.Message) error {
			switch m {
			case msgs[1]:
				return &amqp.Error{Condition: pump.ErrCondLockLost, Description: "the lock supplied is invalid"}
			case msgs[2]:
				<-ctx.Done() // never answered
				return ctx.Err()
			}
			return nil
		}
		p := pump.New(pump.Config{Credit: 4, Settlers: 2, SettleTimeout: time.Second})
		cancel, errc := start(t, p, attachTo(src))
		for range 3 {
			p.Settle(<-p.Out(), pump.Outcome{Kind: pump.Accept})
		}
		time.Sleep(2 * time.Second)
		synctest.Wait()
		st := p.Stats()
		if st.Accepted != 1 || st.LockLostAnswers != 1 || st.SettleTimeouts != 1 || st.Held != 0 {
			t.Fatalf("stats %+v", st)
		}
		cancel()
		<-errc
	})
}

// leaseLog records what the pump tells its Leases.
type leaseLog struct {
	mu      sync.Mutex
	held    map[*pump.Delivery]pump.Ticket
	adds    int
	removes int
}

func (l *leaseLog) Add(t pump.Ticket) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.held[t.Entry()] = t
	l.adds++
}

func (l *leaseLog) Remove(d *pump.Delivery) {
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
		leases := &leaseLog{held: map[*pump.Delivery]pump.Ticket{}}
		p := pump.New(pump.Config{Credit: 4, Leases: leases})
		cancel, errc := start(t, p, attachTo(src))
		synctest.Wait()
		inHandler := <-p.Out()
		if !inHandler.Begin() {
			t.Fatal("Begin refused")
		}
		waiting := <-p.Out()
		p.LoseLock(waiting)
		p.LoseLock(inHandler)
		synctest.Wait()
		if st := p.Stats(); st.LockLostDropped != 1 || st.Held != 4 {
			// 4 held: the dropped one made room for one more.
			t.Fatalf("after the lost locks: %+v", st)
		}
		if waiting.Begin() || waiting.State() != pump.Dropped {
			t.Fatalf("a delivery whose lock was lost can still be handled (%s)", waiting.State())
		}
		p.Settle(waiting, pump.Outcome{Kind: pump.Drop})
		p.Settle(inHandler, pump.Outcome{Kind: pump.Accept})
		for range 8 {
			p.Settle(<-p.Out(), pump.Outcome{Kind: pump.Accept})
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

func (w *liveRemoves) Add(pump.Ticket) {}
func (w *liveRemoves) Remove(d *pump.Delivery) {
	if s := d.State(); s == pump.Buffered || s == pump.Handling {
		w.n.Add(1)
	}
}

// LoseLock drops a buffered delivery and then queues its lost-lock note; a
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
				go func() { defer close(lost); p.LoseLock(tk) }() // the lease book's goroutine
				for tk.State() == pump.Buffered {
					runtime.Gosched()
				}
				if tk.Begin() {
					p.Settle(tk, pump.Outcome{Kind: pump.Accept})
				} else {
					p.Settle(tk, pump.Outcome{Kind: pump.Drop})
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
	p.Settle(old, pump.Outcome{Kind: pump.Accept})
	done := make(chan struct{})
	go func() {
		defer close(done)
		for range 20000 {
			p.Settle(<-p.Out(), pump.Outcome{Kind: pump.Accept})
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
