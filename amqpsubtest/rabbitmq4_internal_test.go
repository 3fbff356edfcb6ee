package amqpsubtest

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"testing/synctest"
	"time"

	"github.com/Azure/go-amqp"

	"github.com/amqpsub/amqpsub/amqpsub"
)

// The RabbitMQ 4 rules, driven as the pump drives a link, for what amqpsub
// itself never sends (modified without delivery-failed, annotation keys
// that are not x-) and for the link's end.

func rabbit4(opts ...Option) *Queue {
	return NewQueue(append([]Option{WithProfile(amqpsub.RabbitMQ4)}, opts...)...)
}

// settleAll receives one delivery after another on l and settles each with
// the next of fs, which returns nil or the error the settlement is to get.
func settleAll(t *testing.T, l *link, fs ...func(m *amqp.Message) error) {
	t.Helper()
	for i, f := range fs {
		m := receive(t, l)
		if err := f(m); err != nil {
			t.Fatalf("settlement %d: %v", i, err)
		}
	}
}

func TestRabbitMQ4QueueSaysItsType(t *testing.T) {
	for _, tc := range []struct {
		opts  []Option
		typ   string
		limit int64
	}{
		{nil, "quorum", 0},
		{[]Option{WithQueueType(Quorum), DeliveryLimit(7)}, "quorum", 7},
		{[]Option{DeliveryLimit(-1)}, "quorum", -1},
		{[]Option{WithQueueType(Classic)}, "classic", 0},
	} {
		src, err := rabbit4(tc.opts...).attach(t.Context())
		if err != nil {
			t.Fatal(err)
		}
		rs, ok := src.(interface{ RabbitMQQueue() (string, int64) })
		if !ok {
			t.Fatalf("%T says no queue type", src)
		}
		if typ, limit := rs.RabbitMQQueue(); typ != tc.typ || limit != tc.limit {
			t.Errorf("RabbitMQQueue() = %q, %d; want %q, %d", typ, limit, tc.typ, tc.limit)
		}
	}
	// Other brokers have no queue types: their links say none.
	src, _ := NewQueue().attach(t.Context())
	if _, ok := src.(interface{ RabbitMQQueue() (string, int64) }); ok {
		t.Error("an Artemis queue's link says a RabbitMQ queue type")
	}
}

func TestRabbitMQ4OptionsThatDoNotFitPanic(t *testing.T) {
	for name, opts := range map[string][]Option{
		"WithQueueType without RabbitMQ4":       {WithQueueType(Classic)},
		"DeliveryLimit without RabbitMQ4":       {WithProfile(amqpsub.RabbitMQ3), DeliveryLimit(3)},
		"DeliveryLimit on a classic queue":      {WithProfile(amqpsub.RabbitMQ4), DeliveryLimit(3), WithQueueType(Classic)},
		"MaxDeliveryAttempts under RabbitMQ4":   {MaxDeliveryAttempts(5), WithProfile(amqpsub.RabbitMQ4)},
		"a queue type that is neither":          {WithProfile(amqpsub.RabbitMQ4), WithQueueType(QueueType(7))},
		"MaxDeliveryAttempts on classic queues": {WithProfile(amqpsub.RabbitMQ4), WithQueueType(Classic), MaxDeliveryAttempts(1)},
	} {
		func() {
			defer func() {
				if recover() == nil {
					t.Errorf("%s: NewQueue did not panic", name)
				}
			}()
			NewQueue(opts...)
		}()
	}
	// In any order.
	if q := NewQueue(WithQueueType(Classic), WithProfile(amqpsub.RabbitMQ4)); q.rules != classicRules {
		t.Error("WithQueueType before WithProfile is lost")
	}
}

// A quorum queue counts every return: modified without delivery-failed
// too, which leaves the header's count alone, as a release does. Returns
// go ahead of the messages never delivered, in the order they came back.
func TestRabbitMQ4QuorumCountsEveryReturn(t *testing.T) {
	q := rabbit4(DeliveryLimit(2))
	q.Publish(Message("", "0"), Message("", "1"), Message("", "2"))
	l := open(t, q)
	_ = l.IssueCredit(100)
	ctx := t.Context()
	release := func(m *amqp.Message) error { return l.ReleaseMessage(ctx, m) }
	modify := func(m *amqp.Message) error { return l.ModifyMessage(ctx, m, &amqp.ModifyMessageOptions{}) }
	fail := func(m *amqp.Message) error {
		return l.ModifyMessage(ctx, m, &amqp.ModifyMessageOptions{DeliveryFailed: true})
	}
	accept := func(m *amqp.Message) error { return l.AcceptMessage(ctx, m) }
	m0, m1 := receive(t, l), receive(t, l)
	if err := errors.Join(release(m1), modify(m0)); err != nil {
		t.Fatal(err)
	}
	// 1 came back first, then 0: both ahead of 2.
	var got []*amqp.Message
	var order []string
	for range 3 {
		m := receive(t, l)
		got = append(got, m)
		order = append(order, fmt.Sprint(body(m), ":", m.Header.DeliveryCount))
	}
	if fmt.Sprint(order) != "[1:0 0:0 2:0]" {
		t.Fatalf("redelivered %v; want the returns first, in order, counts unchanged", order)
	}
	// The 2nd return of each; the 3rd is past DeliveryLimit(2).
	if err := errors.Join(accept(got[2]), release(got[0]), fail(got[1])); err != nil {
		t.Fatal(err)
	}
	m1, m0 = receive(t, l), receive(t, l)
	if body(m1) != "1" || body(m0) != "0" || m0.Header.DeliveryCount != 1 {
		t.Fatalf("got %s, %s (count %d)", body(m1), body(m0), m0.Header.DeliveryCount)
	}
	if err := errors.Join(release(m1), fail(m0)); err != nil {
		t.Fatal(err)
	}
	want := `#0: 0 modified, 0 modified{delivery-failed}, 1 modified{delivery-failed} → dead-lettered (delivery_limit)
#1: 0 released, 0 released, 0 released → dead-lettered (delivery_limit)
#2: 0 accepted → consumed
`
	if got := history(q); got != want {
		t.Fatalf("history:\n%swant:\n%s", got, want)
	}
}

// What a link that ends leaves unsettled goes back counted: a detach (the
// subscriber's stop) leaves the header's count alone; a session or
// connection that goes (LoseLinks) raises it too, as RabbitMQ returns a
// consumer's messages when its process goes down.
func TestRabbitMQ4QuorumCountsWhatAnEndedLinkHeld(t *testing.T) {
	q := rabbit4(DeliveryLimit(1))
	q.Publish(Message("", "0"))
	detached := func() {
		l := open(t, q)
		_ = l.IssueCredit(1)
		receive(t, l)
		if err := l.Close(t.Context()); err != nil {
			t.Fatal(err)
		}
	}
	detached()
	if r := q.Records()[0]; r.String() != "#0: 0 unsettled → queued" {
		t.Fatal(r)
	}
	l := open(t, q)
	_ = l.IssueCredit(1)
	receive(t, l)
	q.LoseLinks(nil)
	if r := q.Records()[0]; r.String() != "#0: 0 unsettled, 0 unsettled → dead-lettered (delivery_limit)" || r.Reason() != "delivery_limit" {
		t.Fatal(r)
	}

	q = rabbit4()
	q.Publish(Message("", "0"))
	l = open(t, q)
	_ = l.IssueCredit(2)
	receive(t, l)
	q.LoseLinks(nil)
	l = open(t, q)
	_ = l.IssueCredit(1)
	if m := receive(t, l); m.Header.DeliveryCount != 1 || m.Header.FirstAcquirer {
		t.Fatalf("after a lost link: %+v; want delivery-count 1, not first-acquirer", m.Header)
	}
}

// A quorum queue keeps a modified outcome's annotations on the message,
// for its later deliveries and its dead letter; modified{undeliverable-
// here} dead-letters at once. A classic queue dead-letters on
// undeliverable-here too, and drops the annotations.
func TestRabbitMQ4ModifiedAnnotations(t *testing.T) {
	for _, typ := range []QueueType{Quorum, Classic} {
		t.Run(typ.String(), func(t *testing.T) {
			q := rabbit4(WithQueueType(typ))
			m := Message("", "0")
			m.Annotations = amqp.Annotations{"x-opt-published": "yes"}
			q.Publish(m)
			l := open(t, q)
			_ = l.IssueCredit(100)
			ctx := t.Context()
			settleAll(t, l, func(m *amqp.Message) error {
				return l.ModifyMessage(ctx, m, &amqp.ModifyMessageOptions{DeliveryFailed: true,
					Annotations: amqp.Annotations{"x-attempt": "first"}})
			})
			m2 := receive(t, l)
			err := l.ModifyMessage(ctx, m2, &amqp.ModifyMessageOptions{UndeliverableHere: true,
				Annotations: amqp.Annotations{amqp.Symbol("x-opt-dead-letter-reason"): "bad"}})
			if err != nil {
				t.Fatal(err)
			}
			r := q.Records()[0]
			if typ == Classic {
				if len(m2.Annotations) != 1 || r.Annotations != nil || r.Reason() != "" ||
					r.String() != `#0: 0 modified{delivery-failed}, 0 modified{undeliverable-here} "bad" → dead-lettered` {
					t.Fatalf("redelivered with %v; %v, annotations %v", m2.Annotations, r, r.Annotations)
				}
				return
			}
			if m2.Annotations["x-attempt"] != "first" || m2.Annotations["x-opt-published"] != "yes" {
				t.Fatalf("redelivered with %v; want the modified outcome's and the published annotations", m2.Annotations)
			}
			if r.Annotations["x-attempt"] != "first" || r.Annotations[amqp.Symbol("x-opt-dead-letter-reason")] != "bad" ||
				r.Reason() != "bad" || r.String() != `#0: 0 modified{delivery-failed}, 1 modified{undeliverable-here} "bad" → dead-lettered` {
				t.Fatalf("%v, annotations %v", r, r.Annotations)
			}
		})
	}
}

// RabbitMQ 4 ends the session on a modified outcome with an annotation key
// that does not start with x- (whatever the queue type): the outcome is not
// applied, and the link's deliveries go back as when a session ends.
func TestRabbitMQ4EndsTheSessionOnAnAnnotationKeyNotX(t *testing.T) {
	for _, typ := range []QueueType{Quorum, Classic} {
		for _, key := range []any{"reason", amqp.Symbol("opt-x"), int64(7)} {
			t.Run(fmt.Sprint(typ, " ", key), func(t *testing.T) {
				q := rabbit4(WithQueueType(typ))
				q.Publish(Message("", "0"), Message("", "1"))
				l := open(t, q)
				_ = l.IssueCredit(100)
				m0 := receive(t, l)
				receive(t, l)
				err := l.ModifyMessage(t.Context(), m0, &amqp.ModifyMessageOptions{DeliveryFailed: true, UndeliverableHere: true,
					Annotations: amqp.Annotations{"x-fine": "yes", key: "no"}})
				var se *amqp.SessionError
				if !errors.As(err, &se) || se.RemoteErr == nil || se.RemoteErr.Condition != amqp.ErrCondInternalError ||
					!strings.Contains(se.RemoteErr.Description, "function_clause") {
					t.Fatalf("ModifyMessage = %v; want the session ended with amqp:internal-error", err)
				}
				if _, err := l.Receive(t.Context(), nil); !errors.Is(err, se) && err != error(se) {
					t.Fatalf("Receive after = %v", err)
				}
				want := "#0: 0 unsettled → queued\n#1: 0 unsettled → queued\n"
				if typ == Quorum {
					// Returned counted, and, as the session went, failed.
					for _, r := range q.Records() {
						if r.String() != fmt.Sprintf("#%d: 0 unsettled → queued", r.Index) {
							t.Fatal(history(q))
						}
					}
					l = open(t, q)
					_ = l.IssueCredit(1)
					if m := receive(t, l); m.Header.DeliveryCount != 1 {
						t.Fatalf("redelivered with count %d, want 1", m.Header.DeliveryCount)
					}
					return
				}
				if got := history(q); got != want {
					t.Fatalf("history:\n%swant:\n%s", got, want)
				}
			})
		}
	}
}

// No message groups on RabbitMQ: a group-id is a plain property, and the
// messages of a group go to whichever link has credit, never past it.
// Drains are answered at once.
func TestRabbitMQ4HasNoGroupsKeepsWithinCreditAndAnswersDrains(t *testing.T) {
	for _, typ := range []QueueType{Quorum, Classic} {
		t.Run(typ.String(), func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				q := rabbit4(WithQueueType(typ))
				q.Publish(Message("g", "0"), Message("g", "1"), Message("g", "2"))
				a, b := open(t, q), open(t, q)
				_ = a.IssueCredit(1)
				if body(receive(t, a)) != "0" {
					t.Fatal("a did not get the first")
				}
				got := make(chan *amqp.Message, 1)
				go func() {
					m, _ := a.Receive(t.Context(), nil)
					got <- m
				}()
				synctest.Wait()
				if len(got) != 0 {
					t.Fatal("a received past its credit")
				}
				_ = b.IssueCredit(5)
				if body(receive(t, b)) != "1" {
					t.Fatal("the group's next message did not go to the other link")
				}
				if err := b.DrainCredit(context.Background(), nil); err != nil || b.credit != 0 {
					t.Fatalf("drain: %v, credit %d left", err, b.credit)
				}
				_ = a.IssueCredit(1)
				if m := <-got; body(m) != "2" {
					t.Fatalf("a got %q", body(m))
				}
			})
		})
	}
}

// A subscriber refuses a classic queue with MaxDeliveryCount at the
// attach: the link it refused is closed, as a refused broker link is.
func TestRabbitMQ4RefusedLinkIsClosed(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		q := rabbit4(WithQueueType(Classic))
		sub, err := amqpsub.New(q.Connector(), "orders", amqpsub.HandlerFunc(func(context.Context, *amqpsub.Delivery) error { return nil }),
			amqpsub.WithProfile(amqpsub.RabbitMQ4), amqpsub.MaxDeliveryCount(3))
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
		defer cancel()
		if err := sub.Run(ctx); !errors.Is(err, amqpsub.ErrInvalidOption) {
			t.Fatalf("Run = %v", err)
		}
		q.mu.Lock()
		defer q.mu.Unlock()
		if q.lastLink != 1 || len(q.links) != 0 {
			t.Fatalf("%d attached, %d still open", q.lastLink, len(q.links))
		}
	})
}
