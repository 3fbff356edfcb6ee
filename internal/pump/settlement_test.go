package pump_test

import (
	"context"
	"errors"
	"slices"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/Azure/go-amqp"

	"github.com/amqpsub/amqpsub/internal/driver"
	"github.com/amqpsub/amqpsub/internal/fake"
	"github.com/amqpsub/amqpsub/internal/pump"
)

// An unordered settlement goes to an idle settler: one the broker never
// answers (until SettleTimeout, 30 s) holds up no other.
func TestUnorderedSettlementsDoNotWaitBehindAStuckOne(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		const n = 8
		src := fake.New(true, fake.Messages(n)...)
		src.SettleErr = func(ctx context.Context, m *amqp.Message) error {
			if m.Value.(int) == 0 { // the service never answers this one
				<-ctx.Done()
				return ctx.Err()
			}
			return nil
		}
		p := pump.New(pump.Config{Credit: n, Settlers: 4, SettleTimeout: 30 * time.Second})
		cancel, errc := start(t, p, attachTo(src))
		for range n {
			d := <-p.Out()
			p.Settle(d, driver.Outcome{Kind: driver.Accept}) // unordered
		}
		time.Sleep(time.Second)
		synctest.Wait()
		got := src.Count(fake.Accepted)
		var late []int
		accepted := map[int]bool{}
		for _, s := range src.Settlements() {
			accepted[s.Msg.Value.(int)] = true
		}
		for i := 1; i < n; i++ {
			if !accepted[i] {
				late = append(late, i)
			}
		}
		t.Logf("1 s after the settlements: %d of the %d answerable accepts reached the broker; still waiting: %v; held %d",
			got, n-1, late, p.Stats().Held)
		cancel()
		<-errc
		if got != n-1 {
			t.Fatalf("unordered settlements %v wait behind one unanswered settlement while 3 settlers are idle", late)
		}
	})
}

// Without LeasesOutliveLinks (Service Bus sessions), a settlement still
// queued for a settler when its link is lost is skipped as stale, not sent
// on the dead link: Stale counts it, and OnSettled hears ErrNotSent.
func TestASettlementQueuedWhenItsLinkIsLostIsStale(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		first := fake.New(true, fake.Messages(2)...)
		second := fake.New(true)
		release := make(chan struct{})
		first.SettleErr = func(ctx context.Context, m *amqp.Message) error {
			if m.Value.(int) == 0 {
				select {
				case <-release:
				case <-ctx.Done():
				}
			}
			return nil
		}
		p := pump.New(pump.Config{Credit: 4, Settlers: 1})
		cancel, errc := start(t, p, attachTo(first, second))
		a, b := <-p.Out(), <-p.Out()
		var mu sync.Mutex
		var heard error
		b.OnSettled(func(_ driver.Kind, err error) { mu.Lock(); heard = err; mu.Unlock() })
		p.Settle(a, driver.Outcome{Kind: driver.Accept})
		p.Settle(b, driver.Outcome{Kind: driver.Accept})
		synctest.Wait()
		first.Fail(fake.ErrLinkLost)
		synctest.Wait()
		close(release)
		synctest.Wait()
		st := p.Stats()
		mu.Lock()
		t.Logf("stale %d, settle errors %d; OnSettled of the queued one heard %v", st.Stale, st.SettleErrors, heard)
		h := heard
		mu.Unlock()
		cancel()
		<-errc
		if st.Stale != 1 || !errors.Is(h, driver.ErrNotSent) {
			t.Fatalf("a settlement queued for a settler when its link was lost: stale %d (want 1), OnSettled %v (want ErrNotSent)", st.Stale, h)
		}
	})
}

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
			p.Settle(<-p.Out(), driver.Outcome{Kind: driver.Accept})
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

// lostLeaseCond is the condition the broker of the tests below answers a
// settlement with when the delivery's lease is gone.
const lostLeaseCond amqp.ErrCond = "test:lease-lost"

// lostOnCond are Leases that keep nothing and read lostLeaseCond as a lost
// lease.
type lostOnCond struct{}

func (lostOnCond) Add(driver.Ticket)       {}
func (lostOnCond) Remove(*driver.Delivery) {}
func (lostOnCond) LostAnswer(err error) bool {
	var ae *amqp.Error
	return errors.As(err, &ae) && ae.Condition == lostLeaseCond
}

// A settlement the broker answers late is bounded by SettleTimeout and
// counted; one answered with a lost lease (the Leases' LostAnswer) is
// counted, not retried.
func TestSettlementsAnsweredLateOrWithLockLost(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		msgs := fake.Messages(3)
		src := fake.New(true, msgs...)
		src.SettleErr = func(ctx context.Context, m *amqp.Message) error {
			switch m {
			case msgs[1]:
				return &amqp.Error{Condition: lostLeaseCond, Description: "the lock supplied is invalid"}
			case msgs[2]:
				<-ctx.Done() // never answered
				return ctx.Err()
			}
			return nil
		}
		p := pump.New(pump.Config{Credit: 4, Settlers: 2, SettleTimeout: time.Second, Leases: lostOnCond{}})
		cancel, errc := start(t, p, attachTo(src))
		for range 3 {
			p.Settle(<-p.Out(), driver.Outcome{Kind: driver.Accept})
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

// A Source that waits before sending a settlement again says so with
// Resting: meanwhile the delivery's Ticket.Sending is false, so a lease
// book renews its lock; before and after, while an answer is awaited, it
// is true. Outside a settler's call Resting does nothing.
func TestRestingSettlementIsNotSending(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		driver.Resting(context.Background())() // no settlement: nothing to do
		src := fake.New(true, fake.Messages(1)...)
		var tk driver.Ticket
		var seen []bool
		src.SettleErr = func(ctx context.Context, _ *amqp.Message) error {
			seen = append(seen, tk.Sending())
			resume := driver.Resting(ctx)
			seen = append(seen, tk.Sending())
			resume()
			seen = append(seen, tk.Sending())
			return nil
		}
		p := pump.New(pump.Config{Credit: 1, Settlers: 1})
		cancel, errc := start(t, p, attachTo(src))
		tk = <-p.Out()
		p.Settle(tk, driver.Outcome{Kind: driver.Accept})
		synctest.Wait()
		cancel()
		<-errc
		if want := []bool{true, false, true}; !slices.Equal(seen, want) {
			t.Fatalf("Sending before, while resting and after: %v, want %v", seen, want)
		}
		if n := src.Count(fake.Accepted); n != 1 {
			t.Fatalf("%d accepted, want 1", n)
		}
	})
}
