// Package fake is an in-process stand-in for a go-amqp receiver and the
// broker behind it, for the pump's unit tests and benchmarks.
package fake

import (
	"context"
	"errors"
	"sync"

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
	queue     []*amqp.Message
	credit    int64
	overshoot int
	err       error
	record    bool
	settled   []Settlement
	counts    map[Outcome]int
	sent      int
	wake      chan struct{}

	// Recycle, when set, puts every settled message back at the tail of the
	// queue: an endless source for benchmarks.
	Recycle bool
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
	s.queue = append(s.queue, msgs...)
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
	for {
		s.mu.Lock()
		if s.err != nil {
			err := s.err
			s.mu.Unlock()
			return nil, err
		}
		if len(s.queue) > 0 && (s.credit > 0 || s.overshoot > 0) {
			m := s.queue[0]
			s.queue[0] = nil
			s.queue = s.queue[1:]
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

func (s *Source) settle(m *amqp.Message, st Settlement) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.err != nil {
		return s.err
	}
	s.counts[st.Outcome]++
	if s.record {
		st.Msg = m
		s.settled = append(s.settled, st)
	}
	if s.Recycle || st.Outcome == Released || st.Outcome == Modified {
		s.queue = append(s.queue, m)
		if len(s.queue) == 1 {
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
func (s *Source) AcceptMessage(_ context.Context, m *amqp.Message) error {
	return s.settle(m, Settlement{Outcome: Accepted})
}

// ReleaseMessage records a release and puts the message back.
func (s *Source) ReleaseMessage(_ context.Context, m *amqp.Message) error {
	return s.settle(m, Settlement{Outcome: Released})
}

// RejectMessage records a reject.
func (s *Source) RejectMessage(_ context.Context, m *amqp.Message, e *amqp.Error) error {
	return s.settle(m, Settlement{Outcome: Rejected, Error: e})
}

// ModifyMessage records a modify and puts the message back.
func (s *Source) ModifyMessage(_ context.Context, m *amqp.Message, o *amqp.ModifyMessageOptions) error {
	if o == nil {
		o = &amqp.ModifyMessageOptions{}
	}
	return s.settle(m, Settlement{Outcome: Modified, DeliveryFailed: o.DeliveryFailed})
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
	return len(s.queue)
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
