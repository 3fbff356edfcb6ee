package amqpsub

import (
	"context"
	"errors"
	"sync"
	"testing"
	"testing/synctest"

	"github.com/Azure/go-amqp"

	"github.com/amqpsub/amqpsub/internal/driver"
	"github.com/amqpsub/amqpsub/internal/fake"
	"github.com/amqpsub/amqpsub/internal/servicebus"
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
// internal/servicebus/leases_test.go): sbKind.lockLost then reports nothing,
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
	p, k := runPipe(t, s, src)
	old := <-p.pump.Out()
	old.Begin()
	p.pump.Settle(old, driver.Outcome{Kind: driver.Accept}) // its handler returned meanwhile
	synctest.Wait()                                         // applied: its entry is free for the next
	src.Push(&amqp.Message{Properties: &amqp.MessageProperties{MessageID: "next"}})
	next := <-p.pump.Out()
	if next.Entry() != old.Entry() {
		t.Fatal("the next delivery did not take the settled one's entry: the test shows nothing")
	}
	k.lockLost(old, &amqp.Message{Properties: &amqp.MessageProperties{MessageID: "old"}}, servicebus.ErrLockLost) // the book reports old's lock, late
	rec.mu.Lock()
	defer rec.mu.Unlock()
	for _, e := range rec.events {
		if e.Kind == EventLockLost {
			t.Fatalf("EventLockLost for message %v, reported for a delivery that had settled (its entry holds \"next\")", e.MessageID)
		}
	}
}

// A handler whose delivery's lock was lost between the lane's Begin and the
// binding of its context (the book has let go of the delivery) gets a
// context cancelled with servicebus.ErrLockLost at once, as it would have a
// moment later, rather than one never cancelled.
func TestLeasedContextOfADeliveryOutOfTheBook(t *testing.T) {
	src := fake.New(false, &amqp.Message{Properties: &amqp.MessageProperties{MessageID: "m"}})
	s, err := New(ServiceBusSourceOf(src), "q", HandlerFunc(func(context.Context, *Delivery) error { return nil }))
	if err != nil {
		t.Fatal(err)
	}
	p, k := runPipe(t, s, src)
	tk := <-p.pump.Out()
	tk.Begin()
	hctx, release := k.handlerContext(context.Background(), tk)
	if hctx.Err() != nil {
		t.Fatalf("a delivery in the book got a cancelled context: %v", context.Cause(hctx))
	}
	release()
	k.book.Remove(tk.Entry()) // what losing its lock does
	hctx, release = k.handlerContext(context.Background(), tk)
	defer release()
	if !errors.Is(context.Cause(hctx), servicebus.ErrLockLost) {
		t.Fatalf("context of a delivery out of the book: cause %v, want servicebus.ErrLockLost", context.Cause(hctx))
	}
	p.pump.Settle(tk, driver.Outcome{Kind: driver.Accept})
}

// runPipe runs s's first pipe's pump on src (the pipe of a Service Bus
// subscriber) until the test ends, and returns it with its kind.
func runPipe(t *testing.T, s *Subscriber, src driver.Source) (*pipe, *sbKind) {
	t.Helper()
	p := s.pipes[0]
	k, ok := p.kind.(*sbKind)
	if !ok || k.book == nil {
		t.Fatal("no Service Bus kind, or no lease book, under the Service Bus profile")
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = p.pump.Run(ctx, func(context.Context, error) (driver.Source, error) { return src, nil })
	}()
	t.Cleanup(func() { cancel(); <-done })
	return p, k
}

// Which lost links Service Bus attaches again on their connection: link
// and session ends, and refusals of such an attach, but not a lost
// connection nor what azservicebus recovers with a new one; a link
// detached for its token only once fresh tokens are on the connection.
func TestServiceBusReattachOn(t *testing.T) {
	s, err := New(ServiceBusSourceOf(fake.New(false)), "q", HandlerFunc(func(context.Context, *Delivery) error { return nil }))
	if err != nil {
		t.Fatal(err)
	}
	k := s.pipes[0].kind
	detached := func(c amqp.ErrCond) error { return &amqp.LinkError{RemoteErr: &amqp.Error{Condition: c}} }
	errPut := errors.New("put-token: no answer")
	var reclaims int
	reclaim := func(err error) func(context.Context) error {
		return func(context.Context) error { reclaims++; return err }
	}
	for _, tc := range []struct {
		name    string
		lost    error
		refused bool
		reclaim func(context.Context) error
		want    bool
		claims  int
	}{
		{"forced detach", detached(amqp.ErrCondDetachForced), false, nil, true, 0},
		{"closed here", &amqp.LinkError{}, false, nil, true, 0},
		{"session ended", &amqp.SessionError{}, false, nil, true, 0},
		{"connection lost", &amqp.ConnError{}, false, nil, false, 0},
		{"connection forced", detached(amqp.ErrCondConnectionForced), false, nil, false, 0},
		{"internal error", detached(amqp.ErrCondInternalError), false, nil, false, 0},
		{"a link the pump gave up (IssueCredit refused)", errors.New("pump: issue credit: draining"), false, nil, true, 0},
		{"an attach that failed unanswered", context.DeadlineExceeded, true, nil, false, 0},
		{"attach refused", &amqp.Error{Condition: amqp.ErrCondDetachForced}, true, nil, true, 0},
		{"attach refused for the token", &amqp.Error{Condition: amqp.ErrCondUnauthorizedAccess}, true, reclaim(nil), false, 0},
		{"detached for the token, no refresher", detached(amqp.ErrCondUnauthorizedAccess), false, nil, false, 0},
		{"detached for the token, fresh tokens put", detached(amqp.ErrCondUnauthorizedAccess), false, reclaim(nil), true, 1},
		{"detached for the token, put fails", detached(amqp.ErrCondUnauthorizedAccess), false, reclaim(errPut), false, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			reclaims = 0
			c := &connection{reclaim: tc.reclaim}
			if got := k.reattachOn(t.Context(), c, tc.lost, tc.refused); got != tc.want || reclaims != tc.claims {
				t.Fatalf("reattachOn(%v, refused %v) = %v with %d put-token rounds; want %v, %d", tc.lost, tc.refused, got, reclaims, tc.want, tc.claims)
			}
		})
	}
	if (plainKind{}).reattachOn(t.Context(), &connection{}, detached(amqp.ErrCondDetachForced), false) {
		t.Fatal("plainKind reattaches on the connection")
	}
}
