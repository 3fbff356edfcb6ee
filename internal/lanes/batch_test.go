package lanes_test

import (
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/amqpsub/amqpsub/internal/lanes"
)

func TestBatchesCloseAtSizeAndAtWait(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		in := make(chan item, 64)
		type got struct {
			n  int
			at time.Duration
		}
		var mu sync.Mutex
		var batches []got
		start := time.Now()
		done := make(chan struct{})
		go func() {
			defer close(done)
			lanes.Run(in, lanes.Config[item]{
				Lanes: 1, Key: keyOf, BatchSize: 10, BatchWait: 10 * time.Millisecond,
				HandleBatch: func(_ int, items []item) {
					mu.Lock()
					batches = append(batches, got{len(items), time.Since(start)})
					mu.Unlock()
				},
				Drop: func(item) { t.Error("dropped without a stop") },
			})
		}()
		for i := range 25 {
			in <- item{"k", i}
		}
		synctest.Wait()
		time.Sleep(3 * time.Millisecond)
		in <- item{"k", 25}
		time.Sleep(20 * time.Millisecond)
		// At 23ms a batch opens (its wait armed) and is filled to size at
		// 26ms; the next item starts a batch closed by its own wait, at 36ms.
		in <- item{"k", 26}
		time.Sleep(3 * time.Millisecond)
		for i := range 10 {
			in <- item{"k", 27 + i}
		}
		time.Sleep(20 * time.Millisecond)
		close(in)
		<-done
		want := []got{{10, 0}, {10, 0}, {6, 10 * time.Millisecond}, {10, 26 * time.Millisecond}, {1, 36 * time.Millisecond}}
		if fmt.Sprint(batches) != fmt.Sprint(want) {
			t.Fatalf("batches %v, want %v", batches, want)
		}
	})
}

func TestTakeRefusalsAreDropped(t *testing.T) {
	in := make(chan item, 10)
	for i := range 10 {
		in <- item{"", i}
	}
	close(in)
	var handled, dropped atomic.Int64
	lanes.Run(in, lanes.Config[item]{
		Lanes:  2,
		Take:   func(it item) bool { return it.seq >= 3 }, // refuses 0, 1, 2
		Handle: func(int, item) { handled.Add(1) },
		Drop:   func(item) { dropped.Add(1) },
	})
	if handled.Load() != 7 || dropped.Load() != 3 {
		t.Fatalf("handled %d dropped %d, want 7 and 3", handled.Load(), dropped.Load())
	}
}

// A batch still open (waiting for its wait) at a stop is dropped at once.
func TestStopDropsTheOpenBatch(t *testing.T) {
	for _, keyed := range []bool{true, false} {
		synctest.Test(t, func(t *testing.T) {
			in := make(chan item, 8)
			stop := make(chan struct{})
			var dropped atomic.Int64
			done := make(chan struct{})
			cfg := lanes.Config[item]{
				Lanes: 1, Stop: stop, BatchSize: 5, BatchWait: time.Hour,
				HandleBatch: func(int, []item) { t.Error("a batch was handled after the stop") },
				Drop:        func(item) { dropped.Add(1) },
			}
			if keyed {
				cfg.Key = keyOf
			}
			go func() {
				defer close(done)
				lanes.Run(in, cfg)
			}()
			for i := range 3 {
				in <- item{"k", i}
			}
			synctest.Wait() // 3 in the open batch, waiting for its wait
			close(stop)
			synctest.Wait()
			if n := dropped.Load(); n != 3 {
				t.Fatalf("keyed %v: dropped %d at the stop, want the 3 of the open batch", keyed, n)
			}
			close(in)
			<-done
		})
	}
}
