package amqpsub_test

import (
	"context"
	"encoding/binary"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/Azure/go-amqp"

	"github.com/amqpsub/amqpsub/amqpsub"
	"github.com/amqpsub/amqpsub/internal/fake"
	"github.com/amqpsub/amqpsub/internal/servicebus"
)

// lockingSource is a fake receiver whose messages carry Service Bus locks
// (a 16-byte delivery tag, x-opt-locked-until) and which renews them,
// recording each token renewed.
type lockingSource struct {
	*fake.Source
	mu      sync.Mutex
	renewed map[amqp.UUID]int
}

func (s *lockingSource) RenewLocks(_ context.Context, tokens []amqp.UUID) ([]time.Time, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	exp := make([]time.Time, len(tokens))
	for i, tok := range tokens {
		s.renewed[tok]++
		exp[i] = time.Now().Add(10 * time.Second)
	}
	return exp, nil
}

func lockedMessages(n int, lock time.Duration) []*amqp.Message {
	ms := fake.Messages(n)
	for i, m := range ms {
		tag := make([]byte, 16)
		binary.BigEndian.PutUint64(tag[8:], uint64(i+1))
		m.DeliveryTag = tag
		m.Annotations = amqp.Annotations{"x-opt-locked-until": time.Now().Add(lock)}
	}
	return ms
}

// A settlement the service does not answer (until SettleTimeout, 30 s)
// holds up no accept of another message: none waits past its 10 s lock.
func TestNoLockExpiresWhileItsSettlementWaitsBehindAStuckOne(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		const n = 8
		ls := &lockingSource{Source: fake.New(true, lockedMessages(n, 10*time.Second)...), renewed: map[amqp.UUID]int{}}
		var mu sync.Mutex
		sentAt := map[int]time.Duration{}
		begin := time.Now()
		ls.SettleErr = func(ctx context.Context, m *amqp.Message) error {
			if m.Value.(int) == 0 {
				<-ctx.Done()
				return ctx.Err()
			}
			mu.Lock()
			sentAt[m.Value.(int)] = time.Since(begin)
			mu.Unlock()
			return nil
		}
		var handled atomic.Int32
		s, err := amqpsub.New(amqpsub.SourceOf(ls), "q", amqpsub.HandlerFunc(func(context.Context, *amqpsub.Delivery) error {
			handled.Add(1)
			return nil
		}), amqpsub.WithProfile(amqpsub.AzureServiceBus), amqpsub.Credit(4), amqpsub.Workers(4))
		if err != nil {
			t.Fatal(err)
		}
		cancel, errc := run(t, s)
		time.Sleep(40 * time.Second)
		synctest.Wait()
		mu.Lock()
		var late []int
		for i, at := range sentAt {
			if at > 10*time.Second {
				late = append(late, i)
				t.Logf("message %d: handled at ~0 s, its accept sent at %v, its lock (10 s) renewed %d times",
					i, at.Round(time.Millisecond), ls.renewed[tokenOf(i)])
			}
		}
		mu.Unlock()
		cancel()
		<-errc
		if len(late) > 0 {
			t.Fatalf("accepts of %v waited past their lock's expiry behind an unanswered settlement, unrenewed", late)
		}
	})
}

func tokenOf(i int) amqp.UUID {
	tag := make([]byte, 16)
	binary.BigEndian.PutUint64(tag[8:], uint64(i+1))
	u, _ := servicebus.LockToken(tag)
	return u
}

// Close during a graceful stop's grace period sends nothing more: the
// settlers do not go on flushing after it.
func TestCloseDuringTheGracePeriodSendsNothingMore(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		src := fake.New(true, fake.Messages(2)...)
		var closedAt atomic.Int64
		var mu sync.Mutex
		var acceptedAfterClose time.Duration = -1
		src.SettleErr = func(ctx context.Context, m *amqp.Message) error {
			if m.Value.(int) != 0 {
				return nil
			}
			// The service answers this accept 2 s after it is sent.
			tm := time.NewTimer(2 * time.Second)
			defer tm.Stop()
			select {
			case <-tm.C:
				if c := closedAt.Load(); c != 0 {
					mu.Lock()
					acceptedAfterClose = time.Since(time.Unix(0, c))
					mu.Unlock()
				}
				return nil
			case <-ctx.Done():
				return ctx.Err()
			}
		}
		stopped := make(chan struct{})
		s, err := amqpsub.New(amqpsub.SourceOf(src), "q", amqpsub.HandlerFunc(func(ctx context.Context, d *amqpsub.Delivery) error {
			if index(d) == 0 {
				<-stopped
				return nil // returns in the grace period
			}
			<-ctx.Done() // holds the grace period open
			return ctx.Err()
		}), amqpsub.WithProfile(amqpsub.AzureServiceBus), amqpsub.GracePeriod(time.Minute), amqpsub.CloseTimeout(4*time.Second),
			amqpsub.MaxLockRenewal(0))
		if err != nil {
			t.Fatal(err)
		}
		cancel, errc := run(t, s)
		synctest.Wait()
		cancel() // graceful stop, 1 min grace
		synctest.Wait()
		close(stopped) // handler 0 returns: its accept goes to a settler
		time.Sleep(100 * time.Millisecond)
		closedAt.Store(time.Now().UnixNano())
		s.Close()
		err = <-errc
		took := time.Since(time.Unix(0, closedAt.Load()))
		mu.Lock()
		a := acceptedAfterClose
		mu.Unlock()
		t.Logf("Run = %v %v after Close; accept answered %v after Close; stats %v", err, took, a, s.Stats())
		if a >= 0 {
			t.Fatalf("a settlement was still being sent, and taken, %v after Close", a)
		}
	})
}
