package amqpsub

import (
	"context"
	"errors"
	"math"
	"testing"
	"time"
)

// Whatever durations the options are given, New either refuses them with
// ErrInvalidOption or takes them, and then every wait they lead to (the
// reconnect backoff at any attempt, a LocalRetry's wait) is a duration in
// range: none overflows or panics, as Backoff(1s, math.MaxInt64) once did at
// attempt 34.
func FuzzOptionDurations(f *testing.F) {
	f.Add(int64(time.Second), int64(math.MaxInt64), int64(100*time.Millisecond), int64(math.MaxInt64), int64(30*time.Second), int64(time.Second))
	f.Add(int64(100*time.Millisecond), int64(2*time.Second), int64(0), int64(0), int64(2*math.MaxUint32*time.Millisecond), int64(0))
	f.Add(int64(1), int64(1), int64(1), int64(1), int64(2*math.MaxUint32*time.Millisecond+1), int64(-1))
	h := HandlerFunc(func(context.Context, *Delivery) error { return nil })
	f.Fuzz(func(t *testing.T, bmin, bmax, rinit, rmax, idle, grace int64) {
		s, err := New(Dial("amqp://127.0.0.1:1", nil), "q", h,
			Backoff(time.Duration(bmin), time.Duration(bmax)),
			LocalRetry(RetryPolicy{Attempts: 5, Initial: time.Duration(rinit), Max: time.Duration(rmax)}),
			IdleTimeout(time.Duration(idle)), GracePeriod(time.Duration(grace)))
		if err != nil {
			if !errors.Is(err, ErrInvalidOption) {
				t.Fatalf("New: %v, not ErrInvalidOption", err)
			}
			return
		}
		if s.cfg.idleTimeout/2 > math.MaxUint32*time.Millisecond {
			t.Fatalf("IdleTimeout %v taken: half of it does not fit the open frame", s.cfg.idleTimeout)
		}
		a := s.pipes[0].att
		r := s.retrier()
		for _, k := range []int{0, 1, 33, 34, 35, 62, 63, 64, 1000} {
			if w := a.reconnectWait(nil, k); w < 0 || w > s.cfg.backoffMax {
				t.Fatalf("reconnect wait %v at attempt %d, outside [0, %v]", w, k, s.cfg.backoffMax)
			}
			if w := r.wait(k + 1); w < 0 || w > s.cfg.localRetry.Max {
				t.Fatalf("LocalRetry wait %v at attempt %d, outside [0, %v]", w, k+1, s.cfg.localRetry.Max)
			}
		}
	})
}

// The stop's bound, GracePeriod + CloseTimeout, does not wrap around for
// the longest durations the options take.
func TestStopBoundSaturates(t *testing.T) {
	if got := addSat(math.MaxInt64-time.Second, 5*time.Second); got != math.MaxInt64 {
		t.Fatalf("addSat near the limit = %v, want the longest Duration", got)
	}
	if got := addSat(30*time.Second, 5*time.Second); got != 35*time.Second {
		t.Fatalf("addSat(30s, 5s) = %v", got)
	}
}
