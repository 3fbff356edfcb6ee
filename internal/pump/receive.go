package pump

import (
	"context"
	"fmt"
	"sync"

	"github.com/Azure/go-amqp"

	"github.com/amqpsub/amqpsub/internal/driver"
)

// receiveLoop hands every delivery of src to the inbox until src fails or
// ctx ends. It is the only goroutine that blocks on the link. When drained
// ends (a Hold's drain was answered), it takes what is still prefetched and
// then pushes a nil marker: everything sent before the answer is ahead of it.
func receiveLoop(ctx, drained context.Context, src driver.Source, in *burst[*amqp.Message]) {
	rctx := drained
	for {
		msg, err := src.Receive(rctx, nil)
		if err != nil {
			if ctx.Err() == nil && rctx != ctx && drained.Err() != nil {
				// The call that failed may have been waiting before the
				// answer; one that starts now looks at the prefetch first.
				for {
					m, err := src.Receive(drained, nil)
					if err != nil {
						break
					}
					in.push(m)
				}
				in.push(nil)
				rctx = ctx
				continue
			}
			if ctx.Err() == nil {
				in.fail(fmt.Errorf("pump: receive: %w", err))
			}
			return
		}
		in.push(msg)
	}
}

// burst carries items from other goroutines to the pump in bursts: push
// appends and wakes the pump only when the queue was empty, so a busy pump is
// not woken once per item, and the pump takes everything queued at once. A
// push never blocks. Two of them feed the pump: the inbox (messages from a
// link's receive loop, which the credit bounds) and the settlement queue
// (one entry per held delivery at most).
type burst[T any] struct {
	mu    sync.Mutex
	items []T
	spare []T   // owned by the pump between take and recycle
	err   error // why the producer ended, once it has (the inbox only)
	wake  chan struct{}
}

// newBurst returns a burst with room for size items before it grows.
func newBurst[T any](size int) *burst[T] {
	return &burst[T]{
		items: make([]T, 0, size),
		spare: make([]T, 0, size),
		wake:  make(chan struct{}, 1),
	}
}

func (q *burst[T]) push(v T) {
	q.mu.Lock()
	q.items = append(q.items, v)
	first := len(q.items) == 1
	q.mu.Unlock()
	if first {
		q.signal()
	}
}

// fail records why the producer ended; take reports it after the items
// pushed before it.
func (q *burst[T]) fail(err error) {
	q.mu.Lock()
	q.err = err
	q.mu.Unlock()
	q.signal()
}

func (q *burst[T]) signal() {
	select {
	case q.wake <- struct{}{}:
	default:
	}
}

// take returns everything queued, and the producer's error if it has ended
// with one; the pump hands the slice back to recycle once it is done with it.
func (q *burst[T]) take() ([]T, error) {
	q.mu.Lock()
	items, err := q.items, q.err
	q.items, q.spare = q.spare, nil
	q.mu.Unlock()
	return items, err
}

func (q *burst[T]) recycle(items []T) {
	clear(items)
	q.spare = items[:0]
}

// pending reports whether anything is queued.
func (q *burst[T]) pending() bool {
	q.mu.Lock()
	defer q.mu.Unlock()
	return len(q.items) > 0
}
