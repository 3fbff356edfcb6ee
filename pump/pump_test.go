package pump_test

import (
	"context"
	"errors"
	"testing"
	"testing/synctest"

	"github.com/Azure/go-amqp"
	"go.uber.org/goleak"

	"github.com/amqpsub/amqpsub/credit"
	"github.com/amqpsub/amqpsub/internal/fake"
	"github.com/amqpsub/amqpsub/pump"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func attachTo(srcs ...pump.Source) pump.AttachFunc {
	i := 0
	return func(ctx context.Context, _ error) (pump.Source, error) {
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
		p.Settle(d, pump.Outcome{Kind: pump.Accept})
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
		inHandler := []pump.Ticket{<-p.Out(), <-p.Out()}
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
			p.Settle(d, pump.Outcome{Kind: pump.Accept})
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
		p.Settle(old, pump.Outcome{Kind: pump.Accept})
		n := 0
		for d := range p.Out() {
			if !d.Begin() {
				p.Settle(d, pump.Outcome{Kind: pump.Drop})
				continue
			}
			p.Settle(d, pump.Outcome{Kind: pump.Accept})
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
	err := p.Run(t.Context(), func(context.Context, error) (pump.Source, error) { return nil, boom })
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
			p.Settle(<-p.Out(), pump.Outcome{Kind: pump.Accept})
		}
		synctest.Wait()
		if g := p.Stats().Granted; g != 8 {
			t.Fatalf("granted %d with 5 of the window outstanding, want 8", g)
		}
		cancel()
		<-errc
	})
}
