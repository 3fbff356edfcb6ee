// Package lanes fans a stream of deliveries out to handlers.
//
// Two shapes:
//   - By key ([Config.Key] set): n lanes, each a goroutine that runs its items
//     one at a time, in arrival order. An item goes to the lane its key
//     hashes to (LaneOf: xxhash mod n); items without a key rotate over the
//     lanes. A dispatcher goroutine reads the stream and appends each item
//     to its lane's queue, which never blocks: the stream's capacity (the
//     credit) bounds what the queues hold together, so one slow lane never
//     holds back dispatch to the others (though its backlog may hold most
//     of the credit, and so starve them of items).
//   - Unordered (no Key): n workers take items from the stream as they come.
//
// With HandleBatch set, each lane or worker assembles its own batches
// (package batch), so under a key the order within a lane holds across
// batches.
//
// Run owns every goroutine it starts and returns only when all have ended:
// once the input is closed and every item has gone to Handle, HandleBatch or
// Drop.
package lanes

import (
	"sync"
	"sync/atomic"
	"time"

	"github.com/cespare/xxhash/v2"
)

// Config says how [Run] spreads items. Exactly one of Handle and HandleBatch
// is required.
type Config[T any] struct {
	// Lanes is the number of lanes or workers. Required, ≥ 1.
	Lanes int
	// Key, when set, gives an item's key and turns on keyed lanes. An empty
	// key counts as none.
	Key func(T) string
	// BatchSize is the most items in one HandleBatch call; ≥ 1 with
	// HandleBatch.
	BatchSize int
	// BatchWait closes a batch this long after its first item. 0 closes it
	// as soon as no more items are waiting: no wait.
	BatchWait time.Duration
	// Stop, when closed, makes lanes pass every item not yet given to a
	// handler to Drop instead. nil never closes.
	Stop <-chan struct{}
	// Flush, when closed, closes each open batch as soon as nothing more
	// is waiting, as a BatchWait of 0 does: the first part of a stop that
	// hands what is held to the handlers (pump.Hold) has no more to wait
	// for. nil never closes.
	Flush <-chan struct{}
	// Take, when set, is called for each item just before it goes to a
	// handler (or into a batch handed over); false passes it to Drop
	// instead, such as a delivery of a lost link.
	Take func(T) bool
	// Balanced, with Key, binds a key to a lane only while that lane holds
	// one of its items (in its handler or open batch): the other items wait
	// in a shared pool, in order, and any free lane takes the next ready
	// key (see pool). A key's items still run in order and one at a time,
	// but a slow key holds back no other, and keys spread over the lanes by
	// load, not by hash. Default: the hash placement of [LaneOf].
	Balanced bool
	// Gauge, when set, is kept up to date with each lane's load and count
	// of items finished, and the keys held (Balanced). Made by [NewGauge]
	// for Lanes lanes.
	Gauge *Gauge

	Handle      func(lane int, item T)
	HandleBatch func(lane int, items []T)
	// Drop receives the items no handler will see. Required.
	Drop func(item T)
}

// LaneOf returns the lane a key goes to among n lanes, as [Run] routes it.
// Empty keys rotate and have no fixed lane: LaneOf returns -1 for them.
func LaneOf(key string, n int) int {
	if key == "" {
		return -1
	}
	return laneOfHash(xxhash.Sum64String(key), n)
}

// laneOfHash is [LaneOf] of a non-empty key's xxhash h.
func laneOfHash(h uint64, n int) int {
	return int(h % uint64(n)) //nolint:gosec // G115: n ≥ 1, and the result is below n
}

// Run spreads the items of in over the lanes until in is closed and every
// lane is done. It panics on an invalid [Config], which callers validate
// first.
func Run[T any](in <-chan T, cfg Config[T]) {
	if cfg.Lanes < 1 || (cfg.Handle == nil) == (cfg.HandleBatch == nil) || cfg.Drop == nil ||
		(cfg.HandleBatch != nil && cfg.BatchSize < 1) || cfg.BatchWait < 0 {
		panic("lanes: invalid Config")
	}
	r := &runner[T]{cfg: &cfg, gauge: cfg.Gauge}
	if r.gauge == nil {
		r.gauge = NewGauge(cfg.Lanes)
	} else if len(r.gauge.lanes) != cfg.Lanes {
		panic("lanes: Gauge made for another number of lanes")
	}
	var wg sync.WaitGroup
	if cfg.Key != nil && cfg.Balanced {
		r.runPool(in)
		return
	}
	if cfg.Key == nil {
		for i := range cfg.Lanes {
			wg.Go(func() { r.worker(i, in) })
		}
		wg.Wait()
		return
	}
	r.queues = make([]*queue[T], cfg.Lanes)
	r.keys = make([]*laneKeys, cfg.Lanes)
	for i := range r.queues {
		r.queues[i] = newQueue[T]()
		r.keys[i] = &laneKeys{n: make(map[uint64]int), parked: &r.gauge.lanes[i].parked}
	}
	for i, q := range r.queues {
		wg.Go(func() { r.lane(i, q) })
	}
	inDone := make(chan struct{})
	if cfg.Stop != nil {
		// At a stop, empty the lanes' queues into Drop: what waits behind
		// a busy handler goes back now, not when the handler returns.
		wg.Go(func() {
			select {
			case <-cfg.Stop:
				for i, q := range r.queues {
					q.stop(func(item T) { r.drop(i, item) })
				}
			case <-inDone:
			}
		})
	}
	r.dispatch(in)
	close(inDone)
	for _, q := range r.queues {
		q.close()
	}
	wg.Wait()
}

type runner[T any] struct {
	cfg    *Config[T]
	queues []*queue[T] // keyed lanes (hash placement) only; set before any goroutine starts
	keys   []*laneKeys // with queues: the keys each lane holds, for Gauge.Parked
	pool   *pool[T]    // Balanced only
	gauge  *Gauge
}

// laneKeys counts the items of each key in one hash lane (queued or in
// its handler), so that the gauge's parked count holds the items that wait
// behind an earlier item of their own key: Σ max(0, count-1). The
// dispatcher adds, the lane (or a stop) removes. Keys are counted by their
// xxhash, which routing computes anyway: a map of integers costs far less
// a delivery than one of strings, and two keys of one hash in one lane (a
// chance of about n²/2⁶⁴) would only count one as parked behind the other.
type laneKeys struct {
	mu     sync.Mutex
	n      map[uint64]int
	parked *atomic.Int64 // the lane's gauge, kept with n under mu
}

// add counts an item of key hash k; when an earlier one of k is in the
// lane, the new one is parked behind it.
func (l *laneKeys) add(k uint64) {
	l.mu.Lock()
	c := l.n[k]
	l.n[k] = c + 1
	if c > 0 {
		l.parked.Add(1)
	}
	l.mu.Unlock()
}

// remove uncounts an item of key hash k that left the lane; when another
// of k is still there, the next of k is no longer parked.
func (l *laneKeys) remove(k uint64) {
	l.mu.Lock()
	c := l.n[k] - 1
	if c <= 0 {
		delete(l.n, k)
	} else {
		l.n[k] = c
		l.parked.Add(-1)
	}
	l.mu.Unlock()
}

// runPool runs the balanced placement: the dispatcher pushes into the
// pool, every lane takes from it.
func (r *runner[T]) runPool(in <-chan T) {
	cfg := r.cfg
	r.pool = newPool(cfg.Key, cfg.Lanes, r.gauge)
	var wg sync.WaitGroup
	for i := range cfg.Lanes {
		f := newPoolFeed(r.pool, i)
		wg.Go(func() {
			if cfg.HandleBatch != nil {
				r.batchLoop(i, f)
				return
			}
			r.loop(i, f, func() { r.gauge.lanes[i].load.Add(1) })
		})
	}
	inDone := make(chan struct{})
	if cfg.Stop != nil {
		wg.Go(func() {
			select {
			case <-cfg.Stop:
				r.pool.stop(cfg.Drop)
			case <-inDone:
			}
		})
	}
	for item := range in {
		if !r.pool.push(item) {
			cfg.Drop(item)
		}
	}
	close(inDone)
	r.pool.close()
	wg.Wait()
}

// flushing reports whether Flush is closed.
func (r *runner[T]) flushing() bool {
	select {
	case <-r.cfg.Flush:
		return true
	default:
		return false
	}
}

// stopped reports whether Stop is closed. A non-blocking receive from an
// open, empty channel takes no lock: this costs a few nanoseconds an item.
func (r *runner[T]) stopped() bool {
	select {
	case <-r.cfg.Stop:
		return true
	default:
		return false
	}
}

// dispatch routes each item to its lane until in is closed.
func (r *runner[T]) dispatch(in <-chan T) {
	n := len(r.queues)
	next := 0
	for item := range in {
		var lane int
		if k := r.cfg.Key(item); k == "" {
			lane = next
			if next++; next == n {
				next = 0
			}
		} else {
			h := xxhash.Sum64String(k)
			lane = laneOfHash(h, n)
			r.keys[lane].add(h)
		}
		r.gauge.lanes[lane].load.Add(1)
		if !r.queues[lane].push(item) {
			r.drop(lane, item)
		}
	}
}

// keyed reports whether items run under a key (hash lanes or the pool):
// then the lanes' calls are timed, for Gauge.Parked.
func (r *runner[T]) keyed() bool { return r.keys != nil || r.pool != nil }

// keyOf returns the item's key for finish, under a key (unordered
// workers need none). Take it before the item is handled or dropped: the
// item may change once it is (a settled delivery).
func (r *runner[T]) keyOf(item T) string {
	if r.pool == nil && r.keys == nil {
		return ""
	}
	return r.cfg.Key(item)
}

// finish accounts for an item of key k that left lane, handled or dropped.
func (r *runner[T]) finish(lane int, k string) {
	g := &r.gauge.lanes[lane]
	g.load.Add(-1)
	g.finished.Add(1)
	switch {
	case r.pool != nil:
		r.pool.finish(k)
	case r.keys != nil && k != "":
		r.keys[lane].remove(xxhash.Sum64String(k))
	}
}

// drop passes an item that was in lane to Drop.
func (r *runner[T]) drop(lane int, item T) {
	k := r.keyOf(item)
	r.cfg.Drop(item)
	r.finish(lane, k)
}

// give hands item to the handler unless the lanes are stopping or Take
// refuses it. Under a key its call is recorded on the gauge.
func (r *runner[T]) give(lane int, item T) {
	if r.stopped() || (r.cfg.Take != nil && !r.cfg.Take(item)) {
		r.drop(lane, item)
		return
	}
	k := r.keyOf(item)
	if r.keyed() {
		r.gauge.begin(lane, 1)
		r.cfg.Handle(lane, item)
		r.gauge.end(lane)
	} else {
		r.cfg.Handle(lane, item)
	}
	r.finish(lane, k)
}

// loop gives lane i the items of f, one at a time, until f is closed;
// took, when set, is told of each item as it is taken.
func (r *runner[T]) loop(i int, f feed[T], took func()) {
	for {
		item, st := f.wait(nil, nil, nil) // it polls first
		if st != got {
			return
		}
		if took != nil {
			took()
		}
		r.give(i, item)
	}
}

// lane runs the items of one keyed lane in order.
func (r *runner[T]) lane(i int, q *queue[T]) {
	if r.cfg.HandleBatch != nil {
		r.batchLoop(i, q)
		return
	}
	r.loop(i, q, nil)
}

// worker runs items of the shared stream as they come.
func (r *runner[T]) worker(i int, in <-chan T) {
	if r.cfg.HandleBatch != nil {
		r.batchLoop(i, chanFeed[T]{in})
		return
	}
	for item := range in {
		r.gauge.lanes[i].load.Add(1)
		r.give(i, item) // not recorded: unordered workers park nothing
	}
}
