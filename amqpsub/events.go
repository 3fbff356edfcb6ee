package amqpsub

import (
	"fmt"
	"sync"
	"sync/atomic"
	"time"
)

// EventKind says what an [Event] reports.
type EventKind uint8

const (
	// EventHandlerFailed means a handler returned an error that means [Retry]
	// (Err); the delivery went back to the broker as a failed attempt, or is
	// retried in the lane (Attempt > 0) under [LocalRetry].
	EventHandlerFailed EventKind = iota + 1
	// EventHandlerPanicked means a handler panicked (Err wraps
	// [ErrHandlerPanic] and holds the value); the delivery is retried.
	EventHandlerPanicked
	// EventPoisoned means a delivery was dead-lettered before any handler saw
	// it, its delivery count being past [MaxDeliveryCount].
	EventPoisoned
	// EventSettleFailed means the broker did not take a settlement (Err); it
	// redelivers the delivery.
	EventSettleFailed
	// EventLinkLost means the link or connection failed (Err); the subscriber
	// reconnects.
	EventLinkLost
	// EventReconnectFailed means an attempt to replace a lost link failed (Err);
	// another follows after a backoff, unless the error is fatal.
	EventReconnectFailed
	// EventReconnected means a new link replaced a lost one after Attempt
	// attempts; Err is what ended the old one, Broker names the address
	// the new one is on.
	EventReconnected
	// EventCreditOvershoot means the broker sent past the credit it was given;
	// credit is granted in windows from now on.
	EventCreditOvershoot
	// EventLockLost means a Service Bus message lock was lost (not renewed in
	// time, or refused by the service); the delivery is dropped if no
	// handler had it, else its handler's context is cancelled and its
	// settlement skipped. The service delivers it again.
	EventLockLost
	// EventAbandoned means at the end of Run, Count handlers had not returned
	// within the grace period and [CloseTimeout]; their results are ignored
	// and the broker redelivers their deliveries.
	EventAbandoned
	// EventDeadLetterCopyFailed means [DeadLetterCopy] could not send a
	// delivery's copy to the dead-letter address (Err); the delivery was
	// rejected instead, and the broker dead-letters it without the reason.
	EventDeadLetterCopyFailed
	// EventOversize means a delivery's body was larger than [MaxMessageSize]
	// (Err); it was rejected before any handler saw it.
	EventOversize
	// EventDeadLetterCopied means [DeadLetterCopy] sent a rejected
	// delivery's copy, with its reason, to the dead-letter address, and
	// the broker took it; the delivery itself is then accepted (it is
	// [OutcomeAccepted] to [Recorder.Settled] and [Delivery.OnSettled]).
	// One per copy, as [Stats.DeadLetterCopies] counts them.
	EventDeadLetterCopied
)

var eventNames = [...]string{"", "handler-failed", "handler-panicked", "poisoned", "settle-failed",
	"link-lost", "reconnect-failed", "reconnected", "credit-overshoot", "lock-lost", "abandoned", "dead-letter-copy-failed", "oversize",
	"dead-letter-copied"}

func (k EventKind) String() string {
	if int(k) < len(eventNames) && k > 0 {
		return eventNames[k]
	}
	return fmt.Sprintf("EventKind(%d)", k)
}

// Event is an error or lifecycle event of a running [Subscriber] ([OnEvent]).
type Event struct {
	Kind  EventKind
	Err   error
	Queue string
	// The delivery concerned, for the kinds about one: its message-id,
	// group-id, delivery count and lane. Lane is -1 when no lane is
	// concerned.
	MessageID     any
	GroupID       string
	DeliveryCount uint32
	Lane          int
	// Attempt is the reconnect attempt ([EventReconnected],
	// [EventReconnectFailed]) or the retry in the lane ([EventHandlerFailed]),
	// from 1; 0 otherwise.
	Attempt int
	// Count is how many handlers were abandoned ([EventAbandoned]).
	Count int
	// Broker names the address the new link is on, without credentials
	// ([EventReconnected]): with [DialFailover], the one of the list in use.
	Broker string
}

func (e Event) String() string {
	s := fmt.Sprintf("%s queue=%s", e.Kind, e.Queue)
	if e.MessageID != nil || e.GroupID != "" {
		s += fmt.Sprintf(" message_id=%v group_id=%q delivery_count=%d lane=%d", e.MessageID, e.GroupID, e.DeliveryCount, e.Lane)
	}
	if e.Attempt > 0 {
		s += fmt.Sprintf(" attempt=%d", e.Attempt)
	}
	if e.Count > 0 {
		s += fmt.Sprintf(" count=%d", e.Count)
	}
	if e.Broker != "" {
		s += " broker=" + e.Broker
	}
	if e.Err != nil {
		s += ": " + e.Err.Error()
	}
	return s
}

// eventQueueSize is how far OnEvent's function may fall behind.
const eventQueueSize = 1024

// events passes Events to the user's function on a goroutine of its own,
// and to the Recorder at once. A nil *events (no OnEvent, no WithMetrics)
// drops everything at the cost of a nil check.
type events struct {
	rec     Recorder // nil without WithMetrics
	fn      func(Event)
	ch      chan Event
	mu      sync.RWMutex // held to send, so that close never races a send
	closed  bool
	dropped atomic.Uint64
	done    chan struct{}
}

func newEvents(fn func(Event), rec Recorder) *events {
	if fn == nil && rec == nil {
		return nil
	}
	e := &events{rec: rec, fn: fn, done: make(chan struct{})}
	if fn != nil {
		e.ch = make(chan Event, eventQueueSize)
	}
	return e
}

// start runs the goroutine that calls fn; it ends after close, once the
// queued events are passed on.
func (e *events) start() {
	if e == nil {
		return
	}
	if e.fn == nil {
		close(e.done)
		return
	}
	go func() {
		defer close(e.done)
		for ev := range e.ch {
			e.fn(ev)
		}
	}()
}

// send queues ev without ever blocking; past the queue's room, or after
// close, it is dropped.
func (e *events) send(ev Event) {
	if e == nil {
		return
	}
	if e.rec != nil {
		e.rec.Event(ev)
	}
	if e.fn == nil {
		return
	}
	e.mu.RLock()
	defer e.mu.RUnlock()
	if e.closed {
		return
	}
	select {
	case e.ch <- ev:
	default:
		e.dropped.Add(1)
	}
}

// close stops taking events and waits until fn has had the queued ones, or
// until by; false means fn was still busy at by (it goes on alone).
func (e *events) close(by time.Time) bool {
	if e == nil {
		return true
	}
	e.mu.Lock()
	if !e.closed {
		e.closed = true
		if e.ch != nil {
			close(e.ch)
		}
	}
	e.mu.Unlock()
	t := time.NewTimer(time.Until(by))
	defer t.Stop()
	select {
	case <-e.done:
		return true
	case <-t.C:
		return false
	}
}

func (e *events) droppedCount() uint64 {
	if e == nil {
		return 0
	}
	return e.dropped.Load()
}
