package lanes

// A batcher assembles batches that close at a size or a wait after their
// first item, whichever comes first. It is a passive state machine, like
// Benthos' batch policy: add reports when a batch is full, untilNext says
// how long until the wait closes it, and flush empties it. The loop that
// owns the timer is batchLoop (batchloop.go), and tests drive the batcher
// with explicit times.

import "time"

// batcher collects items of type T. It is not safe for concurrent use.
type batcher[T any] struct {
	size  int
	wait  time.Duration
	items []T
	first time.Time
}

// newBatcher returns a batcher that closes a batch at size items or wait after its
// first item. It panics if size < 1 or wait < 0, which callers validate
// first.
func newBatcher[T any](size int, wait time.Duration) *batcher[T] {
	if size < 1 || wait < 0 {
		panic("lanes: batch size < 1 or wait < 0")
	}
	// The batch grows as items come: a size far above what arrives (the
	// caller's bound) must not cost its memory up front.
	return &batcher[T]{size: size, wait: wait, items: make([]T, 0, min(size, 64))}
}

// add appends item, added at now, and reports whether the batch is full.
func (b *batcher[T]) add(now time.Time, item T) (full bool) {
	if len(b.items) == 0 {
		b.first = now
	}
	b.items = append(b.items, item)
	return len(b.items) >= b.size
}

// count returns the number of items in the open batch.
func (b *batcher[T]) count() int { return len(b.items) }

// untilNext returns how long after now the open batch closes by its wait: 0
// or less means it is due. ok is false when no batch is open.
func (b *batcher[T]) untilNext(now time.Time) (d time.Duration, ok bool) {
	if len(b.items) == 0 {
		return 0, false
	}
	return b.first.Add(b.wait).Sub(now), true
}

// flush closes the open batch and returns its items. The slice is reused:
// it is valid until the next add.
func (b *batcher[T]) flush() []T {
	items := b.items
	b.items = b.items[:0]
	return items
}
