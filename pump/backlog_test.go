package pump_test

import (
	"context"
	"errors"
	"testing"
	"testing/synctest"

	"github.com/amqpsub/amqpsub/internal/fake"
	"github.com/amqpsub/amqpsub/pump"
)

// While a delivery waits for room in Out (the broker sent past the
// credit), the settlements of the ones handed out still apply.
func TestSettlementsAppliedWhileADeliveryWaitsForOut(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		src := fake.New(true, fake.Messages(100)...)
		p := pump.New(pump.Config{Credit: 4})
		cancel, errc := start(t, p, attachTo(src))
		var taken []pump.Ticket
		for range 4 {
			taken = append(taken, <-p.Out())
		}
		src.Overshoot(5) // 4 fill Out, the 5th waits for room in it
		synctest.Wait()
		if st := p.Stats(); st.Held != 9 || len(p.Out()) != 4 {
			t.Fatalf("held %d, in Out %d; want 9 and 4", st.Held, len(p.Out()))
		}
		for _, d := range taken {
			p.Settle(d, pump.Outcome{Kind: pump.Accept})
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
		p.Settle(busy, pump.Outcome{Kind: pump.Accept})
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
		var first []pump.Ticket
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
			p.Settle(d, pump.Outcome{Kind: pump.Accept})
		}
		for range 200 - 8 {
			p.Settle(<-p.Out(), pump.Outcome{Kind: pump.Accept})
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
			p.Settle(<-p.Out(), pump.Outcome{Kind: pump.Accept})
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
