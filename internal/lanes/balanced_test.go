package lanes_test

import (
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/amqpsub/amqpsub/internal/lanes"
)

// orderCheck records, per key, the order items were handled in and which
// lanes ran the key at once.
type orderCheck struct {
	mu         sync.Mutex
	last       map[string]int
	running    map[string]int // items of a key in a handler now
	violations int
}

func newOrderCheck() *orderCheck {
	return &orderCheck{last: map[string]int{}, running: map[string]int{}}
}

func (c *orderCheck) enter(it item) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.running[it.key]++; c.running[it.key] > 1 && it.key != "" {
		c.violations++ // two items of a key at once
	}
	if it.key != "" {
		if prev, ok := c.last[it.key]; ok && it.seq != prev+1 || !ok && it.seq != 0 {
			c.violations++
		}
		c.last[it.key] = it.seq
	}
}

func (c *orderCheck) leave(it item) {
	c.mu.Lock()
	c.running[it.key]--
	c.mu.Unlock()
}

// runBalanced feeds keys (a key per item; "" for none) through balanced
// lanes whose handler takes delay(item), and returns the check and gauge.
func runBalanced(t *testing.T, lanesN int, keys []string, delay func(item) time.Duration, batch int) (*orderCheck, *lanes.Gauge) {
	c := newOrderCheck()
	g := lanes.NewGauge(lanesN)
	in := make(chan item, 64)
	go func() {
		next := map[string]int{}
		for _, k := range keys {
			in <- item{k, next[k]}
			next[k]++
		}
		close(in)
	}()
	cfg := lanes.Config[item]{Lanes: lanesN, Key: keyOf, Balanced: true, Gauge: g,
		Drop: func(item) { t.Error("dropped without a stop") }}
	if batch > 0 {
		cfg.BatchSize, cfg.BatchWait = batch, time.Millisecond
		cfg.HandleBatch = func(_ int, items []item) {
			for _, it := range items {
				c.enter(it)
				time.Sleep(delay(it))
				c.leave(it)
			}
		}
	} else {
		cfg.Handle = func(_ int, it item) {
			c.enter(it)
			time.Sleep(delay(it))
			c.leave(it)
		}
	}
	lanes.Run(in, cfg)
	return c, g
}

// Balanced placement keeps every key in order, one item at a time, with
// random keys and random handler times; the bookkeeping empties.
func TestBalancedKeepsOrderPerKey(t *testing.T) {
	for _, batch := range []int{0, 5} {
		synctest.Test(t, func(t *testing.T) {
			keys := make([]string, 3000)
			for i := range keys {
				if rand.IntN(10) == 0 {
					continue // no key
				}
				keys[i] = fmt.Sprint("k", rand.IntN(40))
			}
			c, g := runBalanced(t, 8, keys, func(item) time.Duration { return time.Duration(rand.IntN(3)) * time.Millisecond }, batch)
			if c.violations != 0 {
				t.Fatalf("batch %d: %d order violations", batch, c.violations)
			}
			r := g.Read()
			var done uint64
			for i := range r.Load {
				done += r.Finished[i]
				if r.Load[i] != 0 {
					t.Fatalf("lane %d still has load %d", i, r.Load[i])
				}
			}
			if done != 3000 || r.Keys != 0 {
				t.Fatalf("finished %d, keys held %d", done, r.Keys)
			}
		})
	}
}

// A slow key does not hold back the keys that hash to its lane: they go to
// lanes with less work while it is busy.
func TestBalancedSlowKeyDoesNotStarveItsLaneMates(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		const lanesN = 4
		slow := "slow"
		var mates []string // keys that hash to the slow key's lane
		for i := 0; len(mates) < 20; i++ {
			if k := fmt.Sprint("m", i); lanes.LaneOf(k, lanesN) == lanes.LaneOf(slow, lanesN) {
				mates = append(mates, k)
			}
		}
		var keys []string
		for range 10 {
			keys = append(keys, slow)
			keys = append(keys, mates...)
		}
		start := time.Now()
		var matesDone atomic.Int64
		var lastMate time.Duration
		var mu sync.Mutex
		c, _ := runBalanced(t, lanesN, keys, func(it item) time.Duration {
			if it.key == slow {
				return 100 * time.Millisecond
			}
			if matesDone.Add(1) == int64(10*len(mates)) {
				mu.Lock()
				lastMate = time.Since(start) + time.Millisecond
				mu.Unlock()
			}
			return time.Millisecond
		}, 0)
		if c.violations != 0 {
			t.Fatalf("%d order violations", c.violations)
		}
		// 200 mate items of 1 ms on the other lanes: well under the slow
		// key's 10 × 100 ms, which they would wait for behind it by hash.
		if lastMate > 200*time.Millisecond {
			t.Fatalf("the slow key's lane mates finished at %v", lastMate)
		}
		t.Logf("lane mates done at %v; the slow key at %v", lastMate, time.Since(start))
	})
}

// Keys spread by load: 100 keys over 8 lanes, every lane busy.
func TestBalancedSpreadsKeysByLoad(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		keys := make([]string, 4000)
		for i := range keys {
			keys[i] = fmt.Sprint("g", i%100)
		}
		start := time.Now()
		_, g := runBalanced(t, 8, keys, func(item) time.Duration { return time.Millisecond }, 0)
		took := time.Since(start)
		r := g.Read()
		min, max := r.Finished[0], r.Finished[0]
		for _, f := range r.Finished {
			min, max = minU(min, f), maxU(max, f)
		}
		// 4000 ms of work over 8 lanes: 500 ms if perfectly even.
		if took > 560*time.Millisecond || max-min > 60 {
			t.Fatalf("took %v; lanes finished %v", took, r.Finished)
		}
	})
}

func minU(a, b uint64) uint64 {
	if b < a {
		return b
	}
	return a
}

func maxU(a, b uint64) uint64 {
	if b > a {
		return b
	}
	return a
}

// Random key sequences and handler times: order holds, nothing is left.
func FuzzBalancedOrder(f *testing.F) {
	f.Add([]byte{0, 1, 2, 0, 0, 3, 1}, uint8(3), uint8(7))
	f.Fuzz(func(t *testing.T, seq []byte, lanesN, seed uint8) {
		if len(seq) == 0 || len(seq) > 500 {
			return
		}
		n := int(lanesN%8) + 1
		keys := make([]string, len(seq))
		for i, b := range seq {
			if b%7 != 0 {
				keys[i] = fmt.Sprint("k", b%11)
			}
		}
		rng := rand.New(rand.NewPCG(uint64(seed), 1))
		var mu sync.Mutex
		synctest.Test(t, func(t *testing.T) {
			c, g := runBalanced(t, n, keys, func(item) time.Duration {
				mu.Lock()
				defer mu.Unlock()
				return time.Duration(rng.IntN(4)) * time.Millisecond
			}, 0)
			if c.violations != 0 {
				t.Fatalf("%d order violations", c.violations)
			}
			if r := g.Read(); r.Keys != 0 {
				t.Fatalf("%d keys still held", r.Keys)
			}
		})
	})
}

// An item may change once it is handled or dropped (a delivery settled
// and its entry reused): the balanced placement reads its key before.
func TestBalancedReadsTheKeyBeforeTheItemChanges(t *testing.T) {
	for _, batch := range []bool{false, true} {
		synctest.Test(t, func(t *testing.T) {
			type ref struct{ key string }
			in := make(chan *ref, 100)
			for i := range 100 {
				in <- &ref{key: fmt.Sprint("k", i%7)}
			}
			close(in)
			cfg := lanes.Config[*ref]{Lanes: 3, Balanced: true,
				Key: func(r *ref) string {
					if r.key == "gone" {
						panic("the key of an item already handled was read")
					}
					return r.key
				},
				Drop: func(*ref) { t.Error("dropped without a stop") }}
			if batch {
				cfg.BatchSize, cfg.BatchWait = 4, time.Millisecond
				cfg.HandleBatch = func(_ int, rs []*ref) {
					for _, r := range rs {
						r.key = "gone"
					}
				}
			} else {
				cfg.Handle = func(_ int, r *ref) { r.key = "gone" }
			}
			lanes.Run(in, cfg)
		})
	}
}

// A batch lane that holds a key and waits for its batch to fill is woken by
// the next item of that key, which no other lane may take: the batch closes
// at its size at once, not when BatchWait runs out. (With one wake-up
// channel shared by the lanes, an idle lane could take the token and the
// holder slept until BatchWait.)
func TestBalancedBatchLaneIsWokenForItsKey(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		start := time.Now()
		in := make(chan item)
		type batch struct {
			at    time.Duration
			items []item
		}
		var mu sync.Mutex
		var got []batch
		cfg := lanes.Config[item]{Lanes: 4, Key: keyOf, Balanced: true,
			BatchSize: 3, BatchWait: time.Hour,
			HandleBatch: func(_ int, items []item) {
				mu.Lock()
				got = append(got, batch{time.Since(start), append([]item(nil), items...)})
				mu.Unlock()
			},
			Drop: func(item) { t.Error("dropped without a stop") }}
		done := make(chan struct{})
		go func() {
			defer close(done)
			lanes.Run(in, cfg)
		}()
		for i := range 3 {
			in <- item{"a", i}
			synctest.Wait() // every lane idle again: one holds "a", its batch open
		}
		mu.Lock()
		if len(got) != 1 || got[0].at != 0 || len(got[0].items) != 3 {
			t.Errorf("batches %+v, want one of 3 items at once (0s)", got)
		}
		mu.Unlock()
		close(in)
		<-done
	})
}

// A batch lane running its handler is not on the pool's idle list, even
// after a poll of its queue that found nothing: the next key goes to the
// lane that is really idle, not to it.
func TestBalancedBusyBatchLaneIsNotWokenForANewKey(t *testing.T) {
	for _, wait := range []time.Duration{time.Millisecond, 0} {
		t.Run(wait.String(), func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				start := time.Now()
				in := make(chan item)
				var mu sync.Mutex
				at := map[string]time.Duration{}
				release := make(chan struct{})
				cfg := lanes.Config[item]{Lanes: 2, Key: keyOf, Balanced: true,
					BatchSize: 10, BatchWait: wait,
					HandleBatch: func(_ int, items []item) {
						mu.Lock()
						at[items[0].key] = time.Since(start)
						mu.Unlock()
						if items[0].key == "a" {
							<-release // a slow handler: 1 min
						}
					},
					Drop: func(item) {}}
				done := make(chan struct{})
				go func() { defer close(done); lanes.Run(in, cfg) }()
				go func() { time.Sleep(time.Minute); close(release) }()
				synctest.Wait()
				in <- item{"a", 0}
				time.Sleep(10 * time.Millisecond) // a's batch closes and its handler runs
				in <- item{"b", 0}
				time.Sleep(10 * time.Millisecond)
				mu.Lock()
				_, ok := at["b"]
				mu.Unlock()
				<-release
				synctest.Wait()
				close(in)
				<-done
				mu.Lock()
				defer mu.Unlock()
				t.Logf("BatchWait %v: a at %v, b at %v", wait, at["a"], at["b"])
				if !ok {
					t.Errorf("BatchWait %v: b handled at %v (a at %v): it waited for a's handler while the other lane was idle", wait, at["b"], at["a"])
				}
			})
		})
	}
}
