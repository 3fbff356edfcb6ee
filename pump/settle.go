package pump

import "sync"

// settleQueue carries settlements from the lanes back to the pump. Any
// goroutine pushes; the pump takes everything queued at once. A push never
// blocks: the queue holds at most one entry per held delivery, and its
// slices, made at twice the credit, grow only past that (a broker
// overshooting). Pushing wakes the pump only when the queue was empty, so a
// busy pump is not woken once per settlement.
type settleQueue struct {
	mu    sync.Mutex
	items []settlement
	spare []settlement // owned by the pump between take and recycle
	wake  chan struct{}
}

func newSettleQueue(size int) settleQueue {
	return settleQueue{
		items: make([]settlement, 0, size),
		spare: make([]settlement, 0, size),
		wake:  make(chan struct{}, 1),
	}
}

func (q *settleQueue) push(s settlement) {
	q.mu.Lock()
	q.items = append(q.items, s)
	first := len(q.items) == 1
	q.mu.Unlock()
	if first {
		select {
		case q.wake <- struct{}{}:
		default:
		}
	}
}

// take returns everything queued; the pump hands the slice back to recycle
// once it has applied it.
func (q *settleQueue) take() []settlement {
	q.mu.Lock()
	items := q.items
	q.items = q.spare
	q.spare = nil
	q.mu.Unlock()
	return items
}

func (q *settleQueue) recycle(items []settlement) {
	clear(items)
	q.spare = items[:0]
}
