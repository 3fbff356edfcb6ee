package lanes_test

import (
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"go.uber.org/goleak"

	"github.com/amqpsub/amqpsub/internal/lanes"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

type item struct {
	key string
	seq int
}

func keyOf(it item) string { return it.key }

func TestKeyedLanesKeepOrderPerKey(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		const keys, per = 50, 40
		in := make(chan item, 64)
		var mu sync.Mutex
		last := map[string]int{}
		laneOf := map[string]int{}
		violations := 0
		go func() {
			next := make([]int, keys)
			for range keys * per {
				k := rand.IntN(keys)
				in <- item{fmt.Sprint("k", k), next[k]}
				next[k]++
			}
			close(in)
		}()
		lanes.Run(in, lanes.Config[item]{
			Lanes: 8,
			Key:   keyOf,
			Handle: func(lane int, it item) {
				time.Sleep(time.Duration(rand.IntN(3)) * time.Millisecond) // fake time
				mu.Lock()
				defer mu.Unlock()
				if l, ok := laneOf[it.key]; ok && l != lane {
					t.Errorf("key %s on lanes %d and %d", it.key, l, lane)
				}
				laneOf[it.key] = lane
				if prev, ok := last[it.key]; ok && it.seq != prev+1 || !ok && it.seq != 0 {
					violations++
				}
				last[it.key] = it.seq
			},
			Drop: func(item) { t.Error("drop without stop") },
		})
		if violations != 0 {
			t.Fatalf("%d order violations", violations)
		}
		for k, l := range laneOf {
			if want := lanes.LaneOf(k, 8); l != want {
				t.Fatalf("key %s on lane %d, LaneOf says %d", k, l, want)
			}
		}
	})
}

func TestKeylessItemsRotateOverLanes(t *testing.T) {
	in := make(chan item, 80)
	for i := range 80 {
		in <- item{"", i}
	}
	close(in)
	var counts [8]atomic.Int64
	lanes.Run(in, lanes.Config[item]{
		Lanes:  8,
		Key:    keyOf,
		Handle: func(lane int, _ item) { counts[lane].Add(1) },
		Drop:   func(item) { t.Error("dropped without a stop") },
	})
	for i := range counts {
		if n := counts[i].Load(); n != 10 {
			t.Fatalf("lane %d handled %d, want 10", i, n)
		}
	}
}

// A slow key must not stall the others while the stream has items: the
// lane queues are as deep as the stream.
func TestSlowLaneDoesNotBlockTheOthers(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		const depth = 100
		in := make(chan item, depth)
		slow, fast := "slow", "fast"
		for lanes.LaneOf(fast, 2) == lanes.LaneOf(slow, 2) {
			fast += "!"
		}
		release := make(chan struct{})
		var fastDone atomic.Int64
		done := make(chan struct{})
		go func() {
			defer close(done)
			lanes.Run(in, lanes.Config[item]{
				Lanes: 2,
				Key:   keyOf,
				Handle: func(_ int, it item) {
					if it.key == slow {
						<-release
						return
					}
					fastDone.Add(1)
				},
				Drop: func(item) { t.Error("dropped without a stop") },
			})
		}()
		for i := range 40 {
			in <- item{slow, i}
		}
		for i := range 40 {
			in <- item{fast, i}
		}
		synctest.Wait()
		if n := fastDone.Load(); n != 40 {
			t.Fatalf("fast lane handled %d of 40 behind a blocked lane", n)
		}
		close(release)
		close(in)
		<-done
	})
}

func TestUnorderedWorkersRunConcurrently(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		in := make(chan item, 16)
		for i := range 16 {
			in <- item{"", i}
		}
		close(in)
		var running, peak atomic.Int64
		lanes.Run(in, lanes.Config[item]{
			Lanes: 4,
			Handle: func(int, item) {
				n := running.Add(1)
				for p := peak.Load(); n > p && !peak.CompareAndSwap(p, n); p = peak.Load() {
				}
				time.Sleep(time.Millisecond)
				running.Add(-1)
			},
			Drop: func(item) { t.Error("dropped without a stop") },
		})
		if p := peak.Load(); p != 4 {
			t.Fatalf("peak concurrency %d, want 4", p)
		}
	})
}

func TestStopDropsWhatNoHandlerHasTaken(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		for _, size := range []int{1, 5} {
			in := make(chan item, 32)
			stop := make(chan struct{})
			inHandler := make(chan struct{})
			finish := make(chan struct{})
			var handled, dropped atomic.Int64
			done := make(chan struct{})
			cfg := lanes.Config[item]{
				Lanes: 1, Key: keyOf, Stop: stop,
				Drop: func(item) { dropped.Add(1) },
			}
			if size == 1 {
				cfg.Handle = func(int, item) {
					handled.Add(1)
					inHandler <- struct{}{}
					<-finish
				}
			} else {
				cfg.BatchSize, cfg.BatchWait = size, time.Second
				cfg.HandleBatch = func(_ int, items []item) {
					handled.Add(int64(len(items)))
					inHandler <- struct{}{}
					<-finish
				}
			}
			go func() {
				defer close(done)
				lanes.Run(in, cfg)
			}()
			for i := range 12 {
				in <- item{"k", i}
			}
			<-inHandler // size 1: one item in the handler; size 5: five
			close(stop)
			close(finish)
			close(in)
			<-done
			if h, d := handled.Load(), dropped.Load(); h != int64(size) || h+d != 12 {
				t.Fatalf("size %d: handled %d dropped %d", size, h, d)
			}
		}
	})
}

// At a stop, the items queued behind a handler that is still running are
// dropped at once, not when the handler returns.
func TestStopDropsQueuedBehindABusyHandler(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		in := make(chan item, 16)
		stop := make(chan struct{})
		finish := make(chan struct{})
		var dropped atomic.Int64
		done := make(chan struct{})
		go func() {
			defer close(done)
			lanes.Run(in, lanes.Config[item]{
				Lanes: 2, Key: keyOf, Stop: stop,
				Handle: func(int, item) { <-finish },
				Drop:   func(item) { dropped.Add(1) },
			})
		}()
		for i := range 10 {
			in <- item{"one-key", i}
		}
		synctest.Wait() // one in the handler, nine queued in its lane
		close(stop)
		synctest.Wait()
		if n := dropped.Load(); n != 9 {
			t.Fatalf("dropped %d while the handler runs, want the 9 queued", n)
		}
		close(finish)
		close(in)
		<-done
	})
}

// Group-ids come off the wire: any string must map to a lane in range, the
// same lane every time, and the empty string to none.
func FuzzLaneOf(f *testing.F) {
	f.Add("customer-042", 8)
	f.Add("", 1)
	f.Add("\xff\x00é", 64)
	f.Fuzz(func(t *testing.T, key string, n int) {
		if n < 1 || n > 1<<16 {
			return
		}
		l := lanes.LaneOf(key, n)
		if key == "" {
			if l != -1 {
				t.Fatalf("empty key on lane %d", l)
			}
			return
		}
		if l < 0 || l >= n {
			t.Fatalf("LaneOf(%q, %d) = %d", key, n, l)
		}
		if again := lanes.LaneOf(string([]byte(key)), n); again != l {
			t.Fatalf("LaneOf not stable: %d then %d", l, again)
		}
	})
}
