// Package backoff computes capped exponential waits, for reconnects (with
// jitter) and for retries in a lane (without).
package backoff

import (
	"math"
	"math/rand/v2"
	"time"
)

// Ceiling returns min(max, initial·2^k) for attempt k (from 0), for any k
// and any durations: a doubling that would pass max, or overflow, stops at
// max. A negative initial or max counts as 0.
func Ceiling(k int, initial, max time.Duration) time.Duration {
	initial, max = clampZero(initial), clampZero(max)
	d := min(initial, max)
	for i := 0; i < k && d < max; i++ {
		if d > max/2 {
			return max
		}
		d *= 2
	}
	return d
}

func clampZero(d time.Duration) time.Duration { return max(0, d) }

// Jittered returns a random wait in [0, Ceiling(k, initial, max)]: "full
// jitter", so that clients that failed together do not retry together.
func Jittered(k int, initial, max time.Duration) time.Duration {
	c := Ceiling(k, initial, max)
	if c == math.MaxInt64 {
		return rand.N(c) //nolint:gosec // G404: jitter spreads retries; nothing secret depends on it
	}
	return rand.N(c + 1) //nolint:gosec // G404: as above
}
