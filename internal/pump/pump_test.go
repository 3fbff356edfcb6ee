package pump_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/Azure/go-amqp"
	"go.uber.org/goleak"

	"github.com/amqpsub/amqpsub/internal/credit"
	"github.com/amqpsub/amqpsub/internal/driver"
	"github.com/amqpsub/amqpsub/internal/fake"
	"github.com/amqpsub/amqpsub/internal/pump"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func attachTo(srcs ...driver.Source) pump.AttachFunc {
	i := 0
	return func(ctx context.Context, _ error) (driver.Source, error) {
		if i == len(srcs) {
			<-ctx.Done()
			return nil, ctx.Err()
		}
		i++
		return srcs[i-1], nil
	}
}

func start(t *testing.T, p *pump.Pump, attach pump.AttachFunc) (context.CancelFunc, <-chan error) {
	t.Helper()
	ctx, cancel := context.WithCancel(t.Context())
	errc := make(chan error, 1)
	go func() { errc <- p.Run(ctx, attach) }()
	return cancel, errc
}

func TestEveryDeliveryIsSettledOnceAndHeldStaysWithinCredit(t *testing.T) {
	src := fake.New(true, fake.Messages(1000)...)
	p := pump.New(pump.Config{Credit: 16})
	_, errc := start(t, p, attachTo(src))
	for range 1000 {
		d := <-p.Out()
		p.Settle(d, driver.Outcome{Kind: driver.Accept})
	}
	p.Stop()
	if err := <-errc; !errors.Is(err, pump.ErrStopped) {
		t.Fatalf("Run = %v, want ErrStopped", err)
	}
	seen := map[*amqp.Message]int{}
	for _, s := range src.Settlements() {
		seen[s.Msg]++
		if s.Outcome != fake.Accepted {
			t.Fatalf("outcome %s", s.Outcome)
		}
	}
	if len(seen) != 1000 {
		t.Fatalf("%d distinct settled, want 1000", len(seen))
	}
	for _, n := range seen {
		if n != 1 {
			t.Fatal("a delivery was settled twice")
		}
	}
	st := p.Stats()
	if st.MaxHeld > 16 || st.Held != 0 || st.Received != 1000 || st.Accepted != 1000 {
		t.Fatalf("stats %+v", st)
	}
	if _, ok := <-p.Out(); ok {
		t.Fatal("Out not closed after Run returned")
	}
}

func TestStopReleasesBufferedAndSettlesInProgress(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		src := fake.New(true, fake.Messages(50)...)
		p := pump.New(pump.Config{Credit: 10})
		_, errc := start(t, p, attachTo(src))
		inHandler := []driver.Ticket{<-p.Out(), <-p.Out()}
		for _, d := range inHandler {
			if !d.Begin() {
				t.Fatal("Begin refused a fresh delivery")
			}
		}
		synctest.Wait()
		if st := p.Stats(); st.Held != 10 || st.Handling != 2 || st.Buffered != 8 {
			t.Fatalf("before stop %+v", st)
		}
		p.Stop()
		<-p.Released()
		if n := src.Count(fake.Released); n != 8 {
			t.Fatalf("released %d at stop, want the 8 buffered", n)
		}
		synctest.Wait()
		if n := src.Count(fake.Released); n != 8 {
			t.Fatalf("released %d after stop, want the 8 buffered", n)
		}
		select {
		case err := <-errc:
			t.Fatalf("Run returned %v with 2 deliveries in handlers", err)
		default:
		}
		for _, d := range inHandler {
			p.Settle(d, driver.Outcome{Kind: driver.Accept})
		}
		if err := <-errc; !errors.Is(err, pump.ErrStopped) {
			t.Fatalf("Run = %v", err)
		}
		if n := src.Count(fake.Accepted); n != 2 {
			t.Fatalf("accepted %d, want 2", n)
		}
	})
}

func TestLostLinkIsReplacedAndItsDeliveriesAreStale(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		first := fake.New(true, fake.Messages(3)...)
		second := fake.New(true, fake.Messages(3)...)
		p := pump.New(pump.Config{Credit: 4})
		_, errc := start(t, p, attachTo(first, second))
		old := <-p.Out()
		old.Begin() // in a handler when the link is lost
		synctest.Wait()
		first.Fail(fake.ErrLinkLost)
		synctest.Wait()
		if !old.Stale() {
			t.Fatal("delivery of the lost link not stale")
		}
		// Settling it frees its entry without touching either link; the
		// other two of the first link were dropped, unhandled.
		p.Settle(old, driver.Outcome{Kind: driver.Accept})
		n := 0
		for d := range p.Out() {
			if !d.Begin() {
				p.Settle(d, driver.Outcome{Kind: driver.Drop})
				continue
			}
			p.Settle(d, driver.Outcome{Kind: driver.Accept})
			if n++; n == 3 {
				p.Stop()
			}
		}
		if err := <-errc; !errors.Is(err, pump.ErrStopped) {
			t.Fatalf("Run = %v", err)
		}
		st := p.Stats()
		if st.Links != 2 || st.LinksLost != 1 || st.Held != 0 || st.Accepted != 3 || st.Stale != 1 || st.Dropped != 2 {
			t.Fatalf("stats %+v", st)
		}
		if second.Count(fake.Accepted) != 3 || first.Count(fake.Accepted) != 0 {
			t.Fatalf("accepted first %d second %d", first.Count(fake.Accepted), second.Count(fake.Accepted))
		}
	})
}

func TestAttachErrorEndsRun(t *testing.T) {
	boom := errors.New("auth refused")
	p := pump.New(pump.Config{Credit: 1})
	err := p.Run(t.Context(), func(context.Context, error) (driver.Source, error) { return nil, boom })
	if !errors.Is(err, boom) {
		t.Fatalf("Run = %v", err)
	}
}

func TestStopDuringAttachReturns(t *testing.T) {
	p := pump.New(pump.Config{Credit: 1})
	_, errc := start(t, p, attachTo())
	p.Stop()
	p.Stop() // idempotent
	if err := <-errc; !errors.Is(err, pump.ErrStopped) {
		t.Fatalf("Run = %v", err)
	}
}

func TestWindowedModeGrantsOnlyAfterTheWindowArrived(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		src := fake.New(false, fake.Messages(3)...)
		p := pump.New(pump.Config{Credit: 8, Mode: credit.Windowed})
		cancel, errc := start(t, p, attachTo(src))
		for range 3 {
			p.Settle(<-p.Out(), driver.Outcome{Kind: driver.Accept})
		}
		synctest.Wait()
		if g := p.Stats().Granted; g != 8 {
			t.Fatalf("granted %d with 5 of the window outstanding, want 8", g)
		}
		cancel()
		<-errc
	})
}

// A stop takes the broker's credit back (drain): the deliveries it releases
// are not sent straight back to the same link, released again and so on
// until the credit is spent.
func TestStopDrainsTheCredit(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		src := fake.New(true, fake.Messages(10)...)
		p := pump.New(pump.Config{Credit: 256})
		_, errc := start(t, p, attachTo(src))
		first := <-p.Out()
		synctest.Wait() // all 10 received: 9 wait in Out
		p.Stop()
		p.Settle(first, driver.Outcome{Kind: driver.Accept})
		if err := <-errc; !errors.Is(err, pump.ErrStopped) {
			t.Fatalf("Run = %v", err)
		}
		// The drain runs beside the releases: each released delivery may
		// come back once before it lands, never more.
		if st := p.Stats(); st.Received > 19 || src.Credit() != 0 || src.Count(fake.Released) > 18 || src.Queued() != 9 {
			t.Fatalf("received %d, released %d, credit left %d, queued %d", st.Received, src.Count(fake.Released), src.Credit(), src.Queued())
		}
	})
}

// Deliveries the receive loop took in after the last held one was settled
// at a stop are released at the link's end, and counted like any other.
func TestReleasesAtTheLinksEndAreCounted(t *testing.T) {
	for range 100 {
		synctest.Test(t, func(t *testing.T) {
			src := fake.New(true, fake.Messages(1)...)
			p := pump.New(pump.Config{Credit: 8})
			_, errc := start(t, p, attachTo(src))
			tk := <-p.Out()
			tk.Begin()
			p.Stop()
			<-p.Released()
			synctest.Wait()
			src.IssueCredit(1) // the drain took the credit back: give the fake room for one more
			src.Push(fake.Messages(1)...)
			p.Settle(tk, driver.Outcome{Kind: driver.Accept})
			<-errc
			st := p.Stats()
			if got := uint64(src.Count(fake.Released)); got != st.Released || st.Received != 1+got {
				t.Fatalf("broker saw %d released; stats %+v", got, st)
			}
		})
	}
}

// Under MaxHeldBytes the pump holds about the budget's worth of large
// deliveries, not the credit's; one larger than the whole budget still
// flows, alone; and everything arrives in order.
func TestByteBudgetBoundsWhatIsHeld(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		const mib = 1 << 20
		msgs := fake.Messages(40)
		for i, m := range msgs {
			size := mib
			if i == 20 {
				size = 10 * mib // past the budget
			}
			m.Data = [][]byte{make([]byte, size)}
		}
		src := fake.New(true, msgs...)
		p := pump.New(pump.Config{Credit: 256, MaxHeldBytes: 4 * mib})
		cancel, errc := start(t, p, attachTo(src))
		defer func() { cancel(); <-errc }()
		var held []driver.Ticket
		for next := 0; next < 40; {
			synctest.Wait() // the pump took what the credit let the fake send
			// The budget, passed at most by one delivery that came on
			// credit granted before its size was seen.
			if st := p.Stats(); st.BytesHeld > 4*mib+10*mib || st.Held > 4 {
				t.Fatalf("held %d deliveries of %d bytes", st.Held, st.BytesHeld)
			}
			for len(p.Out()) > 0 {
				tk := <-p.Out()
				if v := tk.Message().Value.(int); v != next {
					t.Fatalf("got %d, want %d", v, next)
				}
				next++
				held = append(held, tk)
			}
			if len(held) == 0 {
				t.Fatalf("stalled at %d: %+v", next, p.Stats())
			}
			for _, tk := range held {
				p.Settle(tk, driver.Outcome{Kind: driver.Accept})
			}
			held = held[:0]
		}
		synctest.Wait()
		if st := p.Stats(); st.Accepted != 40 || st.MaxHeld > 4 || st.BytesHeld != 0 {
			t.Fatalf("stats %+v", st)
		}
	})
}

// LeasesOutliveLinks: a lost link leaves its deliveries held. Those buffered
// still go out (Begin takes them), the one in a handler is settled when
// its handler is done, and every settlement goes to the source the
// delivery came from; the next link gets only the credit they leave.
func TestKeepAcrossLinksSettlesWhatALostLinkHeld(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		first := fake.New(true, fake.Messages(3)...)
		first.KeepLocks = true
		second := fake.New(true, fake.Messages(3)...)
		p := pump.New(pump.Config{Credit: 4, Settlers: 2, LeasesOutliveLinks: true})
		_, errc := start(t, p, attachTo(first, second))
		old := <-p.Out()
		old.Begin() // in a handler when the link is lost
		synctest.Wait()
		first.Fail(fake.ErrLinkLost)
		synctest.Wait()
		if old.Stale() {
			t.Fatal("a delivery of the lost link is stale under LeasesOutliveLinks")
		}
		// The new link was given the one credit the kept three left, and
		// has sent one delivery with it.
		if st := p.Stats(); st.Held != 4 || st.Dropped != 0 || second.Credit() != 0 || second.Queued() != 2 {
			t.Fatalf("after the loss: held %d, dropped %d, the new link's credit %d, queued %d; want 4, 0, 0, 2",
				st.Held, st.Dropped, second.Credit(), second.Queued())
		}
		p.Settle(old, driver.Outcome{Kind: driver.Accept})
		n := 0
		for d := range p.Out() {
			if !d.Begin() {
				t.Fatalf("Begin refused a delivery under LeasesOutliveLinks")
			}
			p.Settle(d, driver.Outcome{Kind: driver.Accept})
			if n++; n == 5 {
				p.Stop()
			}
		}
		if err := <-errc; !errors.Is(err, pump.ErrStopped) {
			t.Fatalf("Run = %v", err)
		}
		st := p.Stats()
		if st.Held != 0 || st.Accepted != 6 || st.Stale != 0 || st.Dropped != 0 {
			t.Fatalf("stats %+v", st)
		}
		if first.Count(fake.Accepted) != 3 || second.Count(fake.Accepted) != 3 {
			t.Fatalf("accepted by the first link's broker %d, the second's %d; want 3 and 3",
				first.Count(fake.Accepted), second.Count(fake.Accepted))
		}
	})
}

// SettleInOrder: the settlements of one key reach the broker in the order
// they were given, each after the one before was answered, while other
// keys' go out beside them.
func TestSettleInOrderKeepsAKeysOrder(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		const n = 32
		src := fake.New(true, fake.Messages(n)...)
		var mu sync.Mutex
		outstanding, most := 0, 0
		src.SettleErr = func(ctx context.Context, m *amqp.Message) error {
			mu.Lock()
			outstanding++
			most = max(most, outstanding)
			mu.Unlock()
			defer func() { mu.Lock(); outstanding--; mu.Unlock() }()
			// The earlier a message, the longer its answer takes.
			timer := time.NewTimer(time.Duration(n-m.Value.(int)) * time.Millisecond)
			defer timer.Stop()
			select {
			case <-timer.C:
				return nil
			case <-ctx.Done():
				return ctx.Err()
			}
		}
		p := pump.New(pump.Config{Credit: n, Settlers: 8})
		cancel, errc := start(t, p, attachTo(src))
		for range n {
			d := <-p.Out()
			p.SettleInOrder(d, driver.Outcome{Kind: driver.Accept}, uint64(d.Message().Value.(int)%2))
		}
		for src.Count(fake.Accepted) < n {
			time.Sleep(time.Millisecond)
		}
		cancel()
		<-errc
		last := [2]int{-1, -1}
		for _, s := range src.Settlements() {
			i := s.Msg.Value.(int)
			if i < last[i%2] {
				t.Fatalf("key %d: message %d settled after message %d", i%2, i, last[i%2])
			}
			last[i%2] = i
		}
		if most != 2 {
			t.Fatalf("at most %d settlements outstanding at once; want 2 (one per key)", most)
		}
	})
}

// drainOrder wraps a fake source and records, in order, the drain and the
// releases the pump sends at a stop.
type drainOrder struct {
	*fake.Source
	mu  sync.Mutex
	log []string
}

func (s *drainOrder) DrainCredit(context.Context, *amqp.DrainCreditOptions) error {
	s.mu.Lock()
	s.log = append(s.log, "drain")
	s.mu.Unlock()
	return nil
}

func (s *drainOrder) ReleaseMessage(ctx context.Context, m *amqp.Message) error {
	s.mu.Lock()
	s.log = append(s.log, "release")
	s.mu.Unlock()
	return s.Source.ReleaseMessage(ctx, m)
}

// At a stop the pump drains the link's credit before it releases the
// buffered deliveries, so that the broker does not send them straight back
// to a link that still has credit: in every one of 200 stops the drain is
// the first thing the link hears, before any release.
func TestDrainComesBeforeTheReleases(t *testing.T) {
	const runs = 200
	late := 0
	for range runs {
		src := &drainOrder{Source: fake.New(false, fake.Messages(8)...)}
		p := pump.New(pump.Config{Credit: 8})
		cancel, errc := start(t, p, attachTo(src))
		first := <-p.Out() // in a handler
		first.Begin()
		for p.Stats().Received < 8 {
		}
		p.Stop()
		<-p.Released()
		p.Settle(first, driver.Outcome{Kind: driver.Accept})
		if err := <-errc; !errors.Is(err, pump.ErrStopped) {
			t.Fatalf("Run = %v", err)
		}
		cancel()
		src.mu.Lock()
		if len(src.log) == 0 || src.log[0] != "drain" {
			late++
		}
		src.mu.Unlock()
	}
	if late > 0 {
		t.Fatalf("%d of %d stops released deliveries on a link not yet drained", late, runs)
	}
}

// Under NoDrain (a broker that requeues on a drain what the link holds
// unsettled, handlers' deliveries too) neither Stop nor Hold drains: the
// stop releases what is buffered, what the broker sends back on the
// credit it still has is released again, and the delivery in a handler is
// settled as its handler says.
func TestNoDrainNeverDrains(t *testing.T) {
	for _, hold := range []bool{false, true} {
		t.Run(fmt.Sprintf("hold=%v", hold), func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				src := &drainOrder{Source: fake.New(true, fake.Messages(10)...)}
				p := pump.New(pump.Config{Credit: 16, NoDrain: true})
				_, errc := start(t, p, attachTo(src))
				first := <-p.Out()
				first.Begin()
				synctest.Wait() // all 10 received: 9 wait in Out
				if hold {
					p.Hold() // what Hold does with a drain, it must not do here
					synctest.Wait()
				}
				p.Stop()
				<-p.Released()
				p.Settle(first, driver.Outcome{Kind: driver.Accept})
				if err := <-errc; !errors.Is(err, pump.ErrStopped) {
					t.Fatalf("Run = %v", err)
				}
				src.mu.Lock()
				defer src.mu.Unlock()
				if slices.Contains(src.log, "drain") {
					t.Fatalf("the link was drained: %v", src.log)
				}
				// 9 released, sent back on the 6 credits left and
				// released again: at most 15 releases, 16 received.
				st := p.Stats()
				if src.Count(fake.Accepted) != 1 || src.Queued() != 9 || st.Received > 16 || src.Count(fake.Released) < 9 {
					t.Fatalf("accepted %d, queued %d, released %d; stats %+v", src.Count(fake.Accepted), src.Queued(), src.Count(fake.Released), st)
				}
			})
		})
	}
}

// While a delivery waits for room in Out (the broker sent past the
// credit), the settlements of the ones handed out still apply.
func TestSettlementsAppliedWhileADeliveryWaitsForOut(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		src := fake.New(true, fake.Messages(100)...)
		p := pump.New(pump.Config{Credit: 4})
		cancel, errc := start(t, p, attachTo(src))
		var taken []driver.Ticket
		for range 4 {
			taken = append(taken, <-p.Out())
		}
		src.Overshoot(5) // 4 fill Out, the 5th waits for room in it
		synctest.Wait()
		if st := p.Stats(); st.Held != 9 || len(p.Out()) != 4 {
			t.Fatalf("held %d, in Out %d; want 9 and 4", st.Held, len(p.Out()))
		}
		for _, d := range taken {
			p.Settle(d, driver.Outcome{Kind: driver.Accept})
		}
		synctest.Wait()
		if n := src.Count(fake.Accepted); n != 4 {
			t.Fatalf("accepted %d, want 4 while a delivery waits for room in Out", n)
		}
		cancel()
		if err := <-errc; !errors.Is(err, context.Canceled) {
			t.Fatalf("Run = %v", err)
		}
	})
}

func TestStopReleasesWhatArrivesAfterIt(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		src := fake.New(true, fake.Messages(50)...)
		p := pump.New(pump.Config{Credit: 10})
		_, errc := start(t, p, attachTo(src))
		busy := <-p.Out()
		busy.Begin()
		synctest.Wait()
		p.Stop()
		<-p.Released()
		src.Overshoot(3) // in flight when Stop took effect
		synctest.Wait()
		if n := src.Count(fake.Released); n != 9+3 {
			t.Fatalf("released %d, want the 9 buffered and the 3 that arrived after Stop", n)
		}
		p.Settle(busy, driver.Outcome{Kind: driver.Accept})
		if err := <-errc; !errors.Is(err, pump.ErrStopped) {
			t.Fatalf("Run = %v", err)
		}
		if n := src.Count(fake.Accepted); n != 1 {
			t.Fatalf("accepted %d, want 1", n)
		}
	})
}

func TestOvershootIsCountedAndDoesNotStall(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		src := fake.New(false, fake.Messages(200)...)
		p := pump.New(pump.Config{Credit: 8})
		_, errc := start(t, p, attachTo(src))
		var first []driver.Ticket
		for range 8 {
			first = append(first, <-p.Out())
		}
		synctest.Wait()  // the credit is used up
		src.Overshoot(5) // only now: the fake sends 5 past it
		synctest.Wait()
		if st := p.Stats(); st.Overshoot != 5 || !st.Windowed || st.Held != 13 {
			t.Fatalf("after overshoot: %+v", st)
		}
		for _, d := range first {
			p.Settle(d, driver.Outcome{Kind: driver.Accept})
		}
		for range 200 - 8 {
			p.Settle(<-p.Out(), driver.Outcome{Kind: driver.Accept})
		}
		p.Stop()
		if err := <-errc; !errors.Is(err, pump.ErrStopped) {
			t.Fatalf("Run = %v", err)
		}
		st := p.Stats()
		if st.Accepted != 200 || st.MaxHeld != 13 || st.Held != 0 {
			t.Fatalf("stats %+v", st)
		}
	})
}

func TestEveryOvershootIsCounted(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		src := fake.New(false, fake.Messages(100)...)
		p := pump.New(pump.Config{Credit: 8})
		cancel, errc := start(t, p, attachTo(src))
		synctest.Wait() // the first 8 arrived within the credit
		src.Overshoot(5)
		synctest.Wait()
		if st := p.Stats(); st.Overshoot != 5 || st.MaxHeld != 13 {
			t.Fatalf("after the first overshoot: %+v", st)
		}
		for range 13 {
			p.Settle(<-p.Out(), driver.Outcome{Kind: driver.Accept})
		}
		synctest.Wait()
		src.Overshoot(2)
		synctest.Wait()
		if st := p.Stats(); st.Overshoot != 7 || st.MaxHeld != 13 || st.Held != 10 {
			t.Fatalf("after the second overshoot: %+v", st)
		}
		cancel()
		<-errc
	})
}

// Hold takes the credit back but hands on what is held, so that every
// delivery buffered at a stop is settled by a consumer rather than
// released; Emptied says when nothing is left, and the Stop after it
// releases nothing.
func TestHoldFinishesWhatIsBufferedWithoutReleasing(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		src := fake.New(true, fake.Messages(40)...)
		p := pump.New(pump.Config{Credit: 16})
		_, errc := start(t, p, attachTo(src))
		first := <-p.Out()
		synctest.Wait() // 16 received: 15 wait in Out
		p.Hold()
		synctest.Wait()
		if src.Credit() != 0 {
			t.Fatalf("credit left after Hold: %d", src.Credit())
		}
		p.Settle(first, driver.Outcome{Kind: driver.Accept})
		for range 15 {
			select {
			case <-p.Emptied():
				t.Fatal("Emptied closed while deliveries are held")
			default:
			}
			tk := <-p.Out()
			p.Settle(tk, driver.Outcome{Kind: driver.Accept})
		}
		<-p.Emptied()
		synctest.Wait()
		if st := p.Stats(); st.Received != 16 || st.Accepted != 16 || st.Released != 0 {
			t.Fatalf("after Hold: %+v (no credit may be granted, nothing released)", st)
		}
		p.Stop()
		if err := <-errc; !errors.Is(err, pump.ErrStopped) {
			t.Fatalf("Run = %v", err)
		}
		if n := src.Count(fake.Released); n != 0 || src.Queued() != 24 {
			t.Fatalf("released %d, queued %d; want 0 and 24", n, src.Queued())
		}
	})
}

// Deliveries still held when Stop follows Hold are released as by Stop
// alone.
func TestStopAfterHoldReleasesWhatIsLeft(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		src := fake.New(true, fake.Messages(10)...)
		p := pump.New(pump.Config{Credit: 8})
		_, errc := start(t, p, attachTo(src))
		first := <-p.Out()
		synctest.Wait()
		p.Hold()
		synctest.Wait()
		p.Stop()
		<-p.Released()
		p.Settle(first, driver.Outcome{Kind: driver.Accept})
		if err := <-errc; !errors.Is(err, pump.ErrStopped) {
			t.Fatalf("Run = %v", err)
		}
		if st := p.Stats(); st.Accepted != 1 || st.Released != 7 {
			t.Fatalf("stats %+v, want 1 accepted and 7 released", st)
		}
		select {
		case <-p.Emptied():
		default:
			t.Fatal("Emptied not closed after Run returned")
		}
	})
}

// An idle link after one delivery does not keep the pump ticking: in
// Windowed mode the flow owed after the last settlement cannot go out
// while the window is out, and the pump does not wake every 10 ms for it.
func TestAnIdleLinkDoesNotTick(t *testing.T) {
	for _, mode := range []credit.Mode{credit.Continuous, credit.Windowed} {
		t.Run(mode.String(), func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				var loops atomic.Int64
				src := fake.New(true, fake.Messages(1)...)
				p := pump.New(pump.Config{Credit: 256, Mode: mode, AdaptiveFloor: 4,
					Parked: func(time.Time) int { loops.Add(1); return 0 }}) // once a loop
				cancel, errc := start(t, p, attachTo(src))
				d := <-p.Out()
				d.Begin()
				p.Settle(d, driver.Outcome{Kind: driver.Accept})
				time.Sleep(5 * time.Second) // the flow owed, the limit back at its floor
				synctest.Wait()
				before := loops.Load()
				time.Sleep(10 * time.Second)
				synctest.Wait()
				n := loops.Load() - before
				cancel()
				<-errc
				if n > 10 {
					t.Errorf("the pump looped %d times in 10 s on an idle link", n)
				}
			})
		})
	}
}

// creditRefused is a source whose first IssueCredit adds the credit, lets
// the receive loop take what it brings, and then fails, as go-amqp's does
// while a drain is pending; prefetch, when set, is what came on that
// credit that no Receive took (go-amqp's Prefetched).
type creditRefused struct {
	*fake.Source
	calls    int
	prefetch []*amqp.Message
}

func (s *creditRefused) IssueCredit(n uint32) error {
	if err := s.Source.IssueCredit(n); err != nil {
		return err
	}
	if s.calls++; s.calls > 1 {
		return nil
	}
	for s.Queued() > 0 { // until the receive loop has taken the deliveries
		time.Sleep(time.Microsecond)
	}
	return errors.New("link is currently draining, no credits can be added")
}

// Prefetched hands out prefetch, then nil.
func (s *creditRefused) Prefetched() *amqp.Message {
	if len(s.prefetch) == 0 {
		return nil
	}
	m := s.prefetch[0]
	s.prefetch = s.prefetch[1:]
	return m
}

// LeasesOutliveLinks: a link that fails to take credit ends, and what its
// receive loop had taken and the pump had not yet seen, and what the link
// had prefetched, is held like the rest of what it brought, not dropped:
// the broker keeps those locks too. Each is settled through the source it
// came on.
func TestKeepAcrossLinksKeepsWhatTheReceiveLoopHadAtTheEnd(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		first := &creditRefused{Source: fake.New(true, fake.Messages(3)...), prefetch: fake.Messages(2)}
		first.KeepLocks = true
		second := fake.New(true)
		p := pump.New(pump.Config{Credit: 8, Settlers: 2, LeasesOutliveLinks: true})
		_, errc := start(t, p, attachTo(first, second))
		time.Sleep(time.Second)
		synctest.Wait()
		if st := p.Stats(); st.Held != 5 || st.Dropped != 0 || st.LinksLost != 1 {
			t.Fatalf("after the refused credit: held %d, dropped %d, links lost %d; want 5, 0, 1", st.Held, st.Dropped, st.LinksLost)
		}
		for range 5 {
			d := <-p.Out()
			if !d.Begin() {
				t.Fatal("Begin refused a delivery under LeasesOutliveLinks")
			}
			p.Settle(d, driver.Outcome{Kind: driver.Accept})
		}
		synctest.Wait()
		p.Stop()
		if err := <-errc; !errors.Is(err, pump.ErrStopped) {
			t.Fatalf("Run = %v", err)
		}
		if st := p.Stats(); st.Accepted != 5 || st.Dropped != 0 || first.Count(fake.Accepted) != 5 || st.LinksLost != 1 {
			t.Fatalf("accepted %d (through the first link %d), dropped %d, links lost %d; want 5, 5, 0, 1",
				st.Accepted, first.Count(fake.Accepted), st.Dropped, st.LinksLost)
		}
	})
}

// LeasesOutliveLinks with DropBufferedOn saying that the source's end took
// the broker's hold with it (a lost connection on Service Bus): nothing
// buffered goes to a consumer after that, neither what waits in Out nor
// what the receive loop had; what a handler has stays held and is settled
// through its source.
func TestDropBufferedOnDropsWhatNoHandlerHas(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		connLost := errors.New("connection lost")
		first := fake.New(true, fake.Messages(4)...)
		first.KeepLocks = true
		second := fake.New(true)
		var told []error
		p := pump.New(pump.Config{Credit: 4, Settlers: 2, LeasesOutliveLinks: true,
			DropBufferedOn: func(err error) bool { told = append(told, err); return errors.Is(err, connLost) }})
		_, errc := start(t, p, attachTo(first, second))
		synctest.Wait()
		inHandler := <-p.Out()
		if !inHandler.Begin() {
			t.Fatal("Begin refused")
		}
		first.Fail(connLost)
		synctest.Wait()
		if st := p.Stats(); st.Held != 1 || st.Dropped != 3 || st.LinksLost != 1 {
			t.Fatalf("after the loss: held %d, dropped %d, links lost %d; want 1, 3, 1", st.Held, st.Dropped, st.LinksLost)
		}
		for range 3 {
			d := <-p.Out()
			if d.Begin() {
				t.Fatal("a delivery buffered at the loss went to a handler")
			}
			p.Settle(d, driver.Outcome{Kind: driver.Drop})
		}
		p.Settle(inHandler, driver.Outcome{Kind: driver.Accept})
		synctest.Wait()
		p.Stop()
		if err := <-errc; !errors.Is(err, pump.ErrStopped) {
			t.Fatalf("Run = %v", err)
		}
		if st := p.Stats(); st.Accepted != 1 || first.Count(fake.Accepted) != 1 || st.Dropped != 3 {
			t.Fatalf("accepted %d (through the first link %d), dropped %d; want 1, 1, 3", st.Accepted, first.Count(fake.Accepted), st.Dropped)
		}
		for _, err := range told {
			if !errors.Is(err, connLost) {
				t.Fatalf("DropBufferedOn told %v, want the loss only", told)
			}
		}
		if len(told) == 0 {
			t.Fatal("DropBufferedOn was not asked")
		}
	})
}
