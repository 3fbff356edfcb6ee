package amqpsubtest

import (
	"context"
	"errors"
	"fmt"
	"math"
	"testing"
	"testing/synctest"
	"time"

	"github.com/Azure/go-amqp"
	"go.uber.org/goleak"

	"github.com/amqpsub/amqpsub/amqpsub"
	"github.com/amqpsub/amqpsub/internal/driver/servicebus"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// These tests drive links the way the pump does, to pin down what the queue
// does with each call; queue_test.go runs real subscribers.

func open(t *testing.T, q *Queue) *link {
	t.Helper()
	src, err := q.attach(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	switch l := src.(type) {
	case serviceBusLink:
		return l.link
	case rabbit4Link:
		return l.link
	}
	return src.(*link)
}

func receive(t *testing.T, l *link) *amqp.Message {
	t.Helper()
	m, err := l.Receive(t.Context(), nil)
	if err != nil {
		t.Fatal(err)
	}
	return m
}

func body(m *amqp.Message) string { return string(m.GetData()) }

func history(q *Queue) string {
	s := ""
	for _, r := range q.Records() {
		s += r.String() + "\n"
	}
	return s
}

func TestReceiveStaysWithinCredit(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		q := NewQueue()
		q.Publish(Message("", "0"), Message("", "1"), Message("", "2"))
		l := open(t, q)
		got := make(chan *amqp.Message, 3)
		go func() {
			for range 3 {
				m, err := l.Receive(t.Context(), nil)
				if err != nil {
					panic(err)
				}
				got <- m
			}
		}()
		synctest.Wait()
		if len(got) != 0 {
			t.Fatal("received without credit")
		}
		_ = l.IssueCredit(2)
		synctest.Wait()
		if len(got) != 2 {
			t.Fatalf("received %d with a credit of 2", len(got))
		}
		_ = l.IssueCredit(1)
		synctest.Wait()
		if len(got) != 3 {
			t.Fatalf("received %d with a credit of 3", len(got))
		}
	})
}

func TestOutcomesRequeueInPlaceAndCountOnlyFailures(t *testing.T) {
	q := NewQueue(MaxDeliveryAttempts(2))
	q.Publish(Message("", "0"), Message("", "1"), Message("", "2"))
	l := open(t, q)
	_ = l.IssueCredit(100)
	settle := func(want string, f func(m *amqp.Message) error) {
		t.Helper()
		m := receive(t, l)
		if body(m) != want {
			t.Fatalf("received %q, want %q", body(m), want)
		}
		if err := f(m); err != nil {
			t.Fatal(err)
		}
	}
	ctx := t.Context()
	release := func(m *amqp.Message) error { return l.ReleaseMessage(ctx, m) }
	modify := func(m *amqp.Message) error { return l.ModifyMessage(ctx, m, &amqp.ModifyMessageOptions{}) }
	fail := func(m *amqp.Message) error {
		return l.ModifyMessage(ctx, m, &amqp.ModifyMessageOptions{DeliveryFailed: true})
	}
	accept := func(m *amqp.Message) error { return l.AcceptMessage(ctx, m) }
	// A message put back comes next again: it goes back to its place in
	// publish order, ahead of the later ones.
	settle("0", release)
	settle("0", modify)
	settle("0", fail)
	settle("0", accept)
	settle("1", fail)
	settle("1", fail) // the 2nd failure: dead-lettered
	settle("2", func(m *amqp.Message) error {
		return l.RejectMessage(ctx, m, &amqp.Error{Condition: amqpsub.RejectCondition, Description: "bad"})
	})
	want := "#0: 0 released, 0 modified, 0 modified{delivery-failed}, 1 accepted → consumed\n" +
		"#1: 0 modified{delivery-failed}, 1 modified{delivery-failed} → dead-lettered\n" +
		"#2: 0 rejected \"bad\" → dead-lettered\n"
	if got := history(q); got != want {
		t.Fatalf("history:\n%swant:\n%s", got, want)
	}
	if err := q.Wait(ctx); err != nil {
		t.Fatal(err)
	}
}

func TestDeliveriesAreCopies(t *testing.T) {
	q := NewQueue()
	orig := Message("g", "x")
	orig.Header = &amqp.MessageHeader{Durable: true, DeliveryCount: 3}
	q.Publish(orig)
	l := open(t, q)
	_ = l.IssueCredit(1)
	m := receive(t, l)
	if m == orig || m.Header == orig.Header {
		t.Fatal("the delivery shares the published message or its header")
	}
	if !m.Header.Durable || m.Header.DeliveryCount != 3 || orig.Header.DeliveryCount != 3 {
		t.Fatalf("delivered header %+v, published %+v", *m.Header, *orig.Header)
	}
	// Settling the published message instead of the delivery is refused.
	if err := l.AcceptMessage(t.Context(), orig); !errors.Is(err, errUnknown) {
		t.Fatalf("accepting the published message = %v", err)
	}
	if err := l.AcceptMessage(t.Context(), m); err != nil {
		t.Fatal(err)
	}
	if err := l.AcceptMessage(t.Context(), m); !errors.Is(err, errUnknown) {
		t.Fatalf("second accept = %v", err)
	}
}

func TestLostLinkRequeuesUncountedAndFailsLater(t *testing.T) {
	q := NewQueue()
	q.Publish(Message("", "0"), Message("", "1"))
	l := open(t, q)
	_ = l.IssueCredit(2)
	m0, _ := receive(t, l), receive(t, l)
	q.LoseLinks(nil)
	var le *amqp.LinkError
	if _, err := l.Receive(t.Context(), nil); !errors.As(err, &le) || le.RemoteErr.Condition != amqp.ErrCondDetachForced {
		t.Fatalf("Receive after the loss = %v", err)
	}
	if err := l.AcceptMessage(t.Context(), m0); !errors.As(err, &le) {
		t.Fatalf("accept after the loss = %v", err)
	}
	if err := l.IssueCredit(1); err != nil {
		t.Fatalf("IssueCredit after the loss = %v, want nil as from go-amqp", err)
	}
	l2 := open(t, q)
	_ = l2.IssueCredit(2)
	for _, want := range []string{"0", "1"} {
		m := receive(t, l2)
		if body(m) != want || m.Header.DeliveryCount != 0 {
			t.Fatalf("redelivered %q count %d", body(m), m.Header.DeliveryCount)
		}
	}
	r := q.Records()[0]
	if fmt.Sprint(r.Deliveries) != "[0 unsettled 0 pending]" || r.Deliveries[0].Link != 1 || r.Deliveries[1].Link != 2 {
		t.Fatalf("deliveries %v", r.Deliveries)
	}
}

// go-amqp's IssueCredit never looks at the link: on a lost link, however
// it ended, it returns nil, and the credit goes nowhere.
func TestIssueCreditOnALostLinkReturnsNil(t *testing.T) {
	for _, c := range []struct {
		name string
		end  func(q *Queue, l *link)
	}{
		{"LoseLinks", func(q *Queue, _ *link) { q.LoseLinks(nil) }},
		{"Close", func(_ *Queue, l *link) { _ = l.Close(context.Background()) }},
		{"Receive's ctx", func(_ *Queue, l *link) {
			ctx, cancel := context.WithCancel(context.Background())
			cancel()
			_, _ = l.Receive(ctx, nil)
		}},
		{"session ended", func(q *Queue, _ *link) { q.LoseLinks(&amqp.SessionError{}) }},
	} {
		t.Run(c.name, func(t *testing.T) {
			q := NewQueue()
			q.Publish(Message("", "0"))
			l := open(t, q)
			c.end(q, l)
			q.FailIssueCredit(1)
			if err := l.IssueCredit(5); err != nil {
				t.Fatalf("IssueCredit on the lost link = %v, want nil", err)
			}
			if got := q.Credit(); got != 0 {
				t.Fatalf("Credit() = %d after credit on a lost link, want 0", got)
			}
			if _, err := l.Receive(t.Context(), nil); err == nil {
				t.Fatal("Receive on the lost link succeeded")
			}
			// The fault is left for a link that is attached.
			l2 := open(t, q)
			if err := l2.IssueCredit(1); err == nil {
				t.Fatal("FailIssueCredit(1) was used up by the lost link")
			}
		})
	}
}

// FailIssueCredit fails the next n calls as a pending drain does in go-amqp:
// same text, no credit added, the link still attached; then credit flows
// again.
func TestFailIssueCreditFailsAsAPendingDrain(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		q := NewQueue()
		q.Publish(Message("", "0"), Message("", "1"), Message("", "2"))
		l := open(t, q)
		if err := l.IssueCredit(1); err != nil {
			t.Fatal(err)
		}
		q.FailIssueCredit(2)
		for range 2 {
			err := l.IssueCredit(10)
			if err == nil || err.Error() != "link is currently draining, no credits can be added" {
				t.Fatalf("IssueCredit under the fault = %v", err)
			}
			var le *amqp.LinkError
			if errors.As(err, &le) {
				t.Fatalf("IssueCredit under the fault = %T, a link error: go-amqp's is a plain error", err)
			}
		}
		if got := q.Credit(); got != 1 {
			t.Fatalf("Credit() = %d after failed grants, want the 1 given before", got)
		}
		if m := receive(t, l); body(m) != "0" {
			t.Fatalf("received %q on the link after the fault", body(m))
		}
		if err := l.IssueCredit(2); err != nil {
			t.Fatalf("IssueCredit once the fault is used up = %v", err)
		}
		if m := receive(t, l); body(m) != "1" {
			t.Fatalf("received %q", body(m))
		}
		q.FailIssueCredit(5)
		q.FailIssueCredit(0)
		if err := l.IssueCredit(1); err != nil {
			t.Fatalf("IssueCredit after FailIssueCredit(0) = %v", err)
		}
		if got := q.Credit(); got != 2 {
			t.Fatalf("Credit() = %d, want 2", got)
		}
	})
}

func TestReceiveCancelledEndsTheLink(t *testing.T) {
	q := NewQueue()
	q.Publish(Message("", "0"), Message("", "1"))
	l := open(t, q)
	_ = l.IssueCredit(1)
	receive(t, l)
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	if _, err := l.Receive(ctx, nil); !errors.Is(err, context.Canceled) {
		t.Fatalf("Receive = %v", err)
	}
	if got := len(q.Queued()); got != 2 {
		t.Fatalf("%d queued after the receiver closed, want 2", got)
	}
}

func TestMessageGroupsGoToOneLinkAtATime(t *testing.T) {
	q := NewQueue()
	q.Publish(Message("g", "g0"), Message("g", "g1"), Message("", "free"), Message("h", "h0"))
	a, b := open(t, q), open(t, q)
	_ = a.IssueCredit(1)
	if m := receive(t, a); body(m) != "g0" { // a owns g
		t.Fatalf("a got %q", body(m))
	}
	// a has no credit: b's pass over the queue stops at g1, as Artemis's
	// does at a busy group owner.
	_ = b.IssueCredit(10)
	q.mu.Lock()
	r := q.next(b)
	q.mu.Unlock()
	if r != nil {
		t.Fatalf("b got #%d past a busy owner's group", r.index)
	}
	// With credit, a takes its group's message and b passes over it.
	q.mu.Lock()
	a.credit = 1
	q.mu.Unlock()
	if m := receive(t, b); body(m) != "free" {
		t.Fatalf("b got %q", body(m))
	}
	if m := receive(t, a); body(m) != "g1" {
		t.Fatalf("a got %q", body(m))
	}
	if m := receive(t, b); body(m) != "h0" {
		t.Fatalf("b got %q", body(m))
	}
	// When a's link ends, g is free: b gets it, in order.
	q.Publish(Message("g", "g2"))
	q.LoseLinks(nil)
	b = open(t, q)
	_ = b.IssueCredit(10)
	for _, want := range []string{"g0", "g1", "free", "h0", "g2"} {
		if m := receive(t, b); body(m) != want {
			t.Fatalf("after the loss b got %q, want %q", body(m), want)
		}
	}
}

func TestGroupSequenceMinusOneClosesTheGroup(t *testing.T) {
	q := NewQueue()
	last := Message("g", "g0")
	seq := uint32(math.MaxUint32)
	last.Properties.GroupSequence = &seq
	q.Publish(last, Message("g", "g1"))
	a, b := open(t, q), open(t, q)
	_ = a.IssueCredit(1)
	receive(t, a)
	_ = b.IssueCredit(1)
	if m := receive(t, b); body(m) != "g1" {
		t.Fatalf("b got %q", body(m))
	}
}

func TestRabbitMQ3(t *testing.T) {
	q := NewQueue(WithProfile(amqpsub.RabbitMQ3), MaxDeliveryAttempts(1))
	q.Publish(Message("g", "0"), Message("g", "1"))
	a, b := open(t, q), open(t, q)
	_ = a.IssueCredit(1)
	_ = b.IssueCredit(1)
	// No message groups: the group's second message goes to b.
	m0, m1 := receive(t, a), receive(t, b)
	if !m0.Header.FirstAcquirer || body(m1) != "1" {
		t.Fatalf("first delivery: first-acquirer %v; b got %q", m0.Header.FirstAcquirer, body(m1))
	}
	_ = b.ReleaseMessage(t.Context(), m1)
	// modified ends the session; the message goes back uncounted.
	err := a.ModifyMessage(t.Context(), m0, &amqp.ModifyMessageOptions{DeliveryFailed: true})
	var se *amqp.SessionError
	if !errors.As(err, &se) || se.RemoteErr.Condition != amqp.ErrCondInvalidField {
		t.Fatalf("modify = %v", err)
	}
	if _, err := a.Receive(t.Context(), nil); !errors.As(err, &se) {
		t.Fatalf("Receive after modify = %v", err)
	}
	_ = b.IssueCredit(2)
	for _, want := range []string{"0", "1"} {
		m := receive(t, b)
		if body(m) != want || m.Header.DeliveryCount != 0 || m.Header.FirstAcquirer {
			t.Fatalf("redelivery %q: %+v", body(m), *m.Header)
		}
	}
}

func TestRulesForEveryProfile(t *testing.T) {
	for _, p := range []amqpsub.Profile{amqpsub.Artemis, amqpsub.Generic, amqpsub.RabbitMQ3, amqpsub.AzureServiceBus} {
		if _, ok := rulesFor(p); !ok {
			t.Errorf("no rules for %s", p)
		}
	}
	defer func() {
		if recover() == nil {
			t.Error("NewQueue accepted the zero Profile")
		}
	}()
	NewQueue(WithProfile(amqpsub.Profile{}))
}

func TestUndeliverableHereKeepsTheMessageFromThatLink(t *testing.T) {
	q := NewQueue()
	q.Publish(Message("", "0"), Message("", "1"))
	a := open(t, q)
	_ = a.IssueCredit(3)
	m := receive(t, a)
	if err := a.ModifyMessage(t.Context(), m, &amqp.ModifyMessageOptions{UndeliverableHere: true}); err != nil {
		t.Fatal(err)
	}
	if m := receive(t, a); body(m) != "1" {
		t.Fatalf("a got %q", body(m))
	}
	b := open(t, q)
	_ = b.IssueCredit(1)
	if m := receive(t, b); body(m) != "0" || m.Header.DeliveryCount != 0 {
		t.Fatalf("b got %q, count %d", body(m), m.Header.DeliveryCount)
	}
}

// Service Bus locks at the link: renewals, expiry found lazily, settlements
// after expiry, and a Receive that wakes at the next expiry.
func TestServiceBusLocksAtTheLink(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		q := NewQueue(WithProfile(amqpsub.AzureServiceBus), MaxDeliveryAttempts(2))
		q.Publish(Message("", "a"), Message("", "b"))
		start := time.Now()
		l := open(t, q)
		if err := l.IssueCredit(2); err != nil {
			t.Fatal(err)
		}
		a, b := receive(t, l), receive(t, l)
		ta, _ := servicebus.LockToken(a.DeliveryTag)
		tb, _ := servicebus.LockToken(b.DeliveryTag)
		ctx := t.Context()

		time.Sleep(30 * time.Second)
		exp, err := l.renewLocks(ctx, []amqp.UUID{ta})
		if err != nil || len(exp) != 1 || !exp[0].Equal(start.Add(90*time.Second)) {
			t.Fatalf("renew a: %v, %v", exp, err)
		}
		time.Sleep(31 * time.Second) // b's lock expired at 60 s
		if _, err := l.renewLocks(ctx, []amqp.UUID{ta, tb}); !errors.Is(err, servicebus.ErrLockLost) {
			t.Fatalf("renew a and b: %v", err)
		}
		// All or nothing: a was not renewed by the refused request.
		if d := q.Records()[0].Deliveries[0]; d.Renewals != 1 || !d.LockedUntil.Equal(start.Add(90*time.Second)) {
			t.Fatalf("a: %+v", d)
		}
		var ae *amqp.Error
		if err := l.AcceptMessage(ctx, b); !errors.As(err, &ae) || ae.Condition != servicebus.CondLockLost {
			t.Fatalf("accept after expiry: %v", err)
		}
		if err := l.AcceptMessage(ctx, b); err != errUnknown {
			t.Fatalf("a second accept after expiry: %v", err)
		}
		if err := l.ModifyMessage(ctx, a, &amqp.ModifyMessageOptions{UndeliverableHere: true}); !errors.As(err, &ae) ||
			ae.Condition != amqp.ErrCondNotImplemented {
			t.Fatalf("defer: %v", err)
		}
		// b is back, counted; a Receive waiting with credit gets it, and
		// a again once its lock expires at 90 s.
		if err := l.IssueCredit(2); err != nil {
			t.Fatal(err)
		}
		if m := receive(t, l); body(m) != "b" || m.Header.DeliveryCount != 1 || time.Since(start) != 61*time.Second {
			t.Fatalf("redelivered %q count %d at %v", body(m), m.Header.DeliveryCount, time.Since(start))
		}
		a2 := receive(t, l)
		if body(a2) != "a" || a2.Header.DeliveryCount != 1 || time.Since(start) != 90*time.Second {
			t.Fatalf("redelivered %q count %d at %v", body(a2), a2.Header.DeliveryCount, time.Since(start))
		}
		if _, err := l.renewLocks(ctx, []amqp.UUID{ta}); !errors.Is(err, servicebus.ErrLockLost) {
			t.Fatalf("renew a's first lock: %v", err)
		}
		// A release does not count; an abandon does, up to MaxDeliveryAttempts.
		if err := l.ReleaseMessage(ctx, a2); err != nil {
			t.Fatal(err)
		}
		if err := l.IssueCredit(1); err != nil {
			t.Fatal(err)
		}
		a3 := receive(t, l)
		if a3.Header.DeliveryCount != 1 {
			t.Fatalf("count after a release: %d", a3.Header.DeliveryCount)
		}
		if err := l.ModifyMessage(ctx, a3, nil); err != nil {
			t.Fatal(err)
		}
		want := `#0: 0 lock expired, 1 released, 1 modified → dead-lettered (MaxDeliveryCountExceeded)
#1: 0 lock expired (late accepted), 1 pending → in flight
`
		if got := history(q); got != want {
			t.Fatalf("history:\n%swant:\n%s", got, want)
		}
	})
}

// A link that ends leaves its locks, as Service Bus does for a queue
// without sessions: a lock of it can be renewed on another link, and its
// delivery settled by lock token (here through the ended link); one that
// is not goes back, counted, when its lock expires.
func TestServiceBusLostLinkKeepsItsLocks(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		q := NewQueue(WithProfile(amqpsub.AzureServiceBus), LockDuration(10*time.Second))
		q.Publish(Message("", "a"), Message("", "b"))
		l := open(t, q)
		if err := l.IssueCredit(2); err != nil {
			t.Fatal(err)
		}
		a, b := receive(t, l), receive(t, l)
		tok, _ := servicebus.LockToken(a.DeliveryTag)
		q.LoseLinks(nil)
		if _, err := open(t, q).renewLocks(t.Context(), []amqp.UUID{tok}); err != nil {
			t.Fatalf("renew on another link: %v", err)
		}
		if err := l.AcceptMessage(t.Context(), a); err != nil {
			t.Fatalf("accept after the link ended: %v", err)
		}
		time.Sleep(11 * time.Second) // b's lock expires
		if err := l.AcceptMessage(t.Context(), b); !isCondLockLost(err) {
			t.Fatalf("accept after the lock expired: %v", err)
		}
		want := "#0: 0 accepted → consumed\n#1: 0 lock expired (late accepted) → queued\n"
		if got := history(q); got != want {
			t.Fatalf("history:\n%swant:\n%s", got, want)
		}
	})
}

func isCondLockLost(err error) bool {
	var ae *amqp.Error
	return errors.As(err, &ae) && ae.Condition == servicebus.CondLockLost
}
