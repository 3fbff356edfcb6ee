package amqpsub

import (
	"context"
	"sync"
	"testing"
	"testing/synctest"

	"github.com/Azure/go-amqp"

	"github.com/amqpsub/amqpsub/internal/driver"
	"github.com/amqpsub/amqpsub/internal/driver/servicebus"
	"github.com/amqpsub/amqpsub/internal/fake"
)

type eventCatcher struct {
	mu     sync.Mutex
	events []Event
}

func (r *eventCatcher) Recorder(MetricsInfo) Recorder { return r }
func (r *eventCatcher) Received()                     {}
func (r *eventCatcher) Handled(HandlerCall)           {}
func (r *eventCatcher) Settled(Outcome, error)        {}
func (r *eventCatcher) LocksRenewed(int)              {}
func (r *eventCatcher) Dropped(int)                   {}
func (r *eventCatcher) Event(e Event) {
	r.mu.Lock()
	r.events = append(r.events, e)
	r.mu.Unlock()
}

// The lease book reports a lost lock after it let go of its mutex, so the
// delivery may have been settled and its entry given to the next one
// meanwhile (see TestOnLostNamesTheMessageThatLostItsLock in
// internal/driver/servicebus/leases_test.go): pipeEnv.LeaseLost then reports nothing,
// rather than an event naming the next delivery, whose lock is fine.
func TestLockLostOnAReusedEntryIsNotReported(t *testing.T) {
	synctest.Test(t, lockLostOnAReusedEntry)
}

func lockLostOnAReusedEntry(t *testing.T) {
	src := fake.New(false, &amqp.Message{Properties: &amqp.MessageProperties{MessageID: "old"}})
	rec := &eventCatcher{}
	s, err := New(ServiceBusSourceOf(src), "q", HandlerFunc(func(context.Context, *Delivery) error { return nil }), WithMetrics(rec))
	if err != nil {
		t.Fatal(err)
	}
	p := runPipe(t, s, src)
	old := <-p.pump.Out()
	old.Begin()
	p.pump.Settle(old, driver.Outcome{Kind: driver.Accept}) // its handler returned meanwhile
	synctest.Wait()                                         // applied: its entry is free for the next
	src.Push(&amqp.Message{Properties: &amqp.MessageProperties{MessageID: "next"}})
	next := <-p.pump.Out()
	if next.Entry() != old.Entry() {
		t.Fatal("the next delivery did not take the settled one's entry: the test shows nothing")
	}
	pipeEnv{p: p}.LeaseLost(old, &amqp.Message{Properties: &amqp.MessageProperties{MessageID: "old"}}, servicebus.ErrLockLost) // the book reports old's lock, late
	rec.mu.Lock()
	defer rec.mu.Unlock()
	for _, e := range rec.events {
		if e.Kind == EventLockLost {
			t.Fatalf("EventLockLost for message %v, reported for a delivery that had settled (its entry holds \"next\")", e.MessageID)
		}
	}
}

// runPipe runs s's first pipe's pump on src until the test ends, and
// returns the pipe.
func runPipe(t *testing.T, s *Subscriber, src driver.Source) *pipe {
	t.Helper()
	p := s.pipes[0]
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = p.pump.Run(ctx, func(context.Context, error) (driver.Source, error) { return src, nil })
	}()
	t.Cleanup(func() { cancel(); <-done })
	return p
}
