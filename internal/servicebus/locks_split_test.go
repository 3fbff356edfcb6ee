package servicebus_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/Azure/go-amqp"

	"github.com/amqpsub/amqpsub/internal/servicebus"
)

// However the service answers a batch that holds one lost lock — refused
// whole with 410 or 400, or renewed in part with fewer expirations than
// tokens — the book asks token by token before it declares any lock lost:
// only the lost one is reported, and the other 255 stay renewed.
func TestAMixedBatchLosesOnlyItsLostLock(t *testing.T) {
	for _, mode := range []string{"410", "400", "partial"} {
		t.Run(mode, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				svc := newService(4 * time.Second)
				svc.mixed = mode
				r := newRig(t, svc, 256, servicebus.BookConfig{})
				synctest.Wait()
				svc.mu.Lock()
				svc.lost[token(100)] = true
				svc.mu.Unlock()
				time.Sleep(20 * time.Second) // ten lock durations
				st := r.book.Stats()
				r.stop()
				if r.lostOnes() != "[100]" || st.Lost != 1 || svc.expired != 0 {
					t.Fatalf("lost %s (%d renewals too late), stats %+v", r.lostOnes(), svc.expired, st)
				}
				if st.Split != 1 || st.Held != 255 {
					t.Fatalf("stats %+v: want 1 split batch, 255 held", st)
				}
				t.Logf("%s: %d requests, %d tokens sent, %d renewed", mode, st.Requests, st.RequestTokens, st.Renewed)
			})
		})
	}
}

// A single token answered 400, or with no expiration, is a failed renewal,
// not a lost lock: it is tried again, and renewed once the service answers.
func TestASingleTokenRefusedWith400IsTriedAgain(t *testing.T) {
	for _, answer := range []error{
		fmt.Errorf("status 400: %w", servicebus.ErrBadRequest),
		nil, // 200 with no expirations
	} {
		synctest.Test(t, func(t *testing.T) {
			svc := newService(4 * time.Second)
			var mu sync.Mutex
			bad := 2 // the first two requests
			rn := renewerFunc(func(ctx context.Context, tokens []amqp.UUID) ([]time.Time, error) {
				mu.Lock()
				defer mu.Unlock()
				if bad > 0 {
					bad--
					return nil, answer
				}
				return svc.RenewLocks(ctx, tokens)
			})
			r := newRig(t, svc, 1, servicebus.BookConfig{Renewer: rn})
			time.Sleep(20 * time.Second)
			st := r.book.Stats()
			r.stop()
			if r.lostOnes() != "[]" || st.Failures != 2 || st.Renewed == 0 {
				t.Fatalf("answer %v: lost %s, stats %+v", answer, r.lostOnes(), st)
			}
		})
	}
}

type renewerFunc func(ctx context.Context, tokens []amqp.UUID) ([]time.Time, error)

func (f renewerFunc) RenewLocks(ctx context.Context, tokens []amqp.UUID) ([]time.Time, error) {
	return f(ctx, tokens)
}

// A server-busy answer holds every renewal back for ServerBusyWait (10 s,
// the .NET clients' ServerBusyBaseSleepTime), then renewal goes on: with
// 60 s locks, none is lost.
func TestServerBusyHoldsRenewalsBackTenSeconds(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		svc := newService(60 * time.Second)
		var mu sync.Mutex
		var at []time.Time
		busy := 1
		rn := renewerFunc(func(ctx context.Context, tokens []amqp.UUID) ([]time.Time, error) {
			mu.Lock()
			at = append(at, time.Now())
			b := busy > 0
			busy--
			mu.Unlock()
			if b {
				return nil, fmt.Errorf("status 503: %w", servicebus.ErrServerBusy)
			}
			return svc.RenewLocks(ctx, tokens)
		})
		r := newRig(t, svc, 10, servicebus.BookConfig{Renewer: rn})
		time.Sleep(2 * time.Minute)
		st := r.book.Stats()
		r.stop()
		mu.Lock()
		defer mu.Unlock()
		if len(at) < 2 {
			t.Fatalf("%d requests", len(at))
		}
		if gap := at[1].Sub(at[0]); gap < servicebus.ServerBusyWait {
			t.Fatalf("the request after server-busy went out %v later, want ≥ %v", gap, servicebus.ServerBusyWait)
		}
		if r.lostOnes() != "[]" || st.ServerBusy != 1 || st.Renewed < 10 {
			t.Fatalf("lost %s, stats %+v", r.lostOnes(), st)
		}
	})
}

// A lock that would expire during the server-busy wait is reported lost
// when it expires, not later.
func TestALockExpiringDuringTheServerBusyWaitIsLostOnTime(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		svc := newService(4 * time.Second)
		svc.fail = fmt.Errorf("status 503: %w", servicebus.ErrServerBusy)
		start := time.Now()
		var lostAt time.Time
		r := newRig(t, svc, 1, servicebus.BookConfig{})
		for r.lostOnes() == "[]" && time.Since(start) < time.Minute {
			time.Sleep(100 * time.Millisecond)
		}
		lostAt = time.Now()
		st := r.book.Stats()
		r.stop()
		if r.lostOnes() != "[0]" || lostAt.Sub(start) > 4*time.Second+200*time.Millisecond || st.Requests != 1 {
			t.Fatalf("lost %s after %v, stats %+v", r.lostOnes(), lostAt.Sub(start), st)
		}
	})
}
