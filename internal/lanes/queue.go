package lanes

import (
	"sync"
	"time"
)

// status is what a feed had to offer.
type status uint8

const (
	got      status = iota // an item
	empty                  // nothing waiting now
	closed                 // nothing more, ever
	timedOut               // the timer fired first
	stopping               // Stop was closed first
)

// A feed is where a lane or worker takes its items from: a keyed lane's
// queue, or the shared stream.
type feed[T any] interface {
	// poll takes the next item without waiting: got, empty or closed.
	poll() (T, status)
	// wait takes the next item, waiting until one comes (got), the feed is
	// closed, fire fires or flush is closed (timedOut), or stop is closed
	// (stopping). nil channels never fire.
	wait(fire <-chan time.Time, flush, stop <-chan struct{}) (T, status)
}

// queue is a keyed lane's queue: a ring buffer that the dispatcher appends
// to without ever blocking and the lane takes from in order. It grows when
// full, which happens only until it has room for what the credit lets the
// process hold.
type queue[T any] struct {
	mu       sync.Mutex
	buf      []T // len is a power of two
	head, n  int
	done     bool // closed: the lane ends once it has taken the rest
	dropping bool // stopped: nothing more is queued
	wake     chan struct{}
}

func newQueue[T any]() *queue[T] {
	return &queue[T]{buf: make([]T, 16), wake: make(chan struct{}, 1)}
}

func (q *queue[T]) signal() {
	select {
	case q.wake <- struct{}{}:
	default:
	}
}

// push appends v and reports true, or reports false once the queue was
// stopped: the caller drops v.
func (q *queue[T]) push(v T) bool {
	q.mu.Lock()
	if q.dropping {
		q.mu.Unlock()
		return false
	}
	if q.n == len(q.buf) {
		grown := make([]T, 2*len(q.buf))
		for i := range q.n {
			grown[i] = q.buf[(q.head+i)&(len(q.buf)-1)]
		}
		q.buf, q.head = grown, 0
	}
	q.buf[(q.head+q.n)&(len(q.buf)-1)] = v
	q.n++
	first := q.n == 1
	q.mu.Unlock()
	if first {
		q.signal()
	}
	return true
}

func (q *queue[T]) poll() (T, status) {
	var zero T
	q.mu.Lock()
	if q.n > 0 {
		v := q.buf[q.head]
		q.buf[q.head] = zero
		q.head = (q.head + 1) & (len(q.buf) - 1)
		q.n--
		q.mu.Unlock()
		return v, got
	}
	done := q.done
	q.mu.Unlock()
	if done {
		return zero, closed
	}
	return zero, empty
}

func (q *queue[T]) wait(fire <-chan time.Time, flush, stop <-chan struct{}) (T, status) {
	for {
		v, st := q.poll()
		if st != empty {
			return v, st
		}
		select {
		case <-q.wake:
		case <-fire:
			return v, timedOut
		case <-flush:
			return v, timedOut
		case <-stop:
			return v, stopping
		}
	}
}

// close marks the end of the items: the lane ends once it has taken the
// rest.
func (q *queue[T]) close() {
	q.mu.Lock()
	q.done = true
	q.mu.Unlock()
	q.signal()
}

// stop refuses every later push and passes what is queued to drop.
func (q *queue[T]) stop(drop func(T)) {
	q.mu.Lock()
	q.dropping = true
	items := make([]T, 0, q.n)
	for i := range q.n {
		j := (q.head + i) & (len(q.buf) - 1)
		items = append(items, q.buf[j])
		clear(q.buf[j : j+1])
	}
	q.head, q.n = 0, 0
	q.mu.Unlock()
	q.signal()
	for _, v := range items {
		drop(v)
	}
}

// chanFeed is the shared stream of unordered workers.
type chanFeed[T any] struct{ in <-chan T }

func (c chanFeed[T]) poll() (T, status) {
	select {
	case v, ok := <-c.in:
		if !ok {
			return v, closed
		}
		return v, got
	default:
		var zero T
		return zero, empty
	}
}

func (c chanFeed[T]) wait(fire <-chan time.Time, flush, stop <-chan struct{}) (T, status) {
	select {
	case v, ok := <-c.in:
		if !ok {
			return v, closed
		}
		return v, got
	case <-fire:
		var zero T
		return zero, timedOut
	case <-flush:
		var zero T
		return zero, timedOut
	case <-stop:
		var zero T
		return zero, stopping
	}
}
