package servicebus

import (
	"context"
	"errors"
	"fmt"
	"reflect"
	"testing"
	"testing/synctest"
	"time"

	"github.com/Azure/go-amqp"
)

// sessionRenewals runs keepSessionLock for a lock of 20 s from the bubble's
// start, with answer deciding each renewal (n counts from 1), until the
// lock is lost or 60 s have passed. It returns the times of the requests
// (from the start), when it returned, and its error.
func sessionRenewals(t *testing.T, answer func(ctx context.Context, n int, now time.Time) (time.Time, error)) (calls []time.Duration, ended time.Duration, err error) {
	t.Helper()
	start := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	retries := 0
	err = keepSessionLock(ctx, start.Add(20*time.Second), func(ctx context.Context) (time.Time, error) {
		calls = append(calls, time.Since(start))
		return answer(ctx, len(calls), time.Now())
	}, func(error, time.Time) { retries++ })
	if retries > len(calls) {
		t.Fatalf("%d retries reported for %d requests", retries, len(calls))
	}
	return calls, time.Since(start), err
}

var errUnavailable = errors.New("status 503: server busy")

func TestSessionLockRenewal(t *testing.T) {
	t.Run("one failed request does not shorten the lock", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			calls, ended, err := sessionRenewals(t, func(_ context.Context, n int, now time.Time) (time.Time, error) {
				if n == 1 {
					return time.Time{}, errUnavailable
				}
				return now.Add(20 * time.Second), nil
			})
			if err != nil || ended != 60*time.Second {
				t.Fatalf("given up after %v: %v", ended, err)
			}
			// Due at 10 s (half of 20 s), failed; again 2 s later (half of
			// the 10 s left, at most 2 s); renewed for 20 s: next due 10 s
			// later, and so on.
			want := []time.Duration{10 * time.Second, 12 * time.Second, 22 * time.Second, 32 * time.Second, 42 * time.Second, 52 * time.Second}
			if fmt.Sprint(calls) != fmt.Sprint(want) {
				t.Fatalf("requests at %v, want %v", calls, want)
			}
		})
	})
	t.Run("failing requests give up when the lock expires, not before", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			calls, ended, err := sessionRenewals(t, func(context.Context, int, time.Time) (time.Time, error) {
				return time.Time{}, errUnavailable
			})
			t.Logf("requests at %v; given up at %v: %v", calls, ended, err)
			if !errors.Is(err, errUnavailable) {
				t.Fatalf("error %v, want the last request's", err)
			}
			if ended < 20*time.Second || ended > 20*time.Second+sessionRetryFloor {
				t.Fatalf("given up at %v; the lock expires at 20s", ended)
			}
			// 10, 12, 14, 16, 18, 19, 19.5, 19.75: retries at half of what
			// is left, at most 2 s and at least 250 ms apart.
			if len(calls) != 8 || calls[1]-calls[0] != 2*time.Second || calls[len(calls)-1] >= 20*time.Second {
				t.Fatalf("%d requests at %v", len(calls), calls)
			}
		})
	})
	t.Run("a request is bounded by the lock's expiry", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			calls, ended, err := sessionRenewals(t, func(ctx context.Context, _ int, _ time.Time) (time.Time, error) {
				<-ctx.Done() // never answered
				return time.Time{}, ctx.Err()
			})
			if !errors.Is(err, context.DeadlineExceeded) || ended != 20*time.Second {
				t.Fatalf("requests at %v; given up at %v: %v", calls, ended, err)
			}
		})
	})
	for _, tc := range []struct {
		name string
		gone error
	}{
		{"lost at once: status 410", fmt.Errorf("amqpsub: renew-session-lock: status 410: %w", ErrLockLost)},
		{"lost at once: $management gone", fmt.Errorf("amqpsub: x/$management: %w: closed", ErrNodeGone)},
	} {
		gone := tc.gone
		t.Run(tc.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				calls, ended, err := sessionRenewals(t, func(context.Context, int, time.Time) (time.Time, error) {
					return time.Time{}, gone
				})
				if !errors.Is(err, gone) || ended != 10*time.Second || len(calls) != 1 {
					t.Fatalf("requests at %v; given up at %v: %v", calls, ended, err)
				}
				if errors.Is(gone, ErrLockLost) && !errors.Is(err, ErrLockLost) {
					t.Fatalf("%v does not wrap ErrLockLost", err)
				}
			})
		})
	}
	t.Run("stop ends a request in progress", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			ctx, cancel := context.WithCancel(context.Background())
			in := make(chan struct{})
			done := make(chan error)
			go func() {
				done <- keepSessionLock(ctx, time.Now().Add(20*time.Second), func(ctx context.Context) (time.Time, error) {
					close(in)
					<-ctx.Done()
					return time.Time{}, ctx.Err()
				}, func(error, time.Time) {})
			}()
			<-in
			start := time.Now()
			cancel()
			if err := <-done; err != nil || time.Since(start) != 0 {
				t.Fatalf("returned %v after the stop: %v", time.Since(start), err)
			}
		})
	})
}

// The session filter goes out with the descriptor azservicebus sends
// (0x137000000C), with the session id or nil as its value. go-amqp keeps
// the filter in a map of an internal type; the test builds one by
// reflection and reads the described value back.
func TestSessionFilterDescriptor(t *testing.T) {
	for _, id := range []string{"", "s-1"} {
		ro := &amqp.ReceiverOptions{}
		SessionReceiverOptions(ro, id, 5*time.Second)
		if len(ro.Filters) != 1 {
			t.Fatalf("%d filters, want 1", len(ro.Filters))
		}
		f := reflect.ValueOf(ro.Filters[0])
		m := reflect.MakeMap(f.Type().In(0))
		f.Call([]reflect.Value{m})
		v := m.MapIndex(reflect.ValueOf(sessionFilter).Convert(m.Type().Key()))
		if !v.IsValid() || v.IsNil() {
			t.Fatalf("no %s in %v", sessionFilter, m)
		}
		desc, val := v.Elem().FieldByName("Descriptor").Interface(), v.Elem().FieldByName("Value").Interface()
		var want any
		if id != "" {
			want = id
		}
		if desc != any(uint64(0x137000000C)) || val != want {
			t.Errorf("id %q: filter %#x = %#v, want descriptor 0x137000000c and value %#v", id, desc, val, want)
		}
		if to := ro.Properties["com.microsoft:timeout"]; to != uint32(5000) {
			t.Errorf("com.microsoft:timeout %#v, want uint32 5000", to)
		}
	}
}

func TestSessionLockedWait(t *testing.T) {
	for k, ceiling := range []time.Duration{time.Second, 2 * time.Second, 4 * time.Second, 8 * time.Second,
		16 * time.Second, 30 * time.Second, 30 * time.Second} {
		for range 200 {
			if d := SessionLockedWait(k); d < ceiling/2 || d > ceiling {
				t.Fatalf("SessionLockedWait(%d) = %v, want between %v and %v", k, d, ceiling/2, ceiling)
			}
		}
	}
}
