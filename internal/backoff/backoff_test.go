package backoff

import (
	"math"
	"testing"
	"time"
)

func TestCeilingDoublesUpToMax(t *testing.T) {
	for _, tc := range []struct {
		k    int
		want time.Duration
	}{{0, 100 * time.Millisecond}, {1, 200 * time.Millisecond}, {3, 800 * time.Millisecond}, {5, 2 * time.Second}, {1 << 20, 2 * time.Second}} {
		if got := Ceiling(tc.k, 100*time.Millisecond, 2*time.Second); got != tc.want {
			t.Errorf("Ceiling(%d) = %v, want %v", tc.k, got, tc.want)
		}
	}
}

func TestJitteredStaysUnderTheCeiling(t *testing.T) {
	seen := map[bool]bool{}
	for range 1000 {
		d := Jittered(2, 10*time.Millisecond, time.Second)
		if d < 0 || d > 40*time.Millisecond {
			t.Fatalf("Jittered = %v, outside [0, 40ms]", d)
		}
		seen[d < 20*time.Millisecond] = true
	}
	if !seen[true] || !seen[false] {
		t.Fatal("Jittered does not spread over its range")
	}
}

// Doubling stops at max, whatever max is: a ceiling near math.MaxInt64
// does not overflow into a negative wait (which made Jittered panic).
func TestCeilingDoesNotOverflow(t *testing.T) {
	for _, tc := range []struct {
		k            int
		initial, max time.Duration
		want         time.Duration
	}{
		{34, time.Second, math.MaxInt64, math.MaxInt64},
		{62, 1, math.MaxInt64, 1 << 62},
		{63, 1, math.MaxInt64, math.MaxInt64},
		{1000, time.Second, math.MaxInt64, math.MaxInt64},
		{3, math.MaxInt64, math.MaxInt64, math.MaxInt64},
		{2, -time.Second, time.Second, 0},
		{2, time.Second, -time.Second, 0},
	} {
		if got := Ceiling(tc.k, tc.initial, tc.max); got != tc.want {
			t.Errorf("Ceiling(%d, %v, %v) = %v, want %v", tc.k, tc.initial, tc.max, got, tc.want)
		}
	}
}

// For any attempt and any durations, Ceiling lies in [0, max(0, max)] and
// never falls as k grows, and Jittered lies in [0, Ceiling] without
// panicking.
func FuzzBackoff(f *testing.F) {
	f.Add(34, int64(time.Second), int64(math.MaxInt64))
	f.Add(0, int64(100*time.Millisecond), int64(5*time.Second))
	f.Add(63, int64(1), int64(math.MaxInt64))
	f.Add(5, int64(-1), int64(-1))
	f.Fuzz(func(t *testing.T, k int, initial, maximum int64) {
		k %= 4096
		if k < 0 {
			k = -k
		}
		in, mx := time.Duration(initial), time.Duration(maximum)
		c := Ceiling(k, in, mx)
		if c < 0 || c > max(0, mx) {
			t.Fatalf("Ceiling(%d, %v, %v) = %v, outside [0, max]", k, in, mx, c)
		}
		if next := Ceiling(k+1, in, mx); next < c {
			t.Fatalf("Ceiling(%d) = %v < Ceiling(%d) = %v", k+1, next, k, c)
		}
		if j := Jittered(k, in, mx); j < 0 || j > c {
			t.Fatalf("Jittered(%d, %v, %v) = %v, outside [0, %v]", k, in, mx, j, c)
		}
	})
}
