package lanes

import (
	"sync"
	"time"
)

// pool is the balanced placement (Config.Balanced): one shared store of
// the items waiting, from which any free lane takes the next ready key.
// A key is bound to a lane only while that lane holds one of its items
// (taken, in its handler or open batch); the key's other items wait in the
// pool, in order, and go to the lane that holds the key, or, once it has
// none, back to the ready line for any lane. So a key's items run in
// order and one at a time, a slow key holds back no other, and the keys
// spread over the lanes by how soon each lane is free. Items without a
// key go to the next free lane.
//
// The dispatcher pushes, the lanes take (through a poolFeed each) and
// report each item finished. Everything is guarded by mu, taken once per
// push, take and finish; a key's record is reused once it is gone, so the
// steady state allocates nothing.
type pool[T any] struct {
	key func(T) string

	mu      sync.Mutex
	keys    map[string]*pkey[T] // keys with items waiting or taken
	spare   []*pkey[T]
	ready   ring[pentry[T]] // keys with items waiting and none taken; keyless items
	waiting int             // items in the pool, not taken
	done    bool            // no more pushes: lanes end once nothing is left for them
	stopped bool            // Stop: pushes are refused
	idle    []*poolFeed[T]  // lanes that found nothing and wait on their wake
	closed  chan struct{}   // closed when done is set
	gauge   *Gauge
}

type pkey[T any] struct {
	name   string
	items  ring[T]
	taken  int          // items of the key in a lane now
	owner  *poolFeed[T] // the lane that holds them, while taken > 0
	queued bool         // in ready
}

// pentry is an entry of the ready line: a key, or an item without one.
type pentry[T any] struct {
	k    *pkey[T]
	item T
}

func newPool[T any](key func(T) string, lanes int, g *Gauge) *pool[T] {
	return &pool[T]{key: key, keys: make(map[string]*pkey[T], 64), idle: make([]*poolFeed[T], 0, lanes),
		closed: make(chan struct{}), gauge: g}
}

// wakeIdle picks a lane to wake for an entry just put in the ready line:
// the lane that went idle last (its caches are the warmest), or nil when
// none is idle: every lane will look at the line before it waits. Under
// mu; the caller signals the lane after unlocking.
func (p *pool[T]) wakeIdle() *poolFeed[T] {
	n := len(p.idle)
	if n == 0 {
		return nil
	}
	f := p.idle[n-1]
	p.idle[n-1] = nil
	p.idle = p.idle[:n-1]
	f.isIdle = false
	return f
}

// wakeOwner picks the lane holding a key that just got an item, if it is
// idle (a batch lane waiting for its batch to fill): no other lane may take
// that item. Under mu.
func (p *pool[T]) wakeOwner(f *poolFeed[T]) *poolFeed[T] {
	if f == nil || !f.isIdle {
		return nil
	}
	p.unidle(f)
	return f
}

// unidle takes f off the idle list. Under mu.
func (p *pool[T]) unidle(f *poolFeed[T]) {
	for i, g := range p.idle {
		if g == f {
			last := len(p.idle) - 1
			p.idle[i] = p.idle[last]
			p.idle[last] = nil
			p.idle = p.idle[:last]
			break
		}
	}
	f.isIdle = false
}

// signal wakes f, if not nil.
func signal[T any](f *poolFeed[T]) {
	if f == nil {
		return
	}
	select {
	case f.wake <- struct{}{}:
	default:
	}
}

// push adds an item and reports true, or false once the pool was stopped:
// the caller drops it.
func (p *pool[T]) push(item T) bool {
	k := p.key(item)
	p.mu.Lock()
	if p.stopped {
		p.mu.Unlock()
		return false
	}
	p.waiting++
	var wake *poolFeed[T]
	if k == "" {
		p.ready.push(pentry[T]{item: item})
		wake = p.wakeIdle()
	} else {
		pk := p.keys[k]
		if pk == nil {
			if n := len(p.spare); n > 0 {
				pk = p.spare[n-1]
				p.spare = p.spare[:n-1]
			} else {
				pk = &pkey[T]{}
			}
			pk.name = k
			p.keys[k] = pk
			p.gauge.keys.Store(int64(len(p.keys)))
		}
		pk.items.push(item)
		switch {
		case pk.taken > 0:
			p.park(pk.owner, 1)
			wake = p.wakeOwner(pk.owner)
		case !pk.queued:
			pk.queued = true
			p.ready.push(pentry[T]{k: pk})
			wake = p.wakeIdle()
		}
	}
	p.mu.Unlock()
	signal(wake)
	return true
}

// close says no more items come.
func (p *pool[T]) close() {
	p.mu.Lock()
	p.done = true
	p.mu.Unlock()
	close(p.closed)
}

// stop refuses every later push and passes what waits to drop.
func (p *pool[T]) stop(drop func(T)) {
	p.mu.Lock()
	p.stopped = true
	items := make([]T, 0, p.waiting)
	for p.ready.n > 0 {
		e := p.ready.pop()
		if e.k == nil {
			items = append(items, e.item)
		}
	}
	for name, pk := range p.keys {
		for pk.items.n > 0 {
			items = append(items, pk.items.pop())
		}
		pk.queued = false
		if pk.taken == 0 {
			p.forget(name, pk)
		}
	}
	p.waiting = 0
	if p.gauge != nil {
		for i := range p.gauge.lanes {
			p.gauge.lanes[i].parked.Store(0)
		}
	}
	p.mu.Unlock()
	for _, it := range items {
		drop(it)
	}
}

// park adds n to the items parked for lane f, for Gauge.Parked: the
// items in the pool of the keys that lane holds. Under mu.
func (p *pool[T]) park(f *poolFeed[T], n int) {
	if p.gauge != nil {
		p.gauge.lanes[f.lane].parked.Add(int64(n))
	}
}

// forget removes a key with nothing waiting or taken. Under mu.
func (p *pool[T]) forget(name string, pk *pkey[T]) {
	delete(p.keys, name)
	var zero T
	pk.name, pk.owner = "", nil
	pk.items.clearTo(zero)
	p.spare = append(p.spare, pk)
	p.gauge.keys.Store(int64(len(p.keys)))
}

// finish releases an item of key k that a lane has finished (handled or
// dropped): once a key has none taken, its next item waits for any lane.
func (p *pool[T]) finish(k string) {
	if k == "" {
		return
	}
	p.mu.Lock()
	pk := p.keys[k]
	if pk == nil {
		p.mu.Unlock()
		return
	}
	if pk.taken--; pk.taken > 0 {
		p.mu.Unlock()
		return
	}
	if pk.items.n == 0 {
		p.forget(k, pk)
		p.mu.Unlock()
		return
	}
	p.park(pk.owner, -pk.items.n) // any lane may take them now
	pk.queued = true
	p.ready.push(pentry[T]{k: pk})
	wake := p.wakeIdle()
	p.mu.Unlock()
	signal(wake)
}

// poolFeed is one lane's feed from the pool (see feed): the next item of a
// key the lane holds, else the next ready entry.
type poolFeed[T any] struct {
	p      *pool[T]
	lane   int
	mine   []*pkey[T]    // keys this lane holds (taken > 0)
	wake   chan struct{} // a token when the lane should look again
	isIdle bool          // on p.idle; under p.mu
}

func newPoolFeed[T any](p *pool[T], lane int) *poolFeed[T] {
	return &poolFeed[T]{p: p, lane: lane, wake: make(chan struct{}, 1)}
}

// poll takes the next item for this lane without waiting. A lane that
// polls is not idle, whatever it finds: only wait puts a lane on the idle
// list, for as long as it waits.
func (f *poolFeed[T]) poll() (T, status) {
	v, st := f.take()
	f.busy()
	f.p.mu.Unlock()
	return v, st
}

// busy takes the lane off the idle list if it is on it. Under p.mu.
func (f *poolFeed[T]) busy() {
	if f.isIdle {
		f.p.unidle(f)
	}
}

// take is poll's work; it returns with p.mu held.
func (f *poolFeed[T]) take() (T, status) {
	p := f.p
	var zero T
	p.mu.Lock()
	// Keep to the keys this lane holds, so that a batch takes a key's
	// items together and in order; forget those it no longer holds.
	n := 0
	for _, pk := range f.mine {
		if pk.taken > 0 && pk.owner == f {
			f.mine[n] = pk
			n++
		}
	}
	clear(f.mine[n:])
	f.mine = f.mine[:n]
	for _, pk := range f.mine {
		if pk.items.n > 0 {
			pk.taken++
			p.waiting--
			p.park(f, -1)
			return pk.items.pop(), got
		}
	}
	for p.ready.n > 0 {
		e := p.ready.pop()
		if e.k == nil {
			p.waiting--
			return e.item, got
		}
		pk := e.k
		pk.queued = false
		if pk.items.n == 0 {
			continue // emptied by a stop
		}
		pk.taken++
		pk.owner = f
		p.waiting--
		f.mine = append(f.mine, pk)
		item := pk.items.pop()
		p.park(f, pk.items.n) // the rest wait for this lane now
		return item, got
	}
	if p.done {
		return zero, closed
	}
	return zero, empty
}

// wait takes the next item for this lane, waiting on the idle list while
// there is none; the lane leaves the list whenever wait returns.
func (f *poolFeed[T]) wait(fire <-chan time.Time, flush, stop <-chan struct{}) (T, status) {
	closed := f.p.closed
	for {
		v, st := f.take()
		if st != empty {
			f.busy()
			f.p.mu.Unlock()
			return v, st
		}
		if !f.isIdle {
			f.isIdle = true
			f.p.idle = append(f.p.idle, f)
		}
		f.p.mu.Unlock()
		select {
		case <-f.wake:
		case <-closed:
			closed = nil // take says closed once nothing is left for this lane
		case <-fire:
			f.leaveIdle()
			return v, timedOut
		case <-flush:
			f.leaveIdle()
			return v, timedOut
		case <-stop:
			f.leaveIdle()
			return v, stopping
		}
	}
}

// leaveIdle takes the lane off the idle list, taking p.mu.
func (f *poolFeed[T]) leaveIdle() {
	f.p.mu.Lock()
	f.busy()
	f.p.mu.Unlock()
}

// ring is a FIFO ring buffer that grows as needed.
type ring[T any] struct {
	buf     []T // len is 0 or a power of two
	head, n int
}

func (r *ring[T]) push(v T) {
	if r.n == len(r.buf) {
		size := max(8, 2*len(r.buf))
		grown := make([]T, size)
		for i := range r.n {
			grown[i] = r.buf[(r.head+i)&(len(r.buf)-1)]
		}
		r.buf, r.head = grown, 0
	}
	r.buf[(r.head+r.n)&(len(r.buf)-1)] = v
	r.n++
}

func (r *ring[T]) pop() T {
	var zero T
	v := r.buf[r.head]
	r.buf[r.head] = zero
	r.head = (r.head + 1) & (len(r.buf) - 1)
	r.n--
	return v
}

// clearTo empties the ring, keeping its buffer.
func (r *ring[T]) clearTo(zero T) {
	for r.n > 0 {
		r.buf[r.head] = zero
		r.head = (r.head + 1) & (len(r.buf) - 1)
		r.n--
	}
	r.head = 0
}
