// Package backoff computes capped exponential waits, for reconnects (with
// jitter) and for retries in a lane (without).
package backoff

import (
	"math/rand/v2"
	"time"
)

// Ceiling returns min(max, initial·2^k) for attempt k (from 0), without
// overflowing for any k.
func Ceiling(k int, initial, max time.Duration) time.Duration {
	d := initial
	for i := 0; i < k && d < max; i++ {
		d *= 2
	}
	return min(d, max)
}

// Jittered returns a random wait in [0, Ceiling(k, initial, max)]: "full
// jitter", so that clients that failed together do not retry together.
func Jittered(k int, initial, max time.Duration) time.Duration {
	return rand.N(Ceiling(k, initial, max) + 1) //nolint:gosec // G404: jitter spreads retries; nothing secret depends on it
}
