package servicebus

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/Azure/go-amqp"
)

// refreshRun runs a refresher for one token of lifetime life, put at the
// bubble's start, with put deciding each refresh, for 60 s (or life, if
// longer) or until it aborts the connection. It returns the refreshes' times and deadlines
// (from the start) and when it aborted (0: never).
func refreshRun(t *testing.T, life time.Duration, put func(ctx context.Context, n int) (time.Time, error)) (at, deadlines []time.Duration, aborted time.Duration) {
	t.Helper()
	start := time.Now()
	abortedAt := make(chan time.Duration, 1)
	r := startRefresher([]claim{newClaim("amqp://ns/q", start, start.Add(life))},
		func(ctx context.Context, audience string) (time.Time, error) {
			at = append(at, time.Since(start))
			dl, ok := ctx.Deadline()
			if !ok {
				t.Errorf("refresh %d has no deadline", len(at))
			}
			deadlines = append(deadlines, dl.Sub(start))
			return put(ctx, len(at))
		},
		func() { abortedAt <- time.Since(start) }, nil)
	select {
	case aborted = <-abortedAt:
		<-r.done // it ends by itself after an abort
	case <-time.After(max(60*time.Second, life)):
	}
	r.Stop()
	return at, deadlines, aborted
}

var errIdentity = errors.New("identity endpoint: 503 Service Unavailable")

func TestRefresher(t *testing.T) {
	t.Run("a failed refresh is tried again; the connection is kept", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			at, _, aborted := refreshRun(t, 8*time.Second, func(ctx context.Context, n int) (time.Time, error) {
				if n == 1 {
					return time.Time{}, errIdentity
				}
				return time.Now().Add(8 * time.Second), nil
			})
			t.Logf("refreshes at %v", at)
			if aborted != 0 {
				t.Fatalf("the connection was dropped at %v after one failed refresh", aborted)
			}
			// Due halfway (4 s), failed; tried again after 0.5-1 s; then
			// halfway through each new token's life.
			if len(at) < 2 || at[0] != 4*time.Second || at[1]-at[0] < refreshRetryFloor/2 || at[1]-at[0] > refreshRetryFloor {
				t.Fatalf("refreshes at %v", at)
			}
			for i := 2; i < len(at); i++ {
				if at[i]-at[i-1] != 4*time.Second {
					t.Fatalf("refreshes at %v: want every 4 s after the retry", at)
				}
			}
		})
	})
	t.Run("failing refreshes drop the connection shortly before the token expires", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			at, _, aborted := refreshRun(t, 8*time.Second, func(context.Context, int) (time.Time, error) {
				return time.Time{}, errIdentity
			})
			t.Logf("refreshes at %v; dropped at %v", at, aborted)
			// The token expires at 8 s; the connection is dropped a tenth
			// of its life before, at 7.2 s, after a last try then.
			if aborted != 7200*time.Millisecond || at[len(at)-1] != aborted || len(at) < 3 || len(at) > 6 {
				t.Fatalf("refreshes at %v; dropped at %v", at, aborted)
			}
		})
	})
	t.Run("a refused token drops the connection at once", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			at, _, aborted := refreshRun(t, 8*time.Second, func(context.Context, int) (time.Time, error) {
				return time.Time{}, fmt.Errorf("amqpsub: Service Bus refused the token: %w", &amqp.Error{Condition: amqp.ErrCondUnauthorizedAccess})
			})
			if aborted != 4*time.Second || len(at) != 1 {
				t.Fatalf("refreshes at %v; dropped at %v", at, aborted)
			}
		})
	})
	t.Run("each refresh is bounded", func(t *testing.T) {
		for _, tc := range []struct {
			life, due, deadline, aborted time.Duration
		}{
			// 30 s; the retry then succeeds.
			{2 * time.Hour, 110 * time.Minute, 110*time.Minute + refreshTimeout, 0},
			// No later than the token expires: then too late to retry.
			{8 * time.Second, 4 * time.Second, 8 * time.Second, 8 * time.Second},
		} {
			synctest.Test(t, func(t *testing.T) {
				at, deadlines, aborted := refreshRun(t, tc.life, func(ctx context.Context, n int) (time.Time, error) {
					if n > 1 {
						return time.Now().Add(tc.life), nil
					}
					<-ctx.Done() // a provider (or $cbs) that does not answer
					return time.Time{}, ctx.Err()
				})
				if at[0] != tc.due || deadlines[0] != tc.deadline || aborted != tc.aborted {
					t.Fatalf("life %v: refreshes at %v with deadlines %v; dropped at %v", tc.life, at, deadlines, aborted)
				}
			})
		}
	})
	t.Run("stop does not wait for a TokenProvider that ignores ctx", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			tp := &blockedProvider{release: make(chan struct{})}
			p := &cbsPutter{tp: tp.Token} // no $cbs: Token never returns before the stop
			start := time.Now()
			r := startRefresher([]claim{newClaim("amqp://ns/q", start, start.Add(8*time.Second))}, p.put, func() {
				t.Error("the connection was dropped")
			}, nil)
			time.Sleep(5 * time.Second)
			synctest.Wait()
			if tp.calls() != 1 {
				t.Fatalf("%d calls of Token", tp.calls())
			}
			stopped := time.Now()
			r.Stop()
			if d := time.Since(stopped); d != 0 {
				t.Fatalf("stop took %v", d)
			}
			// Once the provider returns, its goroutine ends (synctest.Test
			// fails on one left blocked).
			close(tp.release)
		})
	})
}

// blockedProvider's Token ignores ctx and blocks until release is closed.
type blockedProvider struct {
	mu      sync.Mutex
	n       int
	release chan struct{}
}

func (b *blockedProvider) Token(context.Context, string) (Token, error) {
	b.mu.Lock()
	b.n++
	b.mu.Unlock()
	<-b.release
	return Token{Type: "jwt", Value: "late", Expiry: time.Now().Add(time.Hour)}, nil
}

func (b *blockedProvider) calls() int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.n
}

// PutNow puts every claim's token at once, on the refresher's goroutine,
// and the claim's schedule starts from the new token: the next refresh is
// halfway through its life, not the old one's.
func TestRefresherPutNow(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		start := time.Now()
		var mu sync.Mutex
		var puts []string
		r := startRefresher([]claim{
			newClaim("amqp://ns/q", start, start.Add(8*time.Second)),
			newClaim("amqp://ns/q/$management", start, start.Add(8*time.Second)),
		}, func(ctx context.Context, audience string) (time.Time, error) {
			mu.Lock()
			puts = append(puts, fmt.Sprintf("%v %s", time.Since(start), audience))
			mu.Unlock()
			return time.Now().Add(8 * time.Second), nil
		}, func() { t.Error("aborted") }, nil)
		time.Sleep(3 * time.Second)
		if err := r.PutNow(context.Background()); err != nil {
			t.Fatal(err)
		}
		time.Sleep(6 * time.Second) // to 9 s: the old schedule would have refreshed at 4 s and 8 s
		r.Stop()
		mu.Lock()
		defer mu.Unlock()
		want := []string{"3s amqp://ns/q", "3s amqp://ns/q/$management", "7s amqp://ns/q", "7s amqp://ns/q/$management"}
		if fmt.Sprint(puts) != fmt.Sprint(want) {
			t.Fatalf("puts %v, want %v", puts, want)
		}
		if err := r.PutNow(context.Background()); !errors.Is(err, errRefresherStopped) {
			t.Fatalf("PutNow after Stop = %v", err)
		}
	})
}
