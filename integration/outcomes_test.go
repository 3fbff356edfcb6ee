package integration

import (
	"context"
	"errors"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/Azure/go-amqp"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/amqpsub/amqpsub/amqpsub"
)

// outcomeRow is one outcome on one target: the handler's answer to each
// call over a single message, how many calls make the run, and what that
// broker does with it (docs/brokers.md). The rows run by outcome; where
// brokers differ, each row holds its broker's assertions.
type outcomeRow struct {
	name   string // the subtest's
	target string
	handle func(call int, d *amqpsub.Delivery) error
	calls  int // the run is complete at this many handler calls
	opts   []amqpsub.Option
	check  func(t *testing.T, o outcomeRun)
}

// outcomeRun is what one row's run saw.
type outcomeRun struct {
	tg    target
	conn  *amqp.Conn
	q     string
	calls []handled
	st    amqpsub.Stats
}

// deadLetter returns the one message q dead-lettered, failing the test
// when there is none.
func (o outcomeRun) deadLetter(t *testing.T) *amqp.Message {
	t.Helper()
	dead := o.tg.deadLetters(t, o.conn, o.q, 1, 10*time.Second)
	if len(dead) != 1 {
		t.Fatalf("%d dead letters, want 1", len(dead))
	}
	if dead[0].ApplicationProperties["seq"] != int64(7) {
		t.Fatalf("dead letter %v, want the message handled", dead[0].ApplicationProperties)
	}
	return dead[0]
}

func failing(int, *amqpsub.Delivery) error { return errors.New("not today") }

// firstThen answers the first call with first and the others with nil.
func firstThen(first func() error) func(int, *amqpsub.Delivery) error {
	return func(call int, _ *amqpsub.Delivery) error {
		if call == 1 {
			return first()
		}
		return nil
	}
}

var outcomeRows = []outcomeRow{
	// Release.
	{name: "release redelivers without counting", target: onArtemis, calls: 2,
		handle: firstThen(func() error { return amqpsub.Release() }),
		check: func(t *testing.T, o outcomeRun) {
			if len(o.calls) != 2 || o.calls[0].count != 0 || o.calls[1].count != 0 {
				t.Fatalf("delivery counts %+v, want [0 0]", o.calls)
			}
			if o.st.Settled.Released != 1 || o.st.Settled.Accepted != 2 {
				t.Fatalf("stats %+v", o.st)
			}
		}},
	{name: "quorum release counts toward the delivery-limit", target: onRabbitMQ4Quorum, calls: 21,
		handle: func(int, *amqpsub.Delivery) error { return amqpsub.Release() },
		check: func(t *testing.T, o outcomeRun) {
			// The delivery-limit (20 by default) is how many returns the
			// queue takes: the 21st dead-letters.
			if len(o.calls) != 21 || o.st.Settled.Released != 21 {
				t.Fatalf("%d calls, stats %+v: want 21 (the default delivery-limit, 20, and one)", len(o.calls), o.st)
			}
			for i, c := range o.calls {
				if c.count != 0 {
					t.Fatalf("call %d: delivery-count %d; a release does not raise the header's count", i, c.count)
				}
			}
			o.deadLetter(t)
		}},

	// Retry.
	{name: "retry counts and dead-letters at max attempts", target: onArtemis, calls: 5, handle: failing,
		check: func(t *testing.T, o outcomeRun) {
			if len(o.calls) != 5 {
				t.Fatalf("%d attempts, want max-delivery-attempts = 5", len(o.calls))
			}
			for i, c := range o.calls {
				if c.count != uint32(i) {
					t.Fatalf("attempt %d had delivery count %d: %+v", i, c.count, o.calls)
				}
			}
			if o.st.Settled.Modified != 5 || o.st.Results.Retry != 5 {
				t.Fatalf("stats %+v", o.st)
			}
			o.deadLetter(t)
		}},
	{name: "quorum retry counts; MaxDeliveryCount dead-letters with the reason", target: onRabbitMQ4Quorum, calls: 4,
		handle: failing, opts: []amqpsub.Option{amqpsub.MaxDeliveryCount(3)},
		check: func(t *testing.T, o outcomeRun) {
			if len(o.calls) != 4 {
				t.Fatalf("%d handler calls, want 4 (counts 0..3)", len(o.calls))
			}
			for i, c := range o.calls {
				if c.count != uint32(i) || c.firstAcquirer != (i == 0) {
					t.Fatalf("call %d saw %+v: %+v", i, c, o.calls)
				}
			}
			if o.st.Results.Retry != 4 || o.st.Settled.Modified != 5 {
				t.Fatalf("stats %+v: want 4 retries, and the poison reject sent as the 5th modified", o.st)
			}
			a := o.deadLetter(t).Annotations
			if a[amqpsub.AnnotationDeadLetterReason] != "MaxDeliveryCountExceeded" || a[amqpsub.AnnotationDeadLetterDescription] != "amqpsub: delivery 5 is past MaxDeliveryCount 3" {
				t.Fatalf("dead letter annotations %v: want reason MaxDeliveryCountExceeded and the delivery's number", a)
			}
		}},
	{name: "classic counts nothing", target: onRabbitMQ4Classic, calls: 30,
		handle: func(call int, _ *amqpsub.Delivery) error {
			if call < 30 {
				return errors.New("not today")
			}
			return nil
		},
		check: func(t *testing.T, o outcomeRun) {
			for i, c := range o.calls {
				if c.count != 0 {
					t.Fatalf("call %d: delivery-count %d on a classic queue", i, c.count)
				}
			}
			if len(o.calls) != 30 || o.st.Settled.Modified != 29 || o.st.Settled.Accepted != 2 {
				t.Fatalf("%d calls, stats %+v", len(o.calls), o.st)
			}
		}},

	// Reject.
	{name: "reject dead-letters at once", target: onArtemis, calls: 1,
		handle: func(int, *amqpsub.Delivery) error { return amqpsub.Reject("malformed order") },
		check: func(t *testing.T, o outcomeRun) {
			if len(o.calls) != 1 || o.st.Settled.Rejected != 1 {
				t.Fatalf("calls %+v stats %+v", o.calls, o.st)
			}
			a := o.deadLetter(t).Annotations
			if a["x-opt-ORIG-QUEUE"] != o.q || a["x-opt-ORIG-ADDRESS"] != o.q {
				t.Fatalf("dead letter annotations: %v, want x-opt-ORIG-QUEUE and -ADDRESS %s", a, o.q)
			}
		}},
	{name: "quorum reject keeps the reason", target: onRabbitMQ4Quorum, calls: 1,
		handle: func(int, *amqpsub.Delivery) error { return amqpsub.RejectWith("malformed order", "no total on line 3") },
		check: func(t *testing.T, o outcomeRun) {
			if len(o.calls) != 1 || o.st.Results.Reject != 1 || o.st.Settled.Modified != 1 || o.st.Settled.Rejected != 0 {
				t.Fatalf("calls %+v stats %+v", o.calls, o.st)
			}
			a := o.deadLetter(t).Annotations
			if a[amqpsub.AnnotationDeadLetterReason] != "malformed order" || a[amqpsub.AnnotationDeadLetterDescription] != "no total on line 3" ||
				a[amqpsub.AnnotationDeadLetterCondition] != string(amqpsub.RejectCondition) {
				t.Fatalf("dead letter annotations %v: the reason is not kept", a)
			}
		}},
	{name: "classic reject dead-letters without the reason", target: onRabbitMQ4Classic, calls: 1,
		handle: func(int, *amqpsub.Delivery) error { return amqpsub.Reject("malformed order") },
		check: func(t *testing.T, o outcomeRun) {
			if o.st.Settled.Rejected != 1 {
				t.Fatalf("stats %+v: want the rejected outcome", o.st)
			}
			a := o.deadLetter(t).Annotations
			if _, ok := a[amqpsub.AnnotationDeadLetterReason]; ok {
				t.Fatalf("a classic queue kept a reason: %v", a)
			}
			t.Logf("classic dead letter annotations: %v", a)
		}},

	// A panic.
	{name: "panic retries", target: onArtemis, calls: 2,
		handle: firstThen(func() error { panic("handler bug") }),
		check: func(t *testing.T, o outcomeRun) {
			if len(o.calls) != 2 || o.calls[1].count != 1 {
				t.Fatalf("calls %+v, want a redelivery with count 1", o.calls)
			}
			if o.st.Results.Panics != 1 || o.st.Settled.Modified != 1 {
				t.Fatalf("stats %+v", o.st)
			}
		}},
}

// outcomes runs the rows of outcomeRows whose target is among targets,
// each on a fresh queue, side by side: each waits mostly on the broker.
func outcomes(t *testing.T, targets ...string) {
	for _, r := range outcomeRows {
		if !slices.Contains(targets, r.target) {
			continue
		}
		t.Run(r.name, func(t *testing.T) {
			t.Parallel()
			tg := newTarget(t, r.target)
			o := outcomeRun{tg: tg, conn: dial(t, tg.url), q: tg.queue(t)}
			o.calls, o.st = tg.consumeOne(t, o.conn, o.q, r.handle, func(n int) bool { return n >= r.calls }, r.opts...)
			r.check(t, o)
		})
	}
}

// What each outcome does on Artemis.
func TestArtemisOutcomes(t *testing.T) { outcomes(t, onArtemis) }

// What each outcome does on each RabbitMQ 4 queue type, and how Run
// treats a queue it cannot use.
func TestRabbitMQ4Outcomes(t *testing.T) {
	outcomes(t, onRabbitMQ4Quorum, onRabbitMQ4Classic)
	tg := newTarget(t, onRabbitMQ4Classic)
	nop := amqpsub.HandlerFunc(func(context.Context, *amqpsub.Delivery) error { return nil })

	t.Run("classic refuses MaxDeliveryCount", func(t *testing.T) {
		t.Parallel()
		s := tg.subscriber(t, tg.queue(t), nop, amqpsub.MaxDeliveryCount(5))
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		err := s.Run(ctx)
		if !errors.Is(err, amqpsub.ErrInvalidOption) || !strings.Contains(err.Error(), "classic queue") {
			t.Fatalf("Run = %v; want ErrInvalidOption naming the classic queue", err)
		}
	})

	t.Run("a missing queue fails Run", func(t *testing.T) {
		t.Parallel()
		s := tg.subscriber(t, queueName(t), nop)
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		var ae *amqp.Error
		if err := s.Run(ctx); !errors.As(err, &ae) || ae.Condition != amqp.ErrCondNotFound {
			t.Fatalf("Run = %v; want amqp:not-found", err)
		}
	})

	t.Run("another profile is logged", func(t *testing.T) {
		t.Parallel()
		q := tg.queue(t)
		core, logs := observer.New(zap.InfoLevel)
		s, err := amqpsub.New(amqpsub.Dial(tg.url, nil), tg.address(q), nop,
			amqpsub.Logger(zap.New(core))) // the default profile, Artemis
		if err != nil {
			t.Fatal(err)
		}
		stop, wait := runSub(t, s)
		waitFor(t, 30*time.Second, "the attach", func() bool { return s.Stats().Links == 1 })
		stop()
		if err := wait(); err != nil {
			t.Fatal(err)
		}
		at := logs.FilterMessage("attached").All()
		if len(at) != 1 || at[0].ContextMap()["product"] != "RabbitMQ" || !strings.HasPrefix(at[0].ContextMap()["version"].(string), "4.") {
			t.Fatalf("attached lines %v: no product RabbitMQ 4", at)
		}
		w := logs.FilterMessage("the broker is not the profile's; give WithProfile the broker's profile").All()
		if len(w) != 1 || w[0].ContextMap()["suggested"] != "rabbitmq4" || w[0].ContextMap()["profile"] != "artemis" {
			t.Fatalf("profile warnings %v; want one suggesting rabbitmq4", w)
		}
	})

	t.Run("a name that needs encoding", func(t *testing.T) {
		t.Parallel()
		quorum := newTarget(t, onRabbitMQ4Quorum)
		q := quorum.queue(t) + ":x"
		rabbit4(t, "declare", q, "quorum")
		t.Cleanup(func() { rabbit4(t, "delete", q) })
		calls, _ := quorum.consumeOne(t, dial(t, quorum.url), q, func(int, *amqpsub.Delivery) error { return nil }, func(n int) bool { return n >= 1 })
		if len(calls) != 1 {
			t.Fatalf("%d calls on %q", len(calls), q)
		}
	})
}

// Deliveries with a delivery tag that is not 16 bytes, or without
// x-opt-locked-until: a logged skip of their renewal, never a crash.
func TestServiceBusBadDeliveries(t *testing.T) {
	p := serviceBusPeer(t)
	q := p.entity(t, map[string]any{"lock_duration_ms": 5000})
	p.send(t, q, 4)
	p.call(t, "POST", "/faults/delivery", map[string]any{"entity": q, "tag_length": 8, "times": 1}, nil)
	p.call(t, "POST", "/faults/delivery", map[string]any{"entity": q, "omit_annotations": []string{"x-opt-locked-until"}, "times": 1}, nil)
	t.Cleanup(func() { p.call(t, "POST", "/faults/delivery/clear", nil, nil) })
	var handled atomic.Int32
	s, _ := amqpsub.New(sbConnector(t, p), q, amqpsub.HandlerFunc(func(context.Context, *amqpsub.Delivery) error {
		handled.Add(1)
		return nil
	}), amqpsub.Logger(logger(t)))
	stop, wait := runSub(t, s)
	waitFor(t, 30*time.Second, "4 handled", func() bool { return handled.Load() >= 4 })
	stop()
	if err := wait(); err != nil {
		t.Fatal(err)
	}
	if st := s.Stats(); st.Locks.Unrenewable != 2 {
		t.Fatalf("stats %v, want 2 unrenewable", st)
	}
}

// MaxDeliveryCount(n) on Service Bus handles the n-th delivery and
// dead-letters the next, as an entity's MaxDeliveryCount of n does: here
// the entity's limit is far above, so only amqpsub's acts.
func TestServiceBusMaxDeliveryCountHandlesTheNthDelivery(t *testing.T) {
	p := serviceBusPeer(t)
	q := p.entity(t, map[string]any{"lock_duration_ms": 5000, "max_delivery_count": 50})
	p.send(t, q, 1)
	var calls atomic.Int32
	s, err := amqpsub.New(sbConnector(t, p), q, amqpsub.HandlerFunc(func(context.Context, *amqpsub.Delivery) error {
		calls.Add(1)
		return amqpsub.Retry(errors.New("store down"))
	}), amqpsub.MaxDeliveryCount(3), amqpsub.Logger(logger(t)))
	if err != nil {
		t.Fatal(err)
	}
	stop, wait := runSub(t, s)
	waitFor(t, 30*time.Second, "1 dead letter", func() bool { return p.info(t, q).DeadLetter == 1 })
	stop()
	if err := wait(); err != nil {
		t.Fatal(err)
	}
	dead := p.messages(t, q+"/$DeadLetterQueue")
	if len(dead) != 1 {
		t.Fatalf("dead letters %+v", dead)
	}
	t.Logf("handler calls %d; dead letter: delivery count %d, reason %v", calls.Load(), dead[0].DeliveryCount, dead[0].AppProps["DeadLetterReason"])
	if calls.Load() != 3 || dead[0].AppProps["DeadLetterReason"] != "MaxDeliveryCountExceeded" {
		t.Fatalf("handler called %d times (want 3); dead letter %+v", calls.Load(), dead[0])
	}
}
