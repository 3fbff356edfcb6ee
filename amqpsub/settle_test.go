package amqpsub_test

// Settlements: what each handler result settles as under each profile,
// their order within a group, and one the broker does not answer holding up
// no other. What a stop sends of them is Run's, in run_test.go.

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/Azure/go-amqp"

	"github.com/amqpsub/amqpsub/amqpsub"
	"github.com/amqpsub/amqpsub/internal/driver/servicebus"
	"github.com/amqpsub/amqpsub/internal/fake"
)

// The settlements of a group reach the broker in the order its messages
// were handled, though each waits for an answer and a later one is
// answered sooner; other groups settle beside them.
func TestSettlementsOfAGroupKeepTheirOrder(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		const n = 40
		msgs := fake.Messages(n, "g0", "g1")
		src := fake.New(true, msgs...)
		// An earlier message of a group waits longer for its answer than
		// the next: sent side by side, the next would be taken first.
		src.SettleErr = func(ctx context.Context, m *amqp.Message) error {
			i := m.Value.(int)
			t := time.NewTimer(time.Duration(n-i) * time.Millisecond)
			defer t.Stop()
			select {
			case <-t.C:
				return nil
			case <-ctx.Done():
				return ctx.Err()
			}
		}
		s, err := amqpsub.New(amqpsub.SourceOf(src), "q", amqpsub.HandlerFunc(func(context.Context, *amqpsub.Delivery) error { return nil }),
			amqpsub.WithProfile(amqpsub.AzureServiceBus), amqpsub.WorkersByKey(2), amqpsub.MaxLockRenewal(0))
		if err != nil {
			t.Fatal(err)
		}
		cancel, errc := run(t, s)
		for src.Count(fake.Accepted) < n {
			time.Sleep(time.Millisecond)
		}
		cancel()
		if err := <-errc; err != nil {
			t.Fatal(err)
		}
		last := map[string]int{"g0": -1, "g1": -1}
		for _, st := range src.Settlements() {
			g, i := *st.Msg.Properties.GroupID, st.Msg.Value.(int)
			if i < last[g] {
				t.Fatalf("group %s: message %d settled after message %d", g, i, last[g])
			}
			last[g] = i
		}
	})
}

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

func TestHandlerResultsSettleAsDocumented(t *testing.T) {
	for _, tc := range []struct {
		profile amqpsub.Profile
		retry   fake.Outcome
	}{{amqpsub.Artemis, fake.Modified}, {amqpsub.RabbitMQ3, fake.Released}, {amqpsub.Generic, fake.Modified}} {
		t.Run(tc.profile.String(), func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				results := []func() error{
					func() error { return nil },
					func() error { return amqpsub.Release() },
					func() error { return amqpsub.Retry(errors.New("try later")) },
					func() error { return fmt.Errorf("wrapped: %w", amqpsub.Reject("bad order")) },
					func() error { return errors.New("plain error") },
					func() error { panic("boom") },
				}
				msgs := fake.Messages(len(results))
				src := fake.New(true, msgs...)
				var mu sync.Mutex
				seen := map[int]int{}
				s, err := amqpsub.New(amqpsub.SourceOf(src), "q", amqpsub.HandlerFunc(func(_ context.Context, d *amqpsub.Delivery) error {
					i := index(d)
					mu.Lock()
					seen[i]++
					again := seen[i] > 1
					mu.Unlock()
					if again {
						return nil // a redelivery: accept it
					}
					return results[i]()
				}), amqpsub.WithProfile(tc.profile))
				if err != nil {
					t.Fatal(err)
				}
				cancel, errc := run(t, s)
				synctest.Wait()
				cancel()
				if err := <-errc; err != nil {
					t.Fatalf("Run = %v", err)
				}
				first := map[*amqp.Message]fake.Settlement{}
				for _, st := range src.Settlements() {
					if _, ok := first[st.Msg]; !ok {
						first[st.Msg] = st
					}
				}
				want := []fake.Outcome{fake.Accepted, fake.Released, tc.retry, fake.Rejected, tc.retry, tc.retry}
				for i, m := range msgs {
					st := first[m]
					if st.Outcome != want[i] {
						t.Errorf("result %d settled %s, want %s", i, st.Outcome, want[i])
					}
					if st.Outcome == fake.Modified && !st.DeliveryFailed {
						t.Errorf("result %d: modified without delivery-failed", i)
					}
				}
				if st := first[msgs[3]]; st.Error == nil || st.Error.Description != "bad order" || st.Error.Condition != amqpsub.RejectCondition {
					t.Errorf("reject carried %+v", st.Error)
				}
				stats := s.Stats()
				if stats.Results.Panics != 1 || stats.Results.Retry != 3 || stats.Results.Reject != 1 || stats.Results.Release != 1 {
					t.Errorf("stats %+v", stats)
				}
				// 0 at once; 1, 2, 4 and 5 when redelivered; 3 was rejected.
				if stats.Settled.Accepted != 5 {
					t.Errorf("accepted %d, want 5", stats.Settled.Accepted)
				}
			})
		})
	}
}
