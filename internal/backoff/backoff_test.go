package backoff

import (
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
