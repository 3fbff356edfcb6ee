// Package fake is an in-process stand-in for a go-amqp receiver and the
// broker behind it, for the pump's unit tests and benchmarks.
package fake

import (
	"context"
	"errors"
	"runtime"
	"sync"
	"time"

	"github.com/Azure/go-amqp"
)

// Outcome is what a settlement told the fake broker.
type Outcome string

// Outcomes the fake records.
const (
	Accepted Outcome = "accepted"
	Released Outcome = "released"
	Modified Outcome = "modified"
	Rejected Outcome = "rejected"
)

// Settlement is one recorded settlement.
type Settlement struct {
	Msg            *amqp.Message
	Outcome        Outcome
	DeliveryFailed bool
	Error          *amqp.Error
}

// Source is a fake receiver with a queue behind it. It sends only within the
// credit it was issued, unless Overshoot says otherwise. It is safe for
// concurrent use.
type Source struct {
	mu        sync.Mutex
	queue     []*amqp.Message // queued from head on
	head      int
	credit    int64
	overshoot int
	err       error
	record    bool
	settled   []Settlement
	counts    map[Outcome]int
	sent      int
	wake      chan struct{}
	next      time.Time // when the next paced message is due

	// Recycle, when set, puts every settled message back at the tail of the
	// queue: an endless source for benchmarks.
	Recycle bool

	// Interval, when > 0, paces Receive like a broker sending at a steady
	// rate: a message is handed over no sooner than Interval after the one
	// before it was due, and a Receive that comes late (waiting for credit,
	// or a slow consumer) does not make up for lost time with a burst. Waits
	// under a millisecond spin (yielding the processor), so pacing at
	// microsecond intervals holds. Set it before the first Receive.
	Interval time.Duration

	// OnReceive, when set, is called with each message just before Receive
	// returns it, such as to take the time it was handed over. Set it
	// before the first Receive.
	OnReceive func(m *amqp.Message)

	// SettleDelay, when > 0, makes every settlement wait that long for the
	// broker's answer (or until its ctx ends), as with receiver settle mode
	// second. Set it before the first settlement.
	SettleDelay time.Duration
	// SettleErr, when set, gives the broker's answer to a settlement of m
	// (nil: taken); ctx is the settlement's. Set it before the first
	// settlement.
	SettleErr func(ctx context.Context, m *amqp.Message) error
	// KeepLocks, when set, takes settlements after Fail as before it, as
	// Service Bus takes the settlement of a message whose link is gone by
	// its lock token. Set it before the first settlement.
	KeepLocks bool
}

// New returns a Source holding msgs. If record is true it keeps every
// settlement for Settlements.
func New(record bool, msgs ...*amqp.Message) *Source {
	return &Source{queue: append([]*amqp.Message(nil), msgs...), record: record, counts: map[Outcome]int{}, wake: make(chan struct{}, 1)}
}

func (s *Source) signal() {
	select {
	case s.wake <- struct{}{}:
	default:
	}
}

// Push appends messages to the queue.
func (s *Source) Push(msgs ...*amqp.Message) {
	s.mu.Lock()
	s.enqueue(msgs...)
	s.mu.Unlock()
	s.signal()
}

// Overshoot makes the fake send n deliveries past its credit, as RabbitMQ
// 3.10 does.
func (s *Source) Overshoot(n int) {
	s.mu.Lock()
	s.overshoot += n
	s.mu.Unlock()
	s.signal()
}

// Fail makes every later Receive and settlement fail with err, as a lost
// link does.
func (s *Source) Fail(err error) {
	s.mu.Lock()
	s.err = err
	s.mu.Unlock()
	s.signal()
}

// Receive returns the next message within the credit.
func (s *Source) Receive(ctx context.Context, _ *amqp.ReceiveOptions) (*amqp.Message, error) {
	if s.Interval > 0 {
		if err := s.pace(ctx); err != nil {
			return nil, err
		}
	}
	m, err := s.receive(ctx)
	if err == nil && s.OnReceive != nil {
		s.OnReceive(m)
	}
	return m, err
}

// pace waits until the next message is due.
func (s *Source) pace(ctx context.Context) error {
	s.mu.Lock()
	now := time.Now()
	due := s.next
	if due.Before(now) {
		due = now
	}
	s.next = due.Add(s.Interval)
	s.mu.Unlock()
	for {
		d := time.Until(due)
		if d <= 0 {
			return nil
		}
		if d > time.Millisecond {
			t := time.NewTimer(d - time.Millisecond/2)
			select {
			case <-t.C:
			case <-ctx.Done():
				t.Stop()
				return ctx.Err()
			}
			continue
		}
		if err := ctx.Err(); err != nil {
			return err
		}
		runtime.Gosched()
	}
}

func (s *Source) receive(ctx context.Context) (*amqp.Message, error) {
	for {
		s.mu.Lock()
		if s.err != nil {
			err := s.err
			s.mu.Unlock()
			return nil, err
		}
		if s.queued() > 0 && (s.credit > 0 || s.overshoot > 0) {
			m := s.queue[s.head]
			s.queue[s.head] = nil
			s.head++
			// Like go-amqp's link credit, the count goes below zero when the
			// broker overshoots, and later grants win it back.
			if s.credit <= 0 {
				s.overshoot--
			}
			s.credit--
			s.sent++
			s.mu.Unlock()
			return m, nil
		}
		s.mu.Unlock()
		select {
		case <-s.wake:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
}

// IssueCredit adds credit.
func (s *Source) IssueCredit(n uint32) error {
	s.mu.Lock()
	err := s.err
	s.credit += int64(n)
	s.mu.Unlock()
	s.signal()
	return err
}

// DrainCredit takes all credit back.
func (s *Source) DrainCredit(ctx context.Context, _ *amqp.DrainCreditOptions) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.credit = 0
	return s.err
}

func (s *Source) settle(ctx context.Context, m *amqp.Message, st Settlement) error {
	if s.SettleDelay > 0 {
		t := time.NewTimer(s.SettleDelay)
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
			return ctx.Err()
		}
	}
	if s.SettleErr != nil {
		if err := s.SettleErr(ctx, m); err != nil {
			return err
		}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.err != nil && !s.KeepLocks {
		return s.err
	}
	s.counts[st.Outcome]++
	if s.record {
		st.Msg = m
		s.settled = append(s.settled, st)
	}
	if s.Recycle || st.Outcome == Released || st.Outcome == Modified {
		s.enqueue(m)
		if s.queued() == 1 {
			s.signalLocked()
		}
	}
	return nil
}

func (s *Source) signalLocked() {
	select {
	case s.wake <- struct{}{}:
	default:
	}
}

// AcceptMessage records an accept.
func (s *Source) AcceptMessage(ctx context.Context, m *amqp.Message) error {
	return s.settle(ctx, m, Settlement{Outcome: Accepted})
}

// ReleaseMessage records a release and puts the message back.
func (s *Source) ReleaseMessage(ctx context.Context, m *amqp.Message) error {
	return s.settle(ctx, m, Settlement{Outcome: Released})
}

// RejectMessage records a reject.
func (s *Source) RejectMessage(ctx context.Context, m *amqp.Message, e *amqp.Error) error {
	return s.settle(ctx, m, Settlement{Outcome: Rejected, Error: e})
}

// ModifyMessage records a modify and puts the message back.
func (s *Source) ModifyMessage(ctx context.Context, m *amqp.Message, o *amqp.ModifyMessageOptions) error {
	if o == nil {
		o = &amqp.ModifyMessageOptions{}
	}
	return s.settle(ctx, m, Settlement{Outcome: Modified, DeliveryFailed: o.DeliveryFailed})
}

// Settlements returns a copy of the recorded settlements.
func (s *Source) Settlements() []Settlement {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]Settlement(nil), s.settled...)
}

// Count returns how many settlements had outcome o.
func (s *Source) Count(o Outcome) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.counts[o]
}

// Credit returns the credit the fake broker still has.
func (s *Source) Credit() int64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.credit
}

// Queued returns the messages waiting in the fake queue.
func (s *Source) Queued() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.queued()
}

func (s *Source) queued() int { return len(s.queue) - s.head }

// enqueue appends msgs to the queue. Before it would grow the queue's array
// it moves the queued messages to its front if that frees at least half of
// it, so an endless (Recycle) source allocates nothing once warm.
func (s *Source) enqueue(msgs ...*amqp.Message) {
	if len(s.queue)+len(msgs) > cap(s.queue) && s.head >= len(s.queue)/2 {
		n := copy(s.queue, s.queue[s.head:])
		clear(s.queue[n:])
		s.queue, s.head = s.queue[:n], 0
	}
	s.queue = append(s.queue, msgs...)
}

// ErrLinkLost is a convenient error for Fail.
var ErrLinkLost = errors.New("fake: link lost")

// Messages returns n messages whose Value is their index and whose GroupID
// is keys[i%len(keys)] (none if keys is empty).
func Messages(n int, keys ...string) []*amqp.Message {
	ms := make([]*amqp.Message, n)
	for i := range ms {
		m := &amqp.Message{Value: i, Properties: &amqp.MessageProperties{}}
		if len(keys) > 0 {
			k := keys[i%len(keys)]
			m.Properties.GroupID = &k
		}
		ms[i] = m
	}
	return ms
}
