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

	"github.com/amqpsub/amqpsub/amqpsub"
	"github.com/amqpsub/amqpsub/amqpsubtest"
	"github.com/amqpsub/amqpsub/internal/driver/servicebus"
	"github.com/amqpsub/amqpsub/internal/shapes"
)

// The queue under WithProfile(amqpsub.AzureServiceBus), run by real
// subscribers in synctest bubbles: minutes of locks take no time.

func serviceBus(opts ...amqpsubtest.Option) *amqpsubtest.Queue {
	return amqpsubtest.NewQueue(append([]amqpsubtest.Option{amqpsubtest.WithProfile(amqpsub.AzureServiceBus)}, opts...)...)
}

// drainHour is drain with an hour of the bubble's time: locks take
// minutes.
func drainHour(t *testing.T, q *amqpsubtest.Queue, sub *amqpsub.Subscriber) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), time.Hour)
	defer cancel()
	if err := q.Drain(ctx, sub); err != nil {
		t.Fatal(err)
	}
}

// events collects a subscriber's events of one kind.
type events struct {
	mu   sync.Mutex
	got  []amqpsub.Event
	kind amqpsub.EventKind
}

func (e *events) on(ev amqpsub.Event) {
	if ev.Kind != e.kind {
		return
	}
	e.mu.Lock()
	e.got = append(e.got, ev)
	e.mu.Unlock()
}

func (e *events) list() []amqpsub.Event {
	e.mu.Lock()
	defer e.mu.Unlock()
	return append([]amqpsub.Event(nil), e.got...)
}

// renewals sums the lock renewals the queue granted.
func renewals(rs []amqpsubtest.Record) int {
	n := 0
	for _, r := range rs {
		for _, d := range r.Deliveries {
			n += d.Renewals
		}
	}
	return n
}

// slow is a handler that works for d unless its ctx ends first; it records
// each call's delivery count and, when cut short, its ctx's cause.
type slow struct {
	d      time.Duration
	mu     sync.Mutex
	counts []uint32
	causes []error
}

func (s *slow) handle(ctx context.Context, d *amqpsub.Delivery) error {
	s.mu.Lock()
	s.counts = append(s.counts, d.DeliveryCount())
	first := len(s.counts) == 1
	s.mu.Unlock()
	if !first {
		return nil // a redelivery is quick
	}
	t := time.NewTimer(s.d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		s.mu.Lock()
		s.causes = append(s.causes, context.Cause(ctx))
		s.mu.Unlock()
		return ctx.Err()
	}
}

// A handler of 3 minutes on a 60 s lock, within the default MaxLockRenewal
// (5 min): the lock is renewed as it goes, the message completed once.
func TestServiceBusLockRenewedWhileTheHandlerRuns(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		q := serviceBus()
		q.Publish(amqpsubtest.Message("", "slow"))
		h := &slow{d: 3 * time.Minute}
		began := time.Now()
		sub := newSub(t, q, h.handle)
		drainHour(t, q, sub)
		if took := time.Since(began); took != 3*time.Minute {
			t.Fatalf("drained after %v", took)
		}
		rs := q.Records()
		if got := history(rs); got != "#0: 0 accepted → consumed\n" {
			t.Fatal(got)
		}
		// Every 30 s (half of what the lock had left): 5 renewals before
		// the handler returned at 3 min, and maybe a 6th at that instant.
		d := rs[0].Deliveries[0]
		st := sub.Stats()
		if d.Renewals < 5 || d.Renewals > 6 || st.Locks.Renewed != uint64(d.Renewals) {
			t.Fatalf("queue renewed %d locks, subscriber %d: %+v", d.Renewals, st.Locks.Renewed, st.Locks)
		}
		if st.Locks.Lost != 0 || st.Locks.Skipped != 0 || st.Locks.LostAtSettle != 0 || st.Settled.Accepted != 1 {
			t.Fatal(st)
		}
		if want := began.Add(time.Minute + time.Duration(d.Renewals)*30*time.Second); !d.LockedUntil.Equal(want) {
			t.Fatalf("locked until %v, want %v", d.LockedUntil, want)
		}
	})
}

// The same handler with MaxLockRenewal(90s): the lock is renewed until
// 90 s after the handler began, then expires at 120 s; the handler's ctx
// is cancelled with ErrLockLost, its settlement is not sent, and the
// message comes back with delivery count 1.
func TestServiceBusLockLostPastMaxLockRenewal(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		q := serviceBus()
		q.Publish(amqpsubtest.Message("", "slow"))
		h := &slow{d: 3 * time.Minute}
		lost := &events{kind: amqpsub.EventLockLost}
		began := time.Now()
		sub := newSub(t, q, h.handle, amqpsub.MaxLockRenewal(90*time.Second), amqpsub.OnEvent(lost.on))
		drainHour(t, q, sub)
		if took := time.Since(began); took != 2*time.Minute {
			t.Fatalf("drained after %v", took)
		}
		rs := q.Records()
		if got := history(rs); got != "#0: 0 lock expired, 1 accepted → consumed\n" {
			t.Fatal(got)
		}
		d := rs[0].Deliveries[0]
		if d.Renewals != 2 || !d.LockedUntil.Equal(began.Add(2*time.Minute)) || d.Late != amqpsubtest.Pending {
			t.Fatalf("the expired delivery: %+v", d)
		}
		if len(h.causes) != 1 || !errors.Is(h.causes[0], amqpsub.ErrLockLost) || len(h.counts) != 2 || h.counts[1] != 1 {
			t.Fatalf("handler saw counts %v, causes %v", h.counts, h.causes)
		}
		st := sub.Stats()
		if st.Locks.Renewed != uint64(renewals(rs)) || st.Locks.Lost != 1 || st.Locks.Skipped != 1 ||
			st.Locks.LostAtSettle != 0 || st.Settled.Accepted != 1 {
			t.Fatalf("%+v", st.Locks)
		}
		if ev := lost.list(); len(ev) != 1 || !errors.Is(ev[0].Err, amqpsub.ErrLockLost) {
			t.Fatalf("lock-lost events %v", ev)
		}
	})
}

func TestServiceBusOutcomes(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		q := serviceBus()
		for _, b := range []string{"accept", "release once", "retry once", "reject with"} {
			q.Publish(amqpsubtest.Message("", b))
		}
		var c calls
		sub := newSub(t, q, func(_ context.Context, d *amqpsub.Delivery) error {
			b := text(d)
			first := c.add(b) == 1
			switch {
			case b == "release once" && first:
				return amqpsub.Release()
			case b == "retry once" && first:
				return errors.New("store down")
			case b == "reject with":
				return amqpsub.RejectWith("bad total", "total is -3")
			}
			return nil
		})
		drain(t, q, sub)
		// An abandon (modified) counts; a release does not.
		want := `#0: 0 accepted → consumed
#1: 0 released, 0 accepted → consumed
#2: 0 modified, 1 accepted → consumed
#3: 0 rejected "bad total" → dead-lettered
`
		if got := history(q.Records()); got != want {
			t.Fatalf("history:\n%swant:\n%s", got, want)
		}
		dl := q.DeadLetters()
		e := dl[0].Deliveries[0].Error
		if len(dl) != 1 || dl[0].Reason() != "bad total" || dl[0].Description() != "total is -3" ||
			e.Condition != amqpsub.ErrCondDeadLetter || e.Info["DeadLetterReason"] != "bad total" {
			t.Fatalf("dead letters %v, error %+v", dl, e)
		}
		if st := sub.Stats(); st.Settled.Modified != 1 || st.Settled.Released != 1 || st.Settled.Rejected != 1 || st.Locks.Lost != 0 {
			t.Fatal(st)
		}
	})
}

// Abandons and expired locks both count towards the entity's
// MaxDeliveryCount; past it the service dead-letters the message with
// MaxDeliveryCountExceeded.
func TestServiceBusMaxDeliveryCountExceeded(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		q := serviceBus(amqpsubtest.MaxDeliveryAttempts(3), amqpsubtest.LockDuration(30*time.Second))
		q.Publish(amqpsubtest.Message("", "retry"), amqpsubtest.Message("", "hang"))
		sub := newSub(t, q, func(ctx context.Context, d *amqpsub.Delivery) error {
			if text(d) == "retry" {
				return errors.New("always")
			}
			<-ctx.Done() // until the lock is lost
			return ctx.Err()
		}, amqpsub.MaxLockRenewal(0), amqpsub.Workers(2))
		drainHour(t, q, sub)
		want := `#0: 0 modified, 1 modified, 2 modified → dead-lettered (MaxDeliveryCountExceeded)
#1: 0 lock expired, 1 lock expired, 2 lock expired → dead-lettered (MaxDeliveryCountExceeded)
`
		if got := history(q.Records()); got != want {
			t.Fatalf("history:\n%swant:\n%s", got, want)
		}
		for _, r := range q.DeadLetters() {
			if r.Reason() != "MaxDeliveryCountExceeded" ||
				r.Description() != "Message could not be consumed after 3 delivery attempts." {
				t.Fatalf("dead letter %v: %q, %q", r, r.Reason(), r.Description())
			}
		}
		if st := sub.Stats(); st.Locks.Lost != 3 || st.Locks.Skipped != 3 {
			t.Fatalf("%+v", st.Locks)
		}
	})
}

// What each delivery carries, as Service Bus sends it.
func TestServiceBusDeliveryCarriesItsLock(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		q := serviceBus(amqpsubtest.LockDuration(45 * time.Second))
		published := time.Now()
		m := amqpsubtest.Message("g", "x")
		m.Annotations = amqp.Annotations{"x-opt-custom": "kept"}
		q.Publish(amqpsubtest.Message("", "first"), m)
		time.Sleep(time.Second)
		type seen struct {
			token  amqp.UUID
			until  time.Time
			seq    any
			enq    any
			custom any
		}
		var got []seen
		sub := newSub(t, q, func(_ context.Context, d *amqpsub.Delivery) error {
			msg := d.Message()
			tok, ok := servicebus.LockToken(msg.DeliveryTag)
			until, okUntil := servicebus.LockedUntil(msg)
			if !ok || !okUntil {
				t.Errorf("delivery without a lock: tag %x, annotations %v", msg.DeliveryTag, msg.Annotations)
			}
			seq, _ := d.Annotation("x-opt-sequence-number")
			enq, _ := d.Annotation("x-opt-enqueued-time")
			custom, _ := d.Annotation("x-opt-custom")
			got = append(got, seen{tok, until, seq, enq, custom})
			return nil
		}, amqpsub.Workers(1))
		drain(t, q, sub)
		if len(got) != 2 || got[0].token == got[1].token {
			t.Fatalf("deliveries %+v", got)
		}
		for i, g := range got {
			if !g.until.Equal(published.Add(time.Second+45*time.Second)) || g.seq != int64(i+1) || g.enq != published.UTC() {
				t.Errorf("delivery %d: %+v", i, g)
			}
		}
		if got[1].custom != "kept" || m.Annotations["x-opt-locked-until"] != nil || m.DeliveryTag != nil {
			t.Fatalf("the published message was changed, or its annotations lost: %+v, %v", got[1], m.Annotations)
		}
	})
}

// The queue's Connector stands in for amqpsub.ServiceBus's: the subscriber
// takes the AzureServiceBus profile, and New refuses what the queue cannot
// play.
func TestServiceBusConnectorChoosesTheProfile(t *testing.T) {
	q := serviceBus()
	h := amqpsub.HandlerFunc(func(context.Context, *amqpsub.Delivery) error { return nil })
	for name, opts := range map[string][]amqpsub.Option{
		"another profile": {amqpsub.WithProfile(amqpsub.Artemis)},
		"sessions":        {amqpsub.Sessions(2)},
		"session ids":     {amqpsub.SessionIDs("a")},
	} {
		if _, err := amqpsub.New(q.Connector(), "orders", h, opts...); !errors.Is(err, amqpsub.ErrInvalidOption) {
			t.Errorf("%s: New = %v", name, err)
		}
	}
	synctest.Test(t, func(t *testing.T) {
		q := serviceBus()
		q.Publish(amqpsubtest.Message("", "x"))
		// No WithProfile: Retry abandons (modified), as on Service Bus,
		// not modified{delivery-failed} as on Artemis.
		n := 0
		drain(t, q, newSub(t, q, func(context.Context, *amqpsub.Delivery) error {
			if n++; n == 1 {
				return errors.New("once")
			}
			return nil
		}))
		if got := q.Records()[0].String(); got != "#0: 0 modified, 1 accepted → consumed" {
			t.Fatal(got)
		}
	})
}

func TestLockDurationNeedsServiceBus(t *testing.T) {
	for name, opts := range map[string][]amqpsubtest.Option{
		"artemis": {amqpsubtest.LockDuration(time.Second)},
		"zero":    {amqpsubtest.WithProfile(amqpsub.AzureServiceBus), amqpsubtest.LockDuration(0)},
	} {
		func() {
			defer func() {
				if recover() == nil {
					t.Errorf("%s: NewQueue did not panic", name)
				}
			}()
			amqpsubtest.NewQueue(opts...)
		}()
	}
}

// The options run on the Service Bus queue as on the others: lanes by key,
// batches and LocalRetry, with slow batches and long retry waits; every
// lock held, waiting or in a handler, is renewed, and the service sees
// each message once.
func TestServiceBusBatchesLanesAndLocalRetry(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		q := serviceBus(amqpsubtest.LockDuration(30 * time.Second))
		publishGroups(q, 4, 6)
		var mu sync.Mutex
		var done []string
		var c calls
		sub, err := amqpsub.NewBatch(q.Connector(), "orders", amqpsub.BatchHandlerFunc(func(_ context.Context, b []*amqpsub.Delivery) []error {
			time.Sleep(40 * time.Second) // longer than a lock
			results := make([]error, len(b))
			failed := map[string]bool{}
			for i, d := range b {
				body := text(d)
				g, n := seq(body)
				switch {
				case failed[g]:
					results[i] = errors.New("an earlier delivery of the group failed")
				case n == 2 && c.add(body) == 1:
					results[i] = errors.New("store down")
					failed[g] = true
				default:
					mu.Lock()
					done = append(done, body)
					mu.Unlock()
				}
			}
			return results
		}), amqpsub.Batch(3, time.Second), amqpsub.WorkersByKey(2), amqpsub.Credit(8),
			amqpsub.LocalRetry(amqpsub.RetryPolicy{Attempts: 3, Initial: 45 * time.Second}))
		if err != nil {
			t.Fatal(err)
		}
		drainHour(t, q, sub)
		if err := amqpsubtest.GroupOrder(done, seq); err != nil {
			t.Fatal(err)
		}
		rs := q.Records()
		for _, r := range rs {
			if len(r.Deliveries) != 1 || r.State != amqpsubtest.Consumed {
				t.Fatal(history(rs))
			}
		}
		st := sub.Stats()
		if len(done) != 24 || st.Locks.Lost != 0 || st.Results.LocalRetries == 0 ||
			st.Locks.Renewed == 0 || st.Locks.Renewed != uint64(renewals(rs)) {
			t.Fatalf("%d effects; %+v; %+v", len(done), st.Locks, st.Results)
		}
	})
}

// A graceful stop under Service Bus: the handler in progress finishes and
// completes, the buffered deliveries are released, not counted.
func TestServiceBusStopReleasesBufferedUncounted(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		q := serviceBus()
		for i := range 4 {
			q.Publish(amqpsubtest.Message("", fmt.Sprint(i)))
		}
		stop := start(newSub(t, q, func(context.Context, *amqpsub.Delivery) error {
			time.Sleep(10 * time.Second)
			return nil
		}))
		synctest.Wait()
		if err := stop(); err != nil {
			t.Fatal(err)
		}
		// The stop drains the link's credit while it releases, so a
		// released delivery may come back once or twice before the drain,
		// as on Service Bus.
		rs := q.Records()
		t.Logf("after the stop:\n%s", history(rs))
		if rs[0].String() != "#0: 0 accepted → consumed" {
			t.Fatal(history(rs))
		}
		for _, r := range rs[1:] {
			for _, d := range r.Deliveries {
				if r.State != amqpsubtest.Queued || d.Count != 0 || d.Outcome != amqpsubtest.Released {
					t.Fatal(history(rs))
				}
			}
		}
		// Delivered again with count 0.
		drain(t, q, newSub(t, q, func(_ context.Context, d *amqpsub.Delivery) error {
			if d.DeliveryCount() != 0 {
				t.Errorf("%s: count %d", text(d), d.DeliveryCount())
			}
			return nil
		}))
	})
}

// A lost link costs no finished work on Service Bus: 400 messages over 40
// groups, 8 lanes, 50 ms handlers, the link lost 3 times mid-run. What a
// lost link held stays locked; the subscriber keeps it, renews it and
// settles it through the ended link (the stand-in for settling by lock
// token), so no message is handled twice and every
// group keeps its order.
func TestServiceBusLostLinksLoseNoFinishedWork(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		q := serviceBus(amqpsubtest.LockDuration(5 * time.Second))
		publishGroups(q, 40, 10)
		var mu sync.Mutex
		handled := map[string]int{}
		last := map[string]int{}
		twice, outOfOrder, n := 0, 0, 0
		sub := newSub(t, q, func(ctx context.Context, d *amqpsub.Delivery) error {
			time.Sleep(50 * time.Millisecond)
			body := text(d)
			g, i := seq(body)
			mu.Lock()
			defer mu.Unlock()
			handled[body]++
			if handled[body] > 1 {
				twice++
			}
			if prev, ok := last[g]; ok && i < prev {
				outOfOrder++
			}
			last[g] = i
			if n++; n == 100 || n == 200 || n == 300 {
				go q.LoseLinks(nil) // the service detaches the link
			}
			return nil
		}, amqpsub.WorkersByKey(8), amqpsub.Backoff(10*time.Millisecond, 10*time.Millisecond))
		drainHour(t, q, sub)
		st := sub.Stats()
		t.Logf("handled %d messages, %d twice, %d out of order; stats %v", len(handled), twice, outOfOrder, st)
		if st.LinksLost != 3 {
			t.Fatalf("links lost %d, want 3", st.LinksLost)
		}
		if len(handled) != 400 || twice != 0 || outOfOrder != 0 {
			t.Fatalf("handled %d, %d twice, %d out of order; want 400, 0, 0", len(handled), twice, outOfOrder)
		}
		if a := len(q.Accepted()); a != 400 {
			t.Fatalf("%d accepted, want 400", a)
		}
	})
}

// A handler still running when its link is lost is not cut short: its
// lock goes on being renewed from the next link, well past the lock
// duration, and its result is settled.
func TestServiceBusHandlerOutlivesItsLink(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		q := serviceBus(amqpsubtest.LockDuration(5 * time.Second))
		q.Publish(amqpsubtest.Message("", "slow"))
		started := make(chan struct{})
		var cut error
		sub := newSub(t, q, func(ctx context.Context, d *amqpsub.Delivery) error {
			close(started)
			select {
			case <-time.After(30 * time.Second): // six lock durations
			case <-ctx.Done():
				cut = context.Cause(ctx)
			}
			return nil
		})
		stop := start(sub)
		<-started
		q.LoseLinks(nil)
		ctx, cancel := context.WithTimeout(t.Context(), time.Hour)
		defer cancel()
		if err := q.Wait(ctx); err != nil {
			t.Fatal(err)
		}
		if err := stop(); err != nil {
			t.Fatal(err)
		}
		rs := q.Records()
		t.Logf("%s; renewals %d; stats %v", rs[0], renewals(rs), sub.Stats())
		if cut != nil {
			t.Fatalf("the handler was cut short: %v", cut)
		}
		if got := rs[0].String(); got != "#0: 0 accepted → consumed" || renewals(rs) < 6 {
			t.Fatalf("%s with %d renewals: want one delivery, accepted, renewed at least 6 times", got, renewals(rs))
		}
	})
}

// Stats().Settled counts what the queue took, in every lane mode: a
// release decided while its link was up goes out as released; one whose
// link was lost meanwhile goes by lock token, where there is no release,
// as an abandon (modified, counted), and is counted and reported
// (OnSettled, the Recorder) as modified. Each message is released once, then accepted;
// the links are lost every 25 handler calls.
func TestServiceBusStatsCountWhatTheQueueTook(t *testing.T) {
	var p shapes.Profile
	for _, sp := range shapes.Profiles() {
		if sp.Name == "servicebus" {
			p = sp
		}
	}
	for _, l := range shapes.Lanes() {
		t.Run(l.Name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				q := amqpsubtest.NewQueue(append(p.QueueOptions, amqpsubtest.LockDuration(30*time.Second))...)
				for i := range 200 {
					q.Publish(amqpsubtest.Message(fmt.Sprintf("g%d", i%8), fmt.Sprintf("%0*d", shapes.BodySize, i)))
				}
				var mu sync.Mutex
				calls := 0
				seen := map[string]bool{}
				heard := map[amqpsub.Outcome]uint64{}
				rec := &settledRecorder{took: map[amqpsub.Outcome]uint64{}}
				sub := shapeSub(t, q, p, l, func() time.Duration { return 20 * time.Millisecond }, func(_ context.Context, d *amqpsub.Delivery) error {
					d.OnSettled(func(o amqpsub.Outcome, err error) {
						if err == nil {
							mu.Lock()
							heard[o]++
							mu.Unlock()
						}
					})
					mu.Lock()
					calls++
					if calls%25 == 0 {
						go q.LoseLinks(nil)
					}
					again := seen[text(d)]
					seen[text(d)] = true
					mu.Unlock()
					if !again {
						return amqpsub.Release()
					}
					return nil
				}, amqpsub.Backoff(time.Millisecond, 5*time.Millisecond), amqpsub.WithMetrics(rec))
				drainHour(t, q, sub)
				var took amqpsub.Settlements
				for _, r := range q.Records() {
					for _, d := range r.Deliveries {
						switch d.Outcome {
						case amqpsubtest.Accepted:
							took.Accepted++
						case amqpsubtest.Released:
							took.Released++
						case amqpsubtest.Modified:
							took.Modified++
						case amqpsubtest.Rejected:
							took.Rejected++
						}
					}
				}
				st := sub.Stats()
				t.Logf("the queue took %+v; Stats %+v; OnSettled heard %v; links lost %d", took, st.Settled, heard, st.LinksLost)
				if st.LinksLost == 0 || took.Modified == 0 || took.Released == 0 {
					t.Fatalf("links lost %d, the queue took %d modified, %d released: want each > 0 for the test to mean anything",
						st.LinksLost, took.Modified, took.Released)
				}
				if st.Settled != took {
					t.Errorf("Stats().Settled = %+v, the queue took %+v", st.Settled, took)
				}
				mu.Lock()
				defer mu.Unlock()
				if heard[amqpsub.OutcomeReleased] != took.Released || heard[amqpsub.OutcomeModified] != took.Modified ||
					heard[amqpsub.OutcomeAccepted] != took.Accepted {
					t.Errorf("OnSettled heard %v, the queue took %+v", heard, took)
				}
				rec.mu.Lock()
				defer rec.mu.Unlock()
				if rec.took[amqpsub.OutcomeReleased] != took.Released || rec.took[amqpsub.OutcomeModified] != took.Modified {
					t.Errorf("the Recorder heard %v, the queue took %+v", rec.took, took)
				}
			})
		})
	}
}

// settledRecorder is a Recorder (and its Metrics) that counts the
// settlements the broker took, by outcome.
type settledRecorder struct {
	mu   sync.Mutex
	took map[amqpsub.Outcome]uint64
}

func (r *settledRecorder) Recorder(amqpsub.MetricsInfo) amqpsub.Recorder { return r }
func (r *settledRecorder) Received()                                     {}
func (r *settledRecorder) Handled(amqpsub.HandlerCall)                   {}
func (r *settledRecorder) Dropped(int)                                   {}
func (r *settledRecorder) Event(amqpsub.Event)                           {}
func (r *settledRecorder) LocksRenewed(int)                              {}

func (r *settledRecorder) Settled(o amqpsub.Outcome, err error) {
	if err == nil {
		r.mu.Lock()
		r.took[o]++
		r.mu.Unlock()
	}
}

// IssueCredit fails every 20 ms, as go-amqp's does while a drain is
// pending: the pump gives each link up with deliveries its receive loop
// had received and the pump had not yet seen. Service Bus keeps their
// locks (the queue too), so they go to the handlers like the rest of what
// the link brought, and are settled through the ended link (the stand-in
// for settling by lock token): none is dropped to come back at lock
// expiry, counted, after later messages of its group. Over every lane
// mode.
func TestServiceBusRefusedCreditDropsNothingUnseen(t *testing.T) {
	for _, l := range shapes.Lanes() {
		t.Run(l.Name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				q := serviceBus(amqpsubtest.LockDuration(5 * time.Second))
				const groups, each = 20, 20
				publishGroups(q, groups, each)
				var mu sync.Mutex
				handled := map[string]int{}
				var order []string
				failed := map[string]bool{}
				sub := shapeSub(t, q, shapes.Profile{}, l, func() time.Duration { return 5 * time.Millisecond },
					func(_ context.Context, d *amqpsub.Delivery) error {
						body := text(d)
						mu.Lock()
						defer mu.Unlock()
						if l.Retries() && !failed[body] && strings.HasSuffix(body, "/3") {
							failed[body] = true
							return errors.New("first attempt fails")
						}
						handled[body]++
						order = append(order, body)
						return nil
					}, amqpsub.Backoff(time.Millisecond, time.Millisecond))
				stop := start(sub)
				ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
				defer cancel()
				drained := make(chan error, 1)
				go func() { drained <- q.Wait(ctx) }()
				refusals := 0
				for done := false; !done; {
					select {
					case err := <-drained:
						if err != nil {
							t.Fatal(err)
						}
						done = true
					case <-time.After(20 * time.Millisecond):
						q.FailIssueCredit(1)
						refusals++
					}
				}
				q.FailIssueCredit(0)
				if err := stop(); err != nil && !errors.Is(err, context.Canceled) {
					t.Fatal(err)
				}
				st := sub.Stats()
				mu.Lock()
				defer mu.Unlock()
				redelivered := 0
				for _, r := range q.Records() {
					if len(r.Deliveries) > 1 {
						redelivered++
					}
				}
				t.Logf("%d refusals; links lost %d; dropped %d; redelivered %d; stats %v", refusals, st.LinksLost, st.Dropped, redelivered, st)
				if st.LinksLost < 5 {
					t.Fatalf("links lost %d: the refusals did not end links", st.LinksLost)
				}
				if st.Dropped != 0 || redelivered != 0 {
					t.Fatalf("dropped %d, redelivered %d: want 0, 0", st.Dropped, redelivered)
				}
				if len(handled) != groups*each {
					t.Fatalf("handled %d distinct, want %d", len(handled), groups*each)
				}
				for b, n := range handled {
					if n != 1 {
						t.Fatalf("%s handled %d times", b, n)
					}
				}
				if l.Ordered() {
					if err := amqpsubtest.GroupOrder(order, seq); err != nil {
						t.Fatal(err)
					}
				}
			})
		})
	}
}
