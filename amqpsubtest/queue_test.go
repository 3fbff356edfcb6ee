package amqpsubtest_test

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/Azure/go-amqp"

	"github.com/amqpsub/amqpsub/amqpsub"
	"github.com/amqpsub/amqpsub/amqpsubtest"
)

// Every test here runs a real Subscriber on a Queue inside a synctest
// bubble, so that grace periods, backoffs and batch waits take no time.

func newSub(t *testing.T, q *amqpsubtest.Queue, h func(context.Context, *amqpsub.Delivery) error, opts ...amqpsub.Option) *amqpsub.Subscriber {
	t.Helper()
	sub, err := amqpsub.New(q.Connector(), "orders", amqpsub.HandlerFunc(h), opts...)
	if err != nil {
		t.Fatal(err)
	}
	return sub
}

// drain runs sub until q is drained, within a minute of the bubble's time.
func drain(t *testing.T, q *amqpsubtest.Queue, sub *amqpsub.Subscriber) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	if err := q.Drain(ctx, sub); err != nil {
		t.Fatal(err)
	}
}

// start runs sub in the background; stop cancels its ctx and returns what
// Run returned.
func start(sub *amqpsub.Subscriber) (stop func() error) {
	ctx, cancel := context.WithCancel(context.Background())
	ran := make(chan error, 1)
	go func() { ran <- sub.Run(ctx) }()
	return func() error { cancel(); return <-ran }
}

func text(d *amqpsub.Delivery) string {
	b, err := d.Body()
	if err != nil {
		panic(err)
	}
	return string(b)
}

func history(rs []amqpsubtest.Record) string {
	var b strings.Builder
	for _, r := range rs {
		b.WriteString(r.String() + "\n")
	}
	return b.String()
}

// calls counts handler calls per body.
type calls struct {
	mu sync.Mutex
	n  map[string]int
}

func (c *calls) add(key string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.n == nil {
		c.n = map[string]int{}
	}
	c.n[key]++
	return c.n[key]
}

func TestArtemisOutcomes(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		q := amqpsubtest.NewQueue()
		for _, b := range []string{"accept", "release once", "retry once", "reject", "reject with", "panic once"} {
			q.Publish(amqpsubtest.Message("", b))
		}
		var c calls
		var counts []string
		sub := newSub(t, q, func(_ context.Context, d *amqpsub.Delivery) error {
			b := text(d)
			first := c.add(b) == 1
			counts = append(counts, fmt.Sprintf("%s:%d", b, d.DeliveryCount()))
			switch {
			case b == "release once" && first:
				return amqpsub.Release()
			case b == "retry once" && first:
				return amqpsub.Retry(errors.New("store down"))
			case b == "reject":
				return amqpsub.Reject("malformed")
			case b == "reject with":
				return amqpsub.RejectWith("bad total", "total is -3")
			case b == "panic once" && first:
				panic("boom")
			}
			return nil
		}, amqpsub.FixedCredit()) // all six sent at once: the failed ones come back after
		drain(t, q, sub)
		want := `#0: 0 accepted → consumed
#1: 0 released, 0 accepted → consumed
#2: 0 modified{delivery-failed}, 1 accepted → consumed
#3: 0 rejected "malformed" → dead-lettered
#4: 0 rejected "bad total" → dead-lettered
#5: 0 modified{delivery-failed}, 1 accepted → consumed
`
		if got := history(q.Records()); got != want {
			t.Fatalf("history:\n%swant:\n%s", got, want)
		}
		// The handler saw the broker's count: not raised by a release.
		if got := strings.Join(counts, " "); got != "accept:0 release once:0 retry once:0 reject:0 reject with:0 panic once:0 release once:0 retry once:1 panic once:1" {
			t.Fatalf("handler saw %s", got)
		}
		dl := q.DeadLetters()
		if len(dl) != 2 || dl[0].Reason() != "malformed" || dl[0].Description() != "" ||
			dl[1].Reason() != "bad total" || dl[1].Description() != "total is -3" {
			t.Fatalf("dead letters %v", dl)
		}
		e := dl[1].Deliveries[0].Error
		if e.Condition != amqpsub.RejectCondition || e.Info["DeadLetterReason"] != "bad total" {
			t.Fatalf("reject error %+v", e)
		}
	})
}

func TestRetryIsDeadLetteredAtMaxDeliveryAttempts(t *testing.T) {
	for _, tc := range []struct {
		opts []amqpsubtest.Option
		want int // deliveries before the dead letter; 0: never
	}{
		{nil, 10},
		{[]amqpsubtest.Option{amqpsubtest.MaxDeliveryAttempts(5)}, 5},
		{[]amqpsubtest.Option{amqpsubtest.MaxDeliveryAttempts(1)}, 1},
		{[]amqpsubtest.Option{amqpsubtest.MaxDeliveryAttempts(0)}, 0},
	} {
		synctest.Test(t, func(t *testing.T) {
			q := amqpsubtest.NewQueue(tc.opts...)
			q.Publish(amqpsubtest.Message("", "poison"))
			n := 0
			sub := newSub(t, q, func(context.Context, *amqpsub.Delivery) error {
				if n++; n == 30 {
					return nil // never dead-lettered: give up
				}
				return errors.New("always")
			})
			drain(t, q, sub)
			r := q.Records()[0]
			if tc.want == 0 {
				if r.State != amqpsubtest.Consumed || len(r.Deliveries) != 30 {
					t.Fatalf("without a max: %v", r)
				}
				return
			}
			if r.State != amqpsubtest.DeadLettered || len(r.Deliveries) != tc.want || r.Reason() != "" {
				t.Fatalf("max %d: %v", tc.want, r)
			}
			for i, d := range r.Deliveries {
				if d.Count != uint32(i) || d.Outcome != amqpsubtest.Failed {
					t.Fatalf("delivery %d: %v", i, d)
				}
			}
		})
	}
}

func TestRabbitMQ3RetryIsReleasedAndNotCounted(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		q := amqpsubtest.NewQueue(amqpsubtest.WithProfile(amqpsub.RabbitMQ3), amqpsubtest.MaxDeliveryAttempts(1))
		q.Publish(amqpsubtest.Message("", "x"))
		var seen []string
		sub := newSub(t, q, func(_ context.Context, d *amqpsub.Delivery) error {
			seen = append(seen, fmt.Sprint(d.DeliveryCount(), d.FirstAcquirer()))
			if len(seen) < 3 {
				return amqpsub.Retry(nil)
			}
			return nil
		}, amqpsub.WithProfile(amqpsub.RabbitMQ3))
		drain(t, q, sub)
		if got := history(q.Records()); got != "#0: 0 released, 0 released, 0 accepted → consumed\n" {
			t.Fatal(got)
		}
		if fmt.Sprint(seen) != "[0 true 0 false 0 false]" {
			t.Fatalf("handler saw count, first-acquirer %v", seen)
		}
	})
}

// A subscriber with the Artemis profile on RabbitMQ 3.10 loses its session
// at each Retry: the queue shows it, as the broker would.
func TestRabbitMQ3EndsTheSessionOnModified(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		q := amqpsubtest.NewQueue(amqpsubtest.WithProfile(amqpsub.RabbitMQ3))
		q.Publish(amqpsubtest.Message("", "x"))
		n := 0
		sub := newSub(t, q, func(context.Context, *amqpsub.Delivery) error {
			if n++; n == 1 {
				return errors.New("transient")
			}
			return nil
		})
		drain(t, q, sub)
		r := q.Records()[0]
		if r.String() != "#0: 0 modified{delivery-failed}, 0 accepted → consumed" || r.Deliveries[1].Link != 2 {
			t.Fatalf("%v on links %d, %d", r, r.Deliveries[0].Link, r.Deliveries[1].Link)
		}
		if st := sub.Stats(); st.LinksLost != 1 || st.Reconnects != 1 || st.SettleErrors != 1 {
			t.Fatal(st)
		}
	})
}

// seq reads "group/seq" bodies.
func seq(body string) (string, int) {
	g, n, _ := strings.Cut(body, "/")
	i, _ := strconv.Atoi(n)
	return g, i
}

func publishGroups(q *amqpsubtest.Queue, groups, each int) {
	for i := range each {
		for g := range groups {
			q.Publish(amqpsubtest.Message(fmt.Sprint("g", g), fmt.Sprintf("g%d/%d", g, i)))
		}
	}
}

func TestWorkersByKeyKeepsEachGroupInOrder(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		q := amqpsubtest.NewQueue()
		publishGroups(q, 7, 30)
		var mu sync.Mutex
		var handled []string
		sub := newSub(t, q, func(_ context.Context, d *amqpsub.Delivery) error {
			mu.Lock()
			handled = append(handled, text(d))
			mu.Unlock()
			time.Sleep(time.Millisecond) // in the bubble: lets the lanes interleave
			return nil
		}, amqpsub.WorkersByKey(3), amqpsub.Credit(16))
		drain(t, q, sub)
		if err := amqpsubtest.GroupOrder(handled, seq); err != nil {
			t.Fatal(err)
		}
		byIndex := func(r amqpsubtest.Record) (string, int) { return r.GroupID(), r.Index }
		if err := amqpsubtest.GroupOrder(q.Accepted(), byIndex); err != nil {
			t.Fatal(err)
		}
		if len(handled) != 210 || len(q.Accepted()) != 210 {
			t.Fatalf("handled %d, accepted %d", len(handled), len(q.Accepted()))
		}
	})
}

// A Retry goes back to the broker, and the group's next delivery, already
// in the lane, runs before the redelivery: group order breaks. LocalRetry
// retries in the lane and keeps it.
func TestBrokerRetryBreaksGroupOrderLocalRetryKeepsIt(t *testing.T) {
	for _, local := range []bool{false, true} {
		t.Run(fmt.Sprintf("LocalRetry=%v", local), func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				q := amqpsubtest.NewQueue()
				publishGroups(q, 1, 2)
				gate := make(chan struct{})
				var handled []string
				// Fixed: the group's next delivery is held when the first fails.
				opts := []amqpsub.Option{amqpsub.WorkersByKey(1), amqpsub.Credit(2), amqpsub.FixedCredit()}
				if local {
					opts = append(opts, amqpsub.LocalRetry(amqpsub.RetryPolicy{Attempts: 3}))
				}
				sub := newSub(t, q, func(_ context.Context, d *amqpsub.Delivery) error {
					handled = append(handled, text(d))
					if len(handled) == 1 {
						<-gate
						return amqpsub.Retry(errors.New("store down"))
					}
					return nil
				}, opts...)
				stop := start(sub)
				synctest.Wait() // g0/1 waits in the lane behind g0/0
				close(gate)
				if err := q.Wait(t.Context()); err != nil {
					t.Fatal(err)
				}
				if err := stop(); err != nil {
					t.Fatal(err)
				}
				err := amqpsubtest.GroupOrder(handled, seq)
				if local != (err == nil) {
					t.Fatalf("handled %v: %v", handled, err)
				}
			})
		})
	}
}

func TestBatch(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		q := amqpsubtest.NewQueue()
		for i := range 10 {
			q.Publish(amqpsubtest.Message("", fmt.Sprint(i)))
		}
		began := time.Now()
		var batches []string
		var c calls
		sub, err := amqpsub.NewBatch(q.Connector(), "orders", amqpsub.BatchHandlerFunc(func(_ context.Context, b []*amqpsub.Delivery) []error {
			batches = append(batches, fmt.Sprintf("%d@%v", len(b), time.Since(began)))
			results := make([]error, len(b))
			for i, d := range b {
				switch text(d) {
				case "3":
					results[i] = amqpsub.Reject("bad")
				case "5":
					if c.add("5") == 1 {
						results[i] = errors.New("transient")
					}
				}
			}
			return results
		}), amqpsub.Batch(4, time.Second))
		if err != nil {
			t.Fatal(err)
		}
		drain(t, q, sub)
		// Batches close at 4, the rest after the wait; the redelivery of
		// the failed one joins the batch still open.
		if got := fmt.Sprint(batches); got != "[4@0s 4@0s 3@1s]" {
			t.Fatalf("batches %s", got)
		}
		rs := q.Records()
		if rs[3].String() != `#3: 0 rejected "bad" → dead-lettered` || rs[5].String() != "#5: 0 modified{delivery-failed}, 1 accepted → consumed" {
			t.Fatal(history(rs))
		}
	})
}

// Batches per lane, with failures retried in the lane: the broker sees no
// failure, and each group's effects keep their order, provided the batch
// handler fails the rest of a group after a failure (LocalRetry retries
// only the failed deliveries, as a batch of their own).
func TestBatchWithLanesAndLocalRetryKeepsGroupOrder(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		q := amqpsubtest.NewQueue()
		publishGroups(q, 5, 12)
		var mu sync.Mutex
		var done []string // effects, in the order they happened
		var c calls
		sub, err := amqpsub.NewBatch(q.Connector(), "orders", amqpsub.BatchHandlerFunc(func(_ context.Context, b []*amqpsub.Delivery) []error {
			results := make([]error, len(b))
			failed := map[string]bool{}
			for i, d := range b {
				body := text(d)
				g, n := seq(body)
				switch {
				case failed[g]:
					results[i] = errors.New("an earlier delivery of the group failed")
				case n%5 == 2 && c.add(body) < 3:
					results[i] = errors.New("store down")
					failed[g] = true
				default:
					mu.Lock()
					done = append(done, body)
					mu.Unlock()
				}
			}
			time.Sleep(time.Millisecond)
			return results
		}), amqpsub.Batch(3, 10*time.Millisecond), amqpsub.WorkersByKey(2), amqpsub.Credit(8),
			amqpsub.LocalRetry(amqpsub.RetryPolicy{Attempts: 5, Initial: time.Second}))
		if err != nil {
			t.Fatal(err)
		}
		drain(t, q, sub)
		if err := amqpsubtest.GroupOrder(done, seq); err != nil {
			t.Fatal(err)
		}
		for _, r := range q.Records() {
			if len(r.Deliveries) != 1 || r.State != amqpsubtest.Consumed {
				t.Fatal(r)
			}
		}
		if len(done) != 60 {
			t.Fatalf("%d effects", len(done))
		}
	})
}

func TestLocalRetryWaitsInFakeTime(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		q := amqpsubtest.NewQueue()
		q.Publish(amqpsubtest.Message("", "x"))
		began := time.Now()
		var at []time.Duration
		sub := newSub(t, q, func(context.Context, *amqpsub.Delivery) error {
			at = append(at, time.Since(began))
			if len(at) < 4 {
				return errors.New("store down")
			}
			return nil
		}, amqpsub.LocalRetry(amqpsub.RetryPolicy{Attempts: 5, Initial: time.Second, Max: time.Minute}))
		drain(t, q, sub)
		if fmt.Sprint(at) != "[0s 1s 3s 7s]" {
			t.Fatalf("calls at %v", at)
		}
		// The broker saw one delivery, accepted.
		if got := q.Records()[0].String(); got != "#0: 0 accepted → consumed" {
			t.Fatal(got)
		}
		if st := sub.Stats(); st.Results.LocalRetries != 3 {
			t.Fatal(st)
		}
	})
}

func TestMaxDeliveryCountRejectsBeforeTheHandler(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		q := amqpsubtest.NewQueue(amqpsubtest.MaxDeliveryAttempts(0)) // a broker without a limit
		q.Publish(amqpsubtest.Message("", "poison"))
		seeded := amqpsubtest.Message("", "seeded")
		seeded.Header = &amqp.MessageHeader{DeliveryCount: 7}
		q.Publish(seeded)
		var c calls
		sub := newSub(t, q, func(_ context.Context, d *amqpsub.Delivery) error {
			c.add(text(d))
			return errors.New("always")
		}, amqpsub.MaxDeliveryCount(2))
		drain(t, q, sub)
		want := `#0: 0 modified{delivery-failed}, 1 modified{delivery-failed}, 2 modified{delivery-failed}, 3 rejected "amqpsub: delivery count 3 is past the limit 2" → dead-lettered
#1: 7 rejected "amqpsub: delivery count 7 is past the limit 2" → dead-lettered
`
		if got := history(q.Records()); got != want {
			t.Fatalf("history:\n%swant:\n%s", got, want)
		}
		if c.n["poison"] != 3 || c.n["seeded"] != 0 {
			t.Fatalf("handler calls %v", c.n)
		}
	})
}

func TestTheQueueNeverSendsPastTheCredit(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		q := amqpsubtest.NewQueue()
		for range 20 {
			q.Publish(amqpsubtest.Message("", "x"))
		}
		gate := make(chan struct{})
		sub := newSub(t, q, func(context.Context, *amqpsub.Delivery) error { <-gate; return nil },
			amqpsub.Credit(4), amqpsub.FixedCredit(), amqpsub.Workers(2))
		stop := start(sub)
		synctest.Wait()
		inFlight := 0
		for _, r := range q.Records() {
			if r.State == amqpsubtest.InFlight {
				inFlight++
			}
		}
		if st := sub.Stats(); inFlight != 4 || len(q.Queued()) != 16 || st.Held != 4 || st.Handling != 2 {
			t.Fatalf("in flight %d, queued %d, %v", inFlight, len(q.Queued()), st)
		}
		close(gate)
		if err := q.Wait(t.Context()); err != nil {
			t.Fatal(err)
		}
		if err := stop(); err != nil {
			t.Fatal(err)
		}
		if st := sub.Stats(); st.MaxHeld != 4 {
			t.Fatal(st)
		}
	})
}

func TestLostLinkRedeliversWhatWasUnsettled(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		q := amqpsubtest.NewQueue()
		publishGroups(q, 1, 3)
		gate := make(chan struct{})
		var handled []string
		var causes []error
		sub := newSub(t, q, func(_ context.Context, d *amqpsub.Delivery) error {
			handled = append(handled, text(d))
			if len(handled) == 1 {
				<-gate
			}
			return nil
		}, amqpsub.OnReconnect(func(_ int, cause error) { causes = append(causes, cause) }), amqpsub.FixedCredit())
		stop := start(sub)
		synctest.Wait() // g0/0 in the handler, the others buffered
		q.LoseLinks(nil)
		synctest.Wait() // the subscriber saw the loss; it waits out a backoff
		close(gate)     // the handler's acceptance is of a lost link: not sent
		if err := q.Wait(t.Context()); err != nil {
			t.Fatal(err)
		}
		if err := stop(); err != nil {
			t.Fatal(err)
		}
		want := `#0 group g0: 0 unsettled, 0 accepted → consumed
#1 group g0: 0 unsettled, 0 accepted → consumed
#2 group g0: 0 unsettled, 0 accepted → consumed
`
		if got := history(q.Records()); got != want {
			t.Fatalf("history:\n%swant:\n%s", got, want)
		}
		if d := q.Records()[0].Deliveries; d[0].Link != 1 || d[1].Link != 2 {
			t.Fatalf("links %d, %d", d[0].Link, d[1].Link)
		}
		// At least once: g0/0 was handled twice, in order.
		if fmt.Sprint(handled) != "[g0/0 g0/0 g0/1 g0/2]" {
			t.Fatalf("handled %v", handled)
		}
		var le *amqp.LinkError
		if len(causes) != 1 || !errors.As(causes[0], &le) {
			t.Fatalf("reconnect causes %v", causes)
		}
		if st := sub.Stats(); st.LinksLost != 1 || st.Reconnects != 1 || st.Stale != 1 {
			t.Fatal(st)
		}
	})
}

func TestRefusedAttach(t *testing.T) {
	unauthorized := &amqp.Error{Condition: amqp.ErrCondUnauthorizedAccess}
	nothing := func(context.Context, *amqpsub.Delivery) error { return nil }
	t.Run("at start Run returns it", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			q := amqpsubtest.NewQueue()
			q.RefuseAttach(unauthorized)
			q.Publish(amqpsubtest.Message("", "x"))
			err := q.Drain(t.Context(), newSub(t, q, nothing))
			if !errors.Is(err, unauthorized) || !strings.Contains(err.Error(), "Run returned before 0 of 1 messages") {
				t.Fatalf("Drain = %v", err)
			}
		})
	})
	t.Run("a fatal one on reconnect ends Run", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			q := amqpsubtest.NewQueue()
			sub := newSub(t, q, nothing)
			stop := start(sub)
			synctest.Wait()
			q.RefuseAttach(unauthorized)
			q.LoseLinks(nil)
			<-sub.Done()
			if err := stop(); !errors.Is(err, amqpsub.ErrLinkLost) || !errors.Is(err, unauthorized) {
				t.Fatalf("Run = %v", err)
			}
		})
	})
	t.Run("a transient one on reconnect is retried", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			q := amqpsubtest.NewQueue()
			var mu sync.Mutex
			var kinds []string
			sub := newSub(t, q, nothing, amqpsub.OnEvent(func(e amqpsub.Event) {
				mu.Lock()
				kinds = append(kinds, e.Kind.String())
				mu.Unlock()
			}))
			stop := start(sub)
			synctest.Wait()
			q.RefuseAttach(errors.New("connection refused"))
			q.LoseLinks(nil)
			time.Sleep(time.Minute) // the bubble's clock: attempts fail meanwhile
			q.RefuseAttach(nil)
			q.Publish(amqpsubtest.Message("", "x"))
			if err := q.Wait(t.Context()); err != nil {
				t.Fatal(err)
			}
			if err := stop(); err != nil {
				t.Fatal(err)
			}
			mu.Lock()
			defer mu.Unlock()
			got := strings.Join(kinds, " ")
			if !strings.HasPrefix(got, "link-lost reconnect-failed") || !strings.HasSuffix(got, "reconnect-failed reconnected") {
				t.Fatalf("events %s", got)
			}
		})
	})
}

// The stop paths. A handler learns that the subscriber gave up on it from
// its ctx; these tests show what the queue sees for each.
func TestStopPaths(t *testing.T) {
	// blocking publishes 3 messages and returns a subscriber whose handler
	// holds the first until gate closes or its ctx ends, and reports
	// ctx.Err() when it returns.
	blocking := func(t *testing.T, q *amqpsubtest.Queue, opts ...amqpsub.Option) (sub *amqpsub.Subscriber, gate chan struct{}, ctxErr <-chan error) {
		// Fixed: the two behind the blocked one are buffered, for the stop
		// to release.
		opts = append(opts, amqpsub.FixedCredit())
		q.Publish(amqpsubtest.Message("", "0"), amqpsubtest.Message("", "1"), amqpsubtest.Message("", "2"))
		gate = make(chan struct{})
		errc := make(chan error, 1)
		sub = newSub(t, q, func(ctx context.Context, d *amqpsub.Delivery) error {
			if text(d) != "0" {
				return nil
			}
			select {
			case <-gate:
			case <-ctx.Done():
			}
			errc <- ctx.Err()
			return ctx.Err()
		}, opts...)
		return sub, gate, errc
	}
	states := func(q *amqpsubtest.Queue) string {
		var s []string
		for _, r := range q.Records() {
			s = append(s, r.State.String())
		}
		return strings.Join(s, ", ")
	}

	t.Run("ctx cancelled: the handler finishes, the rest is released", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			q := amqpsubtest.NewQueue()
			sub, gate, ctxErr := blocking(t, q)
			ctx, cancel := context.WithCancel(t.Context())
			ran := make(chan error, 1)
			go func() { ran <- sub.Run(ctx) }()
			synctest.Wait()
			cancel()
			synctest.Wait()
			close(gate)
			if err := <-ran; err != nil {
				t.Fatal(err)
			}
			if err := <-ctxErr; err != nil {
				t.Fatalf("the handler's ctx: %v", err)
			}
			if got := states(q); got != "consumed, queued, queued" {
				t.Fatal(got)
			}
			for _, r := range q.Queued() {
				if r.Deliveries[0].Outcome != amqpsubtest.Released {
					t.Fatal(r)
				}
			}
		})
	})
	t.Run("grace period over: the handler's ctx is cancelled", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			q := amqpsubtest.NewQueue()
			sub, _, ctxErr := blocking(t, q, amqpsub.GracePeriod(5*time.Second))
			stop := start(sub)
			synctest.Wait()
			began := time.Now()
			if err := sub.Shutdown(t.Context()); err != nil {
				t.Fatal(err)
			}
			if err := <-ctxErr; !errors.Is(err, context.Canceled) || time.Since(began) != 5*time.Second {
				t.Fatalf("the handler's ctx: %v after %v", err, time.Since(began))
			}
			if err := stop(); err != nil {
				t.Fatal(err)
			}
			checkCancelled(t, q.Records()[0])
			if got := states(q); got != "queued, queued, queued" {
				t.Fatal(got)
			}
		})
	})
	t.Run("Close: the handler's ctx is cancelled at once", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			q := amqpsubtest.NewQueue()
			sub, _, ctxErr := blocking(t, q)
			stop := start(sub)
			synctest.Wait()
			began := time.Now()
			_ = sub.Close()
			if err := <-ctxErr; !errors.Is(err, context.Canceled) || time.Since(began) != 0 {
				t.Fatalf("the handler's ctx: %v after %v", err, time.Since(began))
			}
			if err := stop(); err != nil {
				t.Fatal(err)
			}
			checkCancelled(t, q.Records()[0])
			// The buffered ones are back too: released, or unsettled when
			// the link closed first.
			for _, r := range q.Records()[1:] {
				if o := r.Deliveries[0].Outcome; r.State != amqpsubtest.Queued || o != amqpsubtest.Released && o != amqpsubtest.Unsettled {
					t.Fatal(r)
				}
			}
		})
	})
	t.Run("Shutdown hands the group over to another subscriber, in order", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			q := amqpsubtest.NewQueue()
			publishGroups(q, 1, 5)
			gate := make(chan struct{})
			var mu sync.Mutex
			var handled []string
			handler := func(name string) func(context.Context, *amqpsub.Delivery) error {
				return func(_ context.Context, d *amqpsub.Delivery) error {
					mu.Lock()
					handled = append(handled, name+":"+text(d))
					first := len(handled) == 1
					mu.Unlock()
					if first {
						<-gate
					}
					return nil
				}
			}
			a := newSub(t, q, handler("a"), amqpsub.WorkersByKey(2))
			stopA := start(a)
			synctest.Wait() // a owns group g0 and holds all of it
			b := newSub(t, q, handler("b"), amqpsub.WorkersByKey(2))
			stopB := start(b)
			synctest.Wait()
			shut := make(chan error, 1)
			go func() { shut <- a.Shutdown(t.Context()) }()
			synctest.Wait() // a released what it buffered, but still owns g0
			close(gate)
			if err := <-shut; err != nil {
				t.Fatal(err)
			}
			if err := stopA(); err != nil {
				t.Fatal(err)
			}
			if err := q.Wait(t.Context()); err != nil {
				t.Fatal(err)
			}
			if err := stopB(); err != nil {
				t.Fatal(err)
			}
			if got := fmt.Sprint(handled); got != "[a:g0/0 b:g0/1 b:g0/2 b:g0/3 b:g0/4]" {
				t.Fatalf("handled %s", got)
			}
		})
	})
}

// checkCancelled checks the record of a delivery whose handler the
// subscriber gave up on: back in the queue. amqpsub may or may not have
// sent the handler's result (ctx.Err(), a Retry) before the link closed.
func checkCancelled(t *testing.T, r amqpsubtest.Record) {
	t.Helper()
	d := r.Deliveries[0]
	if r.State != amqpsubtest.Queued || len(r.Deliveries) != 1 || (d.Outcome != amqpsubtest.Unsettled && d.Outcome != amqpsubtest.Failed) {
		t.Fatalf("the cancelled delivery: %v", r)
	}
	if d.Outcome == amqpsubtest.Failed {
		t.Logf("the cancelled handler's Retry reached the queue: %v", r)
	}
}

// A queue made outside a bubble serves a subscriber inside one.
func TestQueueMadeOutsideTheBubble(t *testing.T) {
	q := amqpsubtest.NewQueue()
	q.Publish(amqpsubtest.Message("", "x"))
	synctest.Test(t, func(t *testing.T) {
		drain(t, q, newSub(t, q, func(context.Context, *amqpsub.Delivery) error {
			time.Sleep(time.Second)
			return nil
		}))
	})
	if got := q.Records()[0].String(); got != "#0: 0 accepted → consumed" {
		t.Fatal(got)
	}
}

func TestWaitSaysWhatIsLeft(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		q := amqpsubtest.NewQueue()
		q.Publish(amqpsubtest.Message("", "x"), amqpsubtest.Message("", "y"), amqpsubtest.Message("", "z"))
		gate := make(chan struct{})
		stop := start(newSub(t, q, func(_ context.Context, d *amqpsub.Delivery) error {
			if text(d) == "y" {
				<-gate
			}
			return nil
		}, amqpsub.Credit(1)))
		ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
		defer cancel()
		err := q.Wait(ctx)
		if !errors.Is(err, context.DeadlineExceeded) ||
			!strings.Contains(err.Error(), "1 of 3 messages were accepted or dead-lettered (1 queued, 1 in flight)") {
			t.Fatalf("Wait = %v", err)
		}
		close(gate)
		if err := stop(); err != nil {
			t.Fatal(err)
		}
	})
}

func TestGroupOrder(t *testing.T) {
	for _, tc := range []struct {
		items []string
		err   string
	}{
		{nil, ""},
		{[]string{"a/1", "b/1", "a/2", "b/5", "/9", "/1"}, ""},
		{[]string{"a/1", "b/2", "a/3", "b/1"}, `group "b" out of order at item 3: 1 after 2`},
		{[]string{"a/1", "a/1", "a/2", "a/2"}, ""},
		{[]string{"a/1", "a/2", "a/1", "a/2"}, `group "a" out of order at item 2: 1 after 2`},
	} {
		err := amqpsubtest.GroupOrder(tc.items, seq)
		if (err == nil) != (tc.err == "") || err != nil && !strings.HasSuffix(err.Error(), tc.err) {
			t.Errorf("GroupOrder(%v) = %v, want %q", tc.items, err, tc.err)
		}
	}
}

// A graceful stop drains the link's credit, as Artemis does with amqpsub's
// drain: the deliveries it releases are not sent back to the stopping link
// while a handler finishes.
func TestStopDoesNotRedeliverToTheStoppingLink(t *testing.T) {
	q := amqpsubtest.NewQueue()
	q.Publish(amqpsubtest.Message("a", "1"), amqpsubtest.Message("a", "2"))
	began, finish := make(chan struct{}), make(chan struct{})
	calls := 0
	sub, err := amqpsub.New(q.Connector(), "q", amqpsub.HandlerFunc(func(ctx context.Context, d *amqpsub.Delivery) error {
		calls++
		if calls == 1 {
			close(began)
			<-finish
		}
		return nil
	}), amqpsub.FixedCredit()) // the second is buffered while the first is handled
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(t.Context())
	errc := make(chan error, 1)
	go func() { errc <- sub.Run(ctx) }()
	<-began
	cancel() // the second delivery is released while the first is handled
	for sub.Stats().Settled.Released == 0 {
		runtime.Gosched()
	}
	close(finish)
	if err := <-errc; err != nil {
		t.Fatal(err)
	}
	if st := sub.Stats(); st.Received != 2 || calls != 1 {
		t.Fatalf("received %d, handled %d; want 2 received, 1 handled (no redelivery to the stopping link)\n%v", st.Received, calls, q.Records())
	}
	if n := len(q.Queued()); n != 1 {
		t.Fatalf("%d left on the queue, want the released one", n)
	}
}

// eventLog records a subscriber's events, from whichever goroutine.
type eventLog struct {
	mu  sync.Mutex
	evs []amqpsub.Event
}

func (e *eventLog) on(ev amqpsub.Event) {
	e.mu.Lock()
	e.evs = append(e.evs, ev)
	e.mu.Unlock()
}

// of returns the events of kind k.
func (e *eventLog) of(k amqpsub.EventKind) []amqpsub.Event {
	e.mu.Lock()
	defer e.mu.Unlock()
	var out []amqpsub.Event
	for _, ev := range e.evs {
		if ev.Kind == k {
			out = append(out, ev)
		}
	}
	return out
}

// twoGates is a handler whose first call for body "0" waits for gate0 and
// whose first call for "1" waits for gate1; it counts its calls per body.
type twoGates struct {
	gate0, gate1 chan struct{}
	calls        calls
}

func newTwoGates() *twoGates {
	return &twoGates{gate0: make(chan struct{}), gate1: make(chan struct{})}
}

func (g *twoGates) handle(_ context.Context, d *amqpsub.Delivery) error {
	b := text(d)
	if g.calls.add(b) == 1 {
		switch b {
		case "0":
			<-g.gate0
		case "1":
			<-g.gate1
		}
	}
	return nil
}

// lostLinkRun publishes 0, 1 and 2 to q and runs a subscriber with credit 2
// and one worker: 0 waits in the handler and 1 behind it, on link 1. hit
// is called then; gate0 opens (0's acceptance frees credit, which the
// pump grants); once the subscriber has settled (attached again, if
// anything made it lose the link), gate1 opens and the queue drains. It
// returns the events, and checks that nothing was lost: 1 went back
// unsettled from link 1 and came again on link 2, every message was
// accepted, each handled once but 1 (handled again if its first call was
// of the lost link), and Run went on to the stop.
func lostLinkRun(t *testing.T, q *amqpsubtest.Queue, hit func(), opts ...amqpsub.Option) (*eventLog, amqpsub.Stats) {
	t.Helper()
	q.Publish(amqpsubtest.Message("", "0"), amqpsubtest.Message("", "1"), amqpsubtest.Message("", "2"))
	g := newTwoGates()
	var evs eventLog
	sub := newSub(t, q, g.handle, append([]amqpsub.Option{amqpsub.Credit(2), amqpsub.FixedCredit(),
		amqpsub.Workers(1), amqpsub.OnEvent(evs.on)}, opts...)...)
	stop := start(sub)
	synctest.Wait()
	if got := q.Credit(); got != 0 {
		t.Fatalf("Credit() = %d with both deliveries held, want 0", got)
	}
	hit()
	close(g.gate0)
	synctest.Wait()
	close(g.gate1)
	if err := q.Wait(t.Context()); err != nil {
		t.Fatal(err)
	}
	select {
	case <-sub.Done():
		t.Fatal("Run returned before the stop")
	default:
	}
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	want := `#0: 0 accepted → consumed
#1: 0 unsettled, 0 accepted → consumed
#2: 0 accepted → consumed
`
	if got := history(q.Records()); got != want {
		t.Fatalf("history:\n%swant:\n%s", got, want)
	}
	if d := q.Records()[1].Deliveries; d[0].Link != 1 || d[1].Link != 2 {
		t.Fatalf("1 went out on links %d, %d; want 1, then 2", d[0].Link, d[1].Link)
	}
	st := sub.Stats()
	// 1, of the lost link, was either in the handler (its acceptance then
	// stale, not sent) or still waiting for it (dropped).
	if n := g.calls.n; n["0"] != 1 || n["2"] != 1 || n["1"] != int(1+st.Stale) || st.Stale+st.Dropped != 1 {
		t.Fatalf("handler calls %v; %v", n, st)
	}
	if st.LinksLost != 1 || st.Reconnects != 1 || st.Settled.Accepted != 3 {
		t.Fatal(st)
	}
	return &evs, st
}

// An IssueCredit that fails as on a link with a drain pending: the pump
// gives the link up as lost (the error is the loss's cause), the
// subscriber attaches a new one and goes on, and what the first link held
// comes back on the second. Nothing is lost and Run goes on.
func TestIssueCreditFailureReplacesTheLink(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		q := amqpsubtest.NewQueue()
		var causes []error
		evs, _ := lostLinkRun(t, q, func() { q.FailIssueCredit(1) },
			amqpsub.OnReconnect(func(_ int, cause error) { causes = append(causes, cause) }))
		const draining = "pump: issue credit: link is currently draining, no credits can be added"
		lost := evs.of(amqpsub.EventLinkLost)
		if len(lost) != 1 || lost[0].Err == nil || lost[0].Err.Error() != draining {
			t.Fatalf("link-lost events %v, want one: %s", lost, draining)
		}
		if len(causes) != 1 || causes[0].Error() != draining {
			t.Fatalf("reconnect causes %v, want %s", causes, draining)
		}
	})
}

// lossAtSettle is a Recorder that loses the queue's links as the pump
// applies the first settlement: it runs on the pump's goroutine, so the
// pump then grants the credit the settlement freed on the link just lost,
// before it can hear of the loss from its receive loop.
type lossAtSettle struct {
	q    *amqpsubtest.Queue
	once sync.Once
}

func (r *lossAtSettle) Recorder(amqpsub.MetricsInfo) amqpsub.Recorder { return r }
func (r *lossAtSettle) Received()                                     {}
func (r *lossAtSettle) Handled(amqpsub.HandlerCall)                   {}
func (r *lossAtSettle) Settled(amqpsub.Outcome, error)                { r.once.Do(func() { r.q.LoseLinks(nil) }) }
func (r *lossAtSettle) Event(amqpsub.Event)                           {}
func (r *lossAtSettle) LocksRenewed(int)                              {}
func (r *lossAtSettle) Dropped(int)                                   {}

// The pump grants credit on a link lost a moment before. IssueCredit
// returns nil there, as go-amqp's does, so the loss the subscriber
// reports is what its Receive saw, the broker's detach, not an IssueCredit
// error; it attaches again and nothing is lost.
func TestIssueCreditOnALostLinkLeavesTheLossToReceive(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		q := amqpsubtest.NewQueue()
		evs, _ := lostLinkRun(t, q, func() {}, amqpsub.WithMetrics(&lossAtSettle{q: q}))
		lost := evs.of(amqpsub.EventLinkLost)
		var le *amqp.LinkError
		if len(lost) != 1 || !errors.As(lost[0].Err, &le) || le.RemoteErr == nil || le.RemoteErr.Condition != amqp.ErrCondDetachForced {
			t.Fatalf("link-lost events %v, want one, the detach", lost)
		}
		if msg := lost[0].Err.Error(); !strings.HasPrefix(msg, "pump: receive: ") {
			t.Fatalf("the loss was reported as %q, want the receive's", msg)
		}
	})
}

// Credit is what the attached links were given and have not used: it
// falls with each delivery, rises with each grant, and a link's share goes
// when it drains or ends.
func TestQueueCredit(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		q := amqpsubtest.NewQueue()
		if got := q.Credit(); got != 0 {
			t.Fatalf("Credit() = %d with no link, want 0", got)
		}
		gate := make(chan struct{})
		h := func(context.Context, *amqpsub.Delivery) error { <-gate; return nil }
		stop := start(newSub(t, q, h, amqpsub.Credit(4), amqpsub.FixedCredit(), amqpsub.Workers(1),
			amqpsub.Backoff(time.Second, time.Second)))
		synctest.Wait()
		if got := q.Credit(); got != 4 {
			t.Fatalf("Credit() = %d on an empty queue, want the 4 granted", got)
		}
		q.Publish(amqpsubtest.Message("", "0"))
		synctest.Wait()
		if got := q.Credit(); got != 3 {
			t.Fatalf("Credit() = %d with one delivered, want 3", got)
		}
		// A second subscriber's link adds its own.
		stop2 := start(newSub(t, q, h, amqpsub.Credit(2), amqpsub.FixedCredit(), amqpsub.Workers(1)))
		synctest.Wait()
		if got := q.Credit(); got != 5 {
			t.Fatalf("Credit() = %d with two links, want 3 + 2", got)
		}
		for i := 1; i <= 6; i++ {
			q.Publish(amqpsubtest.Message("", strconv.Itoa(i)))
		}
		synctest.Wait()
		if got, queued := q.Credit(), len(q.Queued()); got != 0 || queued != 1 {
			t.Fatalf("Credit() = %d, %d queued with 7 published over 6 credits, want 0, 1", got, queued)
		}
		close(gate)
		if err := q.Wait(t.Context()); err != nil {
			t.Fatal(err)
		}
		synctest.Wait() // the last settlements' credit granted again
		if got := q.Credit(); got != 6 {
			t.Fatalf("Credit() = %d with both links idle, want 4 + 2", got)
		}
		// The drain at the second's stop takes its credit back, and its
		// link ends.
		if err := stop2(); err != nil {
			t.Fatal(err)
		}
		if got := q.Credit(); got != 4 {
			t.Fatalf("Credit() = %d after the second stopped, want the first's 4", got)
		}
		q.LoseLinks(nil)
		if got := q.Credit(); got != 0 {
			t.Fatalf("Credit() = %d after the links were lost, want 0", got)
		}
		time.Sleep(time.Second) // the reconnect's backoff, on the bubble's clock
		synctest.Wait()         // the subscriber attaches again and grants
		if got := q.Credit(); got != 4 {
			t.Fatalf("Credit() = %d after the reattach, want 4", got)
		}
		if err := stop(); err != nil {
			t.Fatal(err)
		}
		if got := q.Credit(); got != 0 {
			t.Fatalf("Credit() = %d after the stop, want 0", got)
		}
	})
}
