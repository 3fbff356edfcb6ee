package amqpsubtest_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/Azure/go-amqp"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/amqpsub/amqpsub/amqpsub"
	"github.com/amqpsub/amqpsub/amqpsubtest"
)

// RabbitMQ 4 through the whole pipeline: a subscriber with the RabbitMQ4
// profile learns the queue's type from the queue at each attach, as it
// reads it from the management node of a broker, and acts on it.

func rabbit4Queue(opts ...amqpsubtest.Option) *amqpsubtest.Queue {
	return amqpsubtest.NewQueue(append([]amqpsubtest.Option{amqpsubtest.WithProfile(amqpsub.RabbitMQ4)}, opts...)...)
}

func rabbit4Sub(t *testing.T, q *amqpsubtest.Queue, h func(context.Context, *amqpsub.Delivery) error, opts ...amqpsub.Option) *amqpsub.Subscriber {
	t.Helper()
	return newSub(t, q, h, append([]amqpsub.Option{amqpsub.WithProfile(amqpsub.RabbitMQ4)}, opts...)...)
}

// A handler that always fails, on a quorum queue: MaxDeliveryCount(5)
// reads the header's delivery-count, which each Retry (modified
// {delivery-failed}) raises, so the handler runs 6 times (counts 0 to 5)
// and amqpsub rejects the 7th delivery unhandled; the Reject reaches the
// queue as modified{delivery-failed, undeliverable-here}, which
// dead-letters it with amqpsub's reason in the annotations, long before
// the queue's own delivery limit (20).
func TestRabbitMQ4QuorumMaxDeliveryCount(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		q := rabbit4Queue()
		q.Publish(amqpsubtest.Message("", "poison"))
		var counts []string
		sub := rabbit4Sub(t, q, func(_ context.Context, d *amqpsub.Delivery) error {
			counts = append(counts, fmt.Sprint(d.DeliveryCount(), d.FirstAcquirer()))
			return amqpsub.Retry(errors.New("always"))
		}, amqpsub.MaxDeliveryCount(5))
		drain(t, q, sub)
		if got := fmt.Sprint(counts); got != "[0 true 1 false 2 false 3 false 4 false 5 false]" {
			t.Fatalf("handler saw count, first-acquirer %s", got)
		}
		const reason, description = "MaxDeliveryCountExceeded", "amqpsub: delivery 7 is past MaxDeliveryCount 5"
		want := "#0: 0 modified{delivery-failed}, 1 modified{delivery-failed}, 2 modified{delivery-failed}, " +
			"3 modified{delivery-failed}, 4 modified{delivery-failed}, 5 modified{delivery-failed}, " +
			`6 modified{delivery-failed, undeliverable-here} "` + reason + `" → dead-lettered`
		r := q.Records()[0]
		if r.String() != want {
			t.Fatalf("got  %s\nwant %s", r, want)
		}
		if r.Reason() != reason || r.Annotations[amqpsub.AnnotationDeadLetterReason] != reason ||
			r.Description() != description || r.Annotations[amqpsub.AnnotationDeadLetterDescription] != description {
			t.Fatalf("dead letter's reason %q, description %q, annotations %v", r.Reason(), r.Description(), r.Annotations)
		}
		if st := sub.Stats(); st.Results.Poisoned != 1 {
			t.Fatal(st)
		}
	})
}

// Without MaxDeliveryCount the queue's delivery limit ends it: every
// return counts, a Retry (which raises the header's delivery-count too) as
// much as a Release (which does not), and the return past the limit
// dead-letters the message, reason delivery_limit: the handler runs
// limit+1 times.
func TestRabbitMQ4QuorumDeliveryLimit(t *testing.T) {
	for _, tc := range []struct {
		name    string
		opts    []amqpsubtest.Option
		limit   int
		result  error
		outcome amqpsubtest.Outcome
	}{
		{"Retry, default limit", nil, 20, amqpsub.Retry(errors.New("always")), amqpsubtest.Failed},
		{"Release, default limit", nil, 20, amqpsub.Release(), amqpsubtest.Released},
		{"Retry, DeliveryLimit(3)", []amqpsubtest.Option{amqpsubtest.DeliveryLimit(3)}, 3, amqpsub.Retry(nil), amqpsubtest.Failed},
		{"Release, DeliveryLimit(0)", []amqpsubtest.Option{amqpsubtest.DeliveryLimit(0)}, 0, amqpsub.Release(), amqpsubtest.Released},
	} {
		t.Run(tc.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				q := rabbit4Queue(tc.opts...)
				q.Publish(amqpsubtest.Message("", "poison"))
				calls := 0
				sub := rabbit4Sub(t, q, func(context.Context, *amqpsub.Delivery) error {
					if calls++; calls > tc.limit+5 {
						return nil // not dead-lettered: give up
					}
					return tc.result
				})
				drain(t, q, sub)
				r := q.Records()[0]
				if calls != tc.limit+1 || len(r.Deliveries) != tc.limit+1 || r.State != amqpsubtest.DeadLettered ||
					r.Reason() != "delivery_limit" || !strings.HasSuffix(r.String(), "→ dead-lettered (delivery_limit)") {
					t.Fatalf("%d handler calls, %v, reason %q; want %d calls, dead-lettered for delivery_limit", calls, r, r.Reason(), tc.limit+1)
				}
				for i, d := range r.Deliveries {
					want := uint32(i) // modified{delivery-failed} raises the header's count
					if tc.outcome == amqpsubtest.Released {
						want = 0 // a release does not, though the queue counts it
					}
					if d.Count != want || d.Outcome != tc.outcome {
						t.Fatalf("delivery %d: %v, want count %d, %v", i, d, want, tc.outcome)
					}
				}
			})
		})
	}
}

// A Reject on a quorum queue: amqpsub sends it as modified{delivery-failed,
// undeliverable-here} with the reason, description and condition in
// message annotations whose keys start with x-, which RabbitMQ 4 keeps on
// the dead letter (a rejected outcome's error reaches nothing there).
func TestRabbitMQ4QuorumRejectKeepsTheReason(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		q := rabbit4Queue()
		q.Publish(amqpsubtest.Message("", "a"), amqpsubtest.Message("", "b"))
		sub := rabbit4Sub(t, q, func(_ context.Context, d *amqpsub.Delivery) error {
			if text(d) == "a" {
				return amqpsub.Reject("bad")
			}
			return amqpsub.RejectWith("bad total", "total is -3")
		})
		drain(t, q, sub)
		dl := q.DeadLetters()
		if len(dl) != 2 {
			t.Fatal(history(q.Records()))
		}
		if got := dl[0].Annotations[amqpsub.AnnotationDeadLetterReason]; got != "bad" || dl[0].Reason() != "bad" {
			t.Fatalf("Reject(bad): annotation %v, Reason %q; %v", got, dl[0].Reason(), dl[0].Annotations)
		}
		if got := dl[0].String(); got != `#0: 0 modified{delivery-failed, undeliverable-here} "bad" → dead-lettered` {
			t.Fatal(got)
		}
		a := dl[1].Annotations
		if a[amqpsub.AnnotationDeadLetterReason] != "bad total" || a[amqpsub.AnnotationDeadLetterDescription] != "total is -3" ||
			a[amqpsub.AnnotationDeadLetterCondition] != string(amqpsub.RejectCondition) ||
			dl[1].Reason() != "bad total" || dl[1].Description() != "total is -3" {
			t.Fatalf("RejectWith: annotations %v, Reason %q, Description %q", a, dl[1].Reason(), dl[1].Description())
		}
	})
}

// stopRound is one run of stopRounds: how long its stop took, what it
// released.
type stopRound struct {
	took     time.Duration
	released uint64
}

// stopRounds runs up to rounds subscribers of a slow handler (100 ms of the
// bubble's clock, one worker) one after the other on q, each stopped
// gracefully (Shutdown and ctx cancel in turn) once few more messages were
// handled, until nothing is queued. It returns what the handlers saw (calls
// by body) and each stop.
func stopRounds(t *testing.T, q *amqpsubtest.Queue, rounds, few int, opts ...amqpsub.Option) (seen map[string]int, rs []stopRound) {
	t.Helper()
	var mu sync.Mutex
	seen = map[string]int{}
	handled := 0
	for i := 0; i < rounds && len(q.Queued()) > 0; i++ {
		target := handled + few
		reached := make(chan struct{})
		sub := rabbit4Sub(t, q, func(_ context.Context, d *amqpsub.Delivery) error {
			time.Sleep(100 * time.Millisecond)
			mu.Lock()
			defer mu.Unlock()
			seen[text(d)]++
			if handled++; handled == target {
				close(reached)
			}
			return nil
		}, append([]amqpsub.Option{amqpsub.Workers(1)}, opts...)...)
		ctx, cancel := context.WithCancel(t.Context())
		ran := make(chan error, 1)
		go func() { ran <- sub.Run(ctx) }()
		select {
		case <-reached:
		case err := <-ran:
			t.Fatalf("round %d: Run returned %v", i, err)
		}
		// Off the handler's 100 ms steps: no handler ends at the very
		// instant half the grace period does.
		time.Sleep(50 * time.Millisecond)
		began := time.Now()
		if i%2 == 0 {
			if err := sub.Shutdown(t.Context()); err != nil {
				t.Fatal(err)
			}
		} else {
			cancel()
		}
		if err := <-ran; err != nil {
			t.Fatalf("round %d: Run = %v", i, err)
		}
		cancel()
		rs = append(rs, stopRound{took: time.Since(began), released: sub.Stats().Settled.Released})
	}
	return seen, rs
}

// unseenDeadLetters returns the dead letters no handler saw.
func unseenDeadLetters(q *amqpsubtest.Queue, seen map[string]int) (n int) {
	for _, r := range q.DeadLetters() {
		if seen[string(r.Message.GetData())] == 0 {
			n++
		}
	}
	return n
}

// 20 graceful stops of a slow consumer on a quorum queue, which counts
// every release toward its delivery limit. On RabbitMQ 4.0.5, 22 such
// stops at a credit of 256 released 5,544 deliveries and dead-lettered
// 172 messages that no handler had seen. amqpsub's stop finishes what is
// buffered instead, for up to half the grace period:
//
//   - with the adaptive credit (the default) little is buffered: each stop
//     finishes it within a handler or two, and releases nothing;
//   - with FixedCredit the whole queue is buffered: the first stop takes
//     half the grace period (15 s) handling 150 more, plus the one in its
//     handler when the rest (44) is released; the second stop finishes
//     everything left;
//   - without the finishing (GracePeriod(0) skips it) every stop releases
//     everything buffered, and the 21st return of a message dead-letters
//     it, as on the broker: 21 stops dead-letter 74 messages no handler saw.
func TestRabbitMQ4QuorumStops(t *testing.T) {
	const messages, few = 200, 5
	publish := func(q *amqpsubtest.Queue) {
		for i := range messages {
			q.Publish(amqpsubtest.Message("", fmt.Sprint(i)))
		}
	}
	t.Run("adaptive credit", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			q := rabbit4Queue()
			publish(q)
			seen, rs := stopRounds(t, q, 20, few)
			if len(rs) != 20 {
				t.Fatalf("%d stops before the queue drained; want 20", len(rs))
			}
			for i, r := range rs {
				if r.released != 0 || r.took > 200*time.Millisecond {
					t.Errorf("stop %d released %d, took %v; want 0 released, within two handlers", i, r.released, r.took)
				}
			}
			handled := 0
			for _, r := range q.Records() {
				if len(r.Deliveries) > 1 || r.State == amqpsubtest.DeadLettered {
					t.Fatalf("returned: %v", r)
				}
				if r.State == amqpsubtest.Consumed {
					handled++
				}
			}
			if n := unseenDeadLetters(q, seen); n != 0 || handled != len(seen) || handled < 20*few {
				t.Fatalf("%d dead letters no handler saw, %d handled, %d seen", n, handled, len(seen))
			}
			t.Logf("%d handled in 20 rounds, none released; %d never delivered", handled, len(q.Queued()))
		})
	})
	t.Run("FixedCredit", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			q := rabbit4Queue()
			publish(q)
			seen, rs := stopRounds(t, q, 20, few, amqpsub.FixedCredit())
			// The first stop, 50 ms into a handler: handlers end every
			// 100 ms until half the grace period (15 s), 150 of them;
			// the one running then finishes, and 200-5-151 are
			// released. The second handles those 44 (5 before its stop).
			want := []stopRound{{took: 15*time.Second + 50*time.Millisecond, released: 44},
				{took: 39*100*time.Millisecond - 50*time.Millisecond, released: 0}}
			if fmt.Sprint(rs) != fmt.Sprint(want) {
				t.Fatalf("stops %v, want %v", rs, want)
			}
			twice := 0
			for _, r := range q.Records() {
				switch {
				case r.State != amqpsubtest.Consumed:
					t.Fatal(r)
				case len(r.Deliveries) == 2 && r.Deliveries[0].Outcome == amqpsubtest.Released:
					twice++
				case len(r.Deliveries) != 1:
					t.Fatal(r)
				}
			}
			if twice != 44 || len(seen) != messages || unseenDeadLetters(q, seen) != 0 {
				t.Fatalf("%d released once, %d seen", twice, len(seen))
			}
		})
	})
	t.Run("FixedCredit without the finishing", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			q := rabbit4Queue()
			publish(q)
			seen, rs := stopRounds(t, q, 21, few, amqpsub.FixedCredit(), amqpsub.GracePeriod(0))
			released := 0
			for _, r := range rs {
				released += int(r.released)
			}
			// Each stop handled 5, cut the 6th short (its result is
			// ignored; the link's end returns it) and released the rest,
			// 194 - 5(k-1) at the k-th: 3,024 in all. Returns go first,
			// so each stop cut another one short; the 21st stop returned
			// all 200 - 21×5 = 95 not handled for the 21st time, one past
			// the limit: dead-lettered, 200 - 21×6 = 74 of them never
			// seen by a handler.
			dead := q.DeadLetters()
			for _, r := range dead {
				if r.Reason() != "delivery_limit" || len(r.Deliveries) != 21 {
					t.Fatal(r)
				}
			}
			unseen := unseenDeadLetters(q, seen)
			if len(rs) != 21 || released != 3024 || len(dead) != messages-21*few || unseen != messages-21*(few+1) || len(q.Queued()) != 0 {
				t.Fatalf("%d stops, %d releases, %d dead letters, %d of them no handler saw, %d queued", len(rs), released, len(dead), unseen, len(q.Queued()))
			}
		})
	})
}

// A classic queue counts no attempt, so MaxDeliveryCount would never act:
// Run fails at the attach, as it does on a broker.
func TestRabbitMQ4ClassicRefusesMaxDeliveryCount(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		q := rabbit4Queue(amqpsubtest.WithQueueType(amqpsubtest.Classic))
		q.Publish(amqpsubtest.Message("", "x"))
		calls := 0
		sub := rabbit4Sub(t, q, func(context.Context, *amqpsub.Delivery) error { calls++; return nil }, amqpsub.MaxDeliveryCount(5))
		ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
		defer cancel()
		err := sub.Run(ctx)
		if !errors.Is(err, amqpsub.ErrInvalidOption) || !strings.Contains(err.Error(), `MaxDeliveryCount(5) on classic queue "orders"`) {
			t.Fatalf("Run = %v", err)
		}
		if calls != 0 || q.Records()[0].State != amqpsubtest.Queued || len(q.Records()[0].Deliveries) != 0 {
			t.Fatalf("%d handler calls, %v", calls, q.Records()[0])
		}
	})
}

// On a classic queue a Retry comes back for ever with delivery-count 0:
// the handler bounds it itself (here: the 50th attempt rejects), and the
// dead letter keeps no reason.
func TestRabbitMQ4ClassicRetryLoops(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		q := rabbit4Queue(amqpsubtest.WithQueueType(amqpsubtest.Classic))
		q.Publish(amqpsubtest.Message("", "poison"))
		calls := 0
		sub := rabbit4Sub(t, q, func(_ context.Context, d *amqpsub.Delivery) error {
			if calls++; d.DeliveryCount() != 0 || d.FirstAcquirer() != (calls == 1) {
				t.Errorf("call %d: count %d, first-acquirer %v", calls, d.DeliveryCount(), d.FirstAcquirer())
			}
			if calls == 50 {
				return amqpsub.Reject("gave up")
			}
			return amqpsub.Retry(errors.New("always"))
		})
		drain(t, q, sub)
		r := q.Records()[0]
		if calls != 50 || len(r.Deliveries) != 50 || r.State != amqpsubtest.DeadLettered || r.Reason() != "" || r.Annotations != nil {
			t.Fatalf("%d calls: %v, reason %q", calls, r, r.Reason())
		}
		for _, d := range r.Deliveries[:49] {
			if d.Count != 0 || d.Outcome != amqpsubtest.Failed {
				t.Fatal(r)
			}
		}
		if d := r.Deliveries[49]; d.Outcome != amqpsubtest.Rejected || d.Error.Description != "gave up" {
			t.Fatalf("last: %v (the rejected outcome as sent)", d)
		}
	})
}

// A classic queue does not count a release: a graceful stop releases what
// is buffered at once, as on Artemis, rather than finish it.
func TestRabbitMQ4ClassicStopReleasesTheBuffered(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		q := rabbit4Queue(amqpsubtest.WithQueueType(amqpsubtest.Classic))
		for i := range 10 {
			q.Publish(amqpsubtest.Message("", fmt.Sprint(i)))
		}
		sub := rabbit4Sub(t, q, func(context.Context, *amqpsub.Delivery) error {
			time.Sleep(100 * time.Millisecond)
			return nil
		}, amqpsub.Workers(1), amqpsub.FixedCredit())
		stop := start(sub)
		time.Sleep(250 * time.Millisecond) // 2 handled, the 3rd in its handler
		began := time.Now()
		if err := stop(); err != nil {
			t.Fatal(err)
		}
		if took, st := time.Since(began), sub.Stats(); st.Settled.Released != 7 || st.Settled.Accepted != 3 || took != 50*time.Millisecond {
			t.Fatalf("stop took %v: %v; want 7 released, 3 accepted, in 50 ms", took, st)
		}
		for _, r := range q.Records()[3:] {
			if r.State != amqpsubtest.Queued || r.String() != fmt.Sprintf("#%d: 0 released → queued", r.Index) {
				t.Fatal(r)
			}
		}
	})
}

// A graceful stop while the link is down (the broker went away and every
// reconnect is refused) returns at once on either queue type: there is
// nothing buffered to finish, and no link to finish it on.
func TestRabbitMQ4ShutdownDuringOutageIsQuick(t *testing.T) {
	for _, typ := range []amqpsubtest.QueueType{amqpsubtest.Classic, amqpsubtest.Quorum} {
		t.Run(typ.String(), func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				q := rabbit4Queue(amqpsubtest.WithQueueType(typ))
				q.Publish(amqpsubtest.Message("", "a"))
				sub := rabbit4Sub(t, q, func(context.Context, *amqpsub.Delivery) error { return nil })
				ran := make(chan error, 1)
				go func() { ran <- sub.Run(context.Background()) }()
				if err := q.Wait(t.Context()); err != nil {
					t.Fatal(err)
				}
				q.RefuseAttach(&amqp.ConnError{}) // not fatal: retried with backoff
				q.LoseLinks(nil)
				time.Sleep(time.Second)
				began := time.Now()
				if err := sub.Shutdown(t.Context()); err != nil {
					t.Fatal(err)
				}
				err := <-ran
				if took := time.Since(began); took > time.Second {
					t.Errorf("%s queue: Shutdown with no link took %v (Run = %v); want it at once", typ, took, err)
				}
			})
		})
	}
}

// A batch consumer whose BatchWait is longer than half the grace period: at
// a graceful stop on a quorum queue nothing more comes (Hold), so the open
// batch is handed over at once rather than wait for its BatchWait and be
// released, every one of its deliveries a counted return.
func TestRabbitMQ4StopHandsOverTheOpenBatch(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		q := rabbit4Queue()
		for i := range 5 {
			q.Publish(amqpsubtest.Message("", fmt.Sprint(i)))
		}
		handled := 0
		sub, err := amqpsub.NewBatch(q.Connector(), "orders", amqpsub.BatchHandlerFunc(func(_ context.Context, b []*amqpsub.Delivery) []error {
			handled += len(b)
			return make([]error, len(b))
		}), amqpsub.WithProfile(amqpsub.RabbitMQ4), amqpsub.Batch(100, 20*time.Second), amqpsub.GracePeriod(30*time.Second))
		if err != nil {
			t.Fatal(err)
		}
		stop := start(sub)
		time.Sleep(time.Second) // 5 wait in the open batch
		if err := stop(); err != nil {
			t.Fatal(err)
		}
		st := sub.Stats()
		if handled != 5 || st.Settled.Released != 0 {
			t.Errorf("%d handled, %d released (%s); want the open batch handled at the stop rather than released", handled, st.Settled.Released, history(q.Records()))
		}
	})
}

// MaxMessageSize under RabbitMQ4 rejects with the reason code
// MaxMessageSizeExceeded and keeps its condition,
// amqp:link:message-size-exceeded, as elsewhere but on Service Bus.
func TestRabbitMQ4OversizeKeepsItsCondition(t *testing.T) {
	for _, typ := range []amqpsubtest.QueueType{amqpsubtest.Quorum, amqpsubtest.Classic} {
		t.Run(typ.String(), func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				q := rabbit4Queue(amqpsubtest.WithQueueType(typ))
				q.Publish(amqpsubtest.Message("", "a body much longer than ten bytes"))
				sub := rabbit4Sub(t, q, func(context.Context, *amqpsub.Delivery) error { return nil }, amqpsub.MaxMessageSize(10))
				drain(t, q, sub)
				r := q.Records()[0]
				cond := fmt.Sprint(r.Annotations[amqpsub.AnnotationDeadLetterCondition])
				if e := r.Deliveries[len(r.Deliveries)-1].Error; e != nil {
					cond = string(e.Condition)
				}
				t.Logf("%s: %s; condition %q reason %q", typ, r, cond, r.Reason())
				if cond != "amqp:link:message-size-exceeded" {
					t.Errorf("%s queue: oversize dead letter's condition %q, want amqp:link:message-size-exceeded as documented", typ, cond)
				}
			})
		})
	}
}

// "an option does not fit the queue" is logged for a queue found at odds
// with an option at the first attach only, not for every ErrInvalidOption
// (a Service Bus TokenProvider's token without Expiry wraps it too).
func TestOnlyAQueueMismatchIsLoggedAsOne(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		q := amqpsubtest.NewQueue()
		q.RefuseAttach(fmt.Errorf("the TokenProvider gave a \"jwt\" token with no Expiry: %w", amqpsub.ErrInvalidOption))
		core, logs := observer.New(zap.InfoLevel)
		sub := newSub(t, q, func(context.Context, *amqpsub.Delivery) error { return nil }, amqpsub.Logger(zap.New(core)))
		err := sub.Run(t.Context())
		if !errors.Is(err, amqpsub.ErrInvalidOption) {
			t.Fatalf("Run = %v", err)
		}
		for _, e := range logs.All() {
			t.Logf("%s %q %v", e.Level, e.Message, e.ContextMap())
			if e.Message == "an option does not fit the queue; stopping" {
				t.Errorf("a token without Expiry logged as %q", e.Message)
			}
		}
	})
}
