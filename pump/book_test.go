package pump_test

import (
	"context"
	"errors"
	"testing"
	"testing/synctest"

	"github.com/Azure/go-amqp"

	"github.com/amqpsub/amqpsub/internal/fake"
	"github.com/amqpsub/amqpsub/pump"
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
		if !p.Settle(d, pump.Outcome{Kind: pump.Accept}) {
			t.Fatal("first Settle refused")
		}
		if p.Settle(d, pump.Outcome{Kind: pump.Reject}) {
			t.Fatal("second Settle before the first was applied taken")
		}
		synctest.Wait()
		if p.Settle(d, pump.Outcome{Kind: pump.Reject}) {
			t.Fatal("second Settle after the first was applied taken")
		}
		// Every later delivery has an entry of its own, and is settled
		// once, with its own outcome.
		var held []pump.Ticket
		for range 4 {
			held = append(held, <-p.Out())
		}
		for _, e := range held {
			p.Settle(e, pump.Outcome{Kind: pump.Accept})
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
				p.Settle(d, pump.Outcome{Kind: pump.Accept})
			} else {
				stale++
				if d.State() != pump.Dropped {
					t.Fatalf("a stale delivery in state %s", d.State())
				}
				p.Settle(d, pump.Outcome{Kind: pump.Drop})
			}
		}
		p.Settle(busy, pump.Outcome{Kind: pump.Accept}) // its link is gone
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
