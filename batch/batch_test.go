package batch

import (
	"testing"
	"time"
)

func TestBatchClosesAtSizeOrWait(t *testing.T) {
	t0 := time.Unix(1000, 0)
	for _, tc := range []struct {
		name      string
		size      int
		wait      time.Duration
		adds      []time.Duration // offsets from t0
		wantFull  int             // index of the Add that reports full, -1 for none
		checkAt   time.Duration
		wantUntil time.Duration
	}{
		{"size closes", 3, 10 * time.Millisecond, []time.Duration{0, 1, 2}, 2, 2, 10*time.Millisecond - 2},
		{"wait counts from first item", 10, 10 * time.Millisecond, []time.Duration{0, 4 * time.Millisecond, 9 * time.Millisecond}, -1, 9 * time.Millisecond, time.Millisecond},
		{"overdue", 10, 10 * time.Millisecond, []time.Duration{0}, -1, 15 * time.Millisecond, -5 * time.Millisecond},
		{"size one", 1, 0, []time.Duration{0}, 0, 0, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b := New[int](tc.size, tc.wait)
			if _, ok := b.UntilNext(t0); ok {
				t.Fatal("UntilNext ok on an empty batch")
			}
			full := -1
			for i, off := range tc.adds {
				if b.Add(t0.Add(off), i) && full == -1 {
					full = i
				}
			}
			if full != tc.wantFull {
				t.Fatalf("full at %d, want %d", full, tc.wantFull)
			}
			d, ok := b.UntilNext(t0.Add(tc.checkAt))
			if !ok || d != tc.wantUntil {
				t.Fatalf("UntilNext = %v,%v want %v", d, ok, tc.wantUntil)
			}
			got := b.Flush()
			if len(got) != len(tc.adds) || b.Len() != 0 {
				t.Fatalf("flushed %d, left %d", len(got), b.Len())
			}
			for i, v := range got {
				if v != i {
					t.Fatalf("order: %v", got)
				}
			}
		})
	}
}

func TestFlushRestartsTheWait(t *testing.T) {
	t0 := time.Unix(0, 0)
	b := New[string](5, 10*time.Millisecond)
	b.Add(t0, "a")
	b.Flush()
	b.Add(t0.Add(50*time.Millisecond), "b")
	if d, _ := b.UntilNext(t0.Add(50 * time.Millisecond)); d != 10*time.Millisecond {
		t.Fatalf("UntilNext after flush = %v", d)
	}
}

func TestNewRejectsBadArguments(t *testing.T) {
	for _, f := range []func(){
		func() { New[int](0, 0) },
		func() { New[int](1, -1) },
	} {
		func() {
			defer func() {
				if recover() == nil {
					t.Error("no panic")
				}
			}()
			f()
		}()
	}
}

func BenchmarkAddFlush(b *testing.B) {
	bt := New[int](100, 10*time.Millisecond)
	now := time.Now()
	b.ReportAllocs()
	for i := range b.N {
		if bt.Add(now, i) {
			bt.Flush()
		}
	}
}
