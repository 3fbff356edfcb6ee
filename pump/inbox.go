package pump

import (
	"sync"

	"github.com/Azure/go-amqp"
)

// inbox carries received messages from a link's receive loop to the pump,
// in bursts, as settleQueue carries settlements: the receive loop appends
// and wakes the pump only when the inbox was empty, and the pump takes
// everything at once. A push never blocks; the inbox holds no more than the
// broker sent, which the credit bounds.
type inbox struct {
	mu    sync.Mutex
	msgs  []*amqp.Message
	spare []*amqp.Message // owned by the pump between take and recycle
	err   error           // why the receive loop ended, once it has
	wake  chan struct{}
}

func newInbox(size int) *inbox {
	return &inbox{
		msgs:  make([]*amqp.Message, 0, size),
		spare: make([]*amqp.Message, 0, size),
		wake:  make(chan struct{}, 1),
	}
}

func (q *inbox) push(m *amqp.Message) {
	q.mu.Lock()
	q.msgs = append(q.msgs, m)
	first := len(q.msgs) == 1
	q.mu.Unlock()
	if first {
		q.signal()
	}
}

// fail records why the receive loop ended; take reports it after the
// messages that came before it.
func (q *inbox) fail(err error) {
	q.mu.Lock()
	q.err = err
	q.mu.Unlock()
	q.signal()
}

func (q *inbox) signal() {
	select {
	case q.wake <- struct{}{}:
	default:
	}
}

// take returns everything received so far, and the receive loop's error if
// it has ended with one; the pump hands the slice back to recycle.
func (q *inbox) take() ([]*amqp.Message, error) {
	q.mu.Lock()
	msgs, err := q.msgs, q.err
	q.msgs, q.spare = q.spare, nil
	q.mu.Unlock()
	return msgs, err
}

func (q *inbox) recycle(msgs []*amqp.Message) {
	clear(msgs)
	q.spare = msgs[:0]
}
