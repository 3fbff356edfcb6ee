package pump_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/Azure/go-amqp"

	"github.com/amqpsub/amqpsub/internal/fake"
	"github.com/amqpsub/amqpsub/pump"
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
			p.Settle(d, pump.Outcome{Kind: pump.Accept}) // unordered
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

// Without KeepAcrossLinks (Service Bus sessions), a settlement still
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
		b.OnSettled(func(_ pump.Kind, err error) { mu.Lock(); heard = err; mu.Unlock() })
		p.Settle(a, pump.Outcome{Kind: pump.Accept})
		p.Settle(b, pump.Outcome{Kind: pump.Accept})
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
		if st.Stale != 1 || !errors.Is(h, pump.ErrNotSent) {
			t.Fatalf("a settlement queued for a settler when its link was lost: stale %d (want 1), OnSettled %v (want ErrNotSent)", st.Stale, h)
		}
	})
}
