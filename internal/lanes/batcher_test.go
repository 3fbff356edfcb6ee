package lanes

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
			b := newBatcher[int](tc.size, tc.wait)
			if _, ok := b.untilNext(t0); ok {
				t.Fatal("UntilNext ok on an empty batch")
			}
			full := -1
			for i, off := range tc.adds {
				if b.add(t0.Add(off), i) && full == -1 {
					full = i
				}
			}
			if full != tc.wantFull {
				t.Fatalf("full at %d, want %d", full, tc.wantFull)
			}
			d, ok := b.untilNext(t0.Add(tc.checkAt))
			if !ok || d != tc.wantUntil {
				t.Fatalf("UntilNext = %v,%v want %v", d, ok, tc.wantUntil)
			}
			got := b.flush()
			if len(got) != len(tc.adds) || b.count() != 0 {
				t.Fatalf("flushed %d, left %d", len(got), b.count())
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
	b := newBatcher[string](5, 10*time.Millisecond)
	b.add(t0, "a")
	b.flush()
	b.add(t0.Add(50*time.Millisecond), "b")
	if d, _ := b.untilNext(t0.Add(50 * time.Millisecond)); d != 10*time.Millisecond {
		t.Fatalf("UntilNext after flush = %v", d)
	}
}

func TestNewRejectsBadArguments(t *testing.T) {
	for _, f := range []func(){
		func() { newBatcher[int](0, 0) },
		func() { newBatcher[int](1, -1) },
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
	bt := newBatcher[int](100, 10*time.Millisecond)
	now := time.Now()
	b.ReportAllocs()
	for i := range b.N {
		if bt.add(now, i) {
			bt.flush()
		}
	}
}
