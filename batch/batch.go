// Package batch assembles batches that close at a size or a wait after their
// first item, whichever comes first.
//
// A [Batcher] is a passive state machine, like Benthos' batch policy: Add
// reports when a batch is full, UntilNext says how long until the wait
// closes it, and Flush empties it. The loop that owns the timer lives with
// the caller (package lanes), and tests drive it with explicit times.
package batch

import "time"

// Batcher collects items of type T. It is not safe for concurrent use.
type Batcher[T any] struct {
	size  int
	wait  time.Duration
	items []T
	first time.Time
}

// New returns a [Batcher] that closes a batch at size items or wait after its
// first item. It panics if size < 1 or wait < 0, which callers validate
// first.
func New[T any](size int, wait time.Duration) *Batcher[T] {
	if size < 1 || wait < 0 {
		panic("batch: size < 1 or wait < 0")
	}
	// The batch grows as items come: a size far above what arrives (the
	// caller's bound) must not cost its memory up front.
	return &Batcher[T]{size: size, wait: wait, items: make([]T, 0, min(size, 64))}
}

// Add appends item, added at now, and reports whether the batch is full.
func (b *Batcher[T]) Add(now time.Time, item T) (full bool) {
	if len(b.items) == 0 {
		b.first = now
	}
	b.items = append(b.items, item)
	return len(b.items) >= b.size
}

// Len returns the number of items in the open batch.
func (b *Batcher[T]) Len() int { return len(b.items) }

// UntilNext returns how long after now the open batch closes by its wait: 0
// or less means it is due. ok is false when no batch is open.
func (b *Batcher[T]) UntilNext(now time.Time) (d time.Duration, ok bool) {
	if len(b.items) == 0 {
		return 0, false
	}
	return b.first.Add(b.wait).Sub(now), true
}

// Flush closes the open batch and returns its items. The slice is reused:
// it is valid until the next Add.
func (b *Batcher[T]) Flush() []T {
	items := b.items
	b.items = b.items[:0]
	return items
}
