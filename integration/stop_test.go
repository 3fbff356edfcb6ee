package integration

import (
	"context"
	"fmt"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/amqpsub/amqpsub/amqpsub"
)

// Graceful stops: what a stop hands back to the broker, and what repeated
// stops (deploys) cost.

// stopRound is what repeated graceful stops of a slow consumer did.
type stopRound struct {
	handled, distinct, released, deadUnseen, dead, left int
}

// repeatedStops runs a slow consumer (100 ms handlers, Workers(1)) over n
// messages of queue q (addressed as addr), stopping it gracefully after
// every few handled, as a deploy would, stops times; then it counts what
// the dead-letter queue holds, and which of those no handler saw.
func repeatedStops(t *testing.T, tg target, q, addr string, n, stops int, opts ...amqpsub.Option) stopRound {
	r, _ := stopRounds(t, tg, q, addr, stopPlan{
		msgs: uniqueSeqs(n, 0), stops: stops, every: 3,
		opts: append([]amqpsub.Option{amqpsub.Workers(1), amqpsub.GracePeriod(4 * time.Second)}, opts...),
	})
	return r
}

// stopPlan is what stopRounds does: publish msgs, then stops times run a
// subscriber with opts (all of them: the target's profile is not added)
// and 100 ms handlers until every more are handled, and stop it
// gracefully.
type stopPlan struct {
	msgs         []msgSpec
	stops, every int
	opts         []amqpsub.Option
}

// stopAt is one stop of stopRounds: what the subscriber held and its
// credit just before it, and what the stop released.
type stopAt struct {
	held, credit, parked, released int
}

// stopRounds carries out plan on queue q (addressed as addr), then counts
// what the queue and its dead-letter queue hold, and which of the dead
// letters no handler saw.
func stopRounds(t *testing.T, tg target, q, addr string, plan stopPlan) (stopRound, []stopAt) {
	conn := dial(t, tg.url)
	tg.publish(t, conn, q, plan.msgs)
	var mu sync.Mutex
	seen := map[int]bool{}
	var r stopRound
	var each []stopAt
	for i := range plan.stops {
		var handled atomic.Int64
		s, err := amqpsub.New(amqpsub.Dial(tg.url, nil), addr, amqpsub.HandlerFunc(func(ctx context.Context, d *amqpsub.Delivery) error {
			time.Sleep(100 * time.Millisecond)
			mu.Lock()
			seen[seqOf(d)] = true
			mu.Unlock()
			handled.Add(1)
			return nil
		}), append(slices.Clone(plan.opts), amqpsub.Logger(logger(t)))...)
		if err != nil {
			t.Fatal(err)
		}
		stop, wait := runSub(t, s)
		waitFor(t, 30*time.Second, fmt.Sprintf("round %d: %d handled", i, plan.every), func() bool { return handled.Load() >= int64(plan.every) })
		before := s.Stats()
		stop()
		if err := wait(); err != nil {
			t.Fatalf("round %d: Run = %v", i, err)
		}
		st := s.Stats()
		r.handled += int(handled.Load())
		r.released += int(st.Settled.Released)
		each = append(each, stopAt{held: before.Held, credit: before.Credit, parked: before.Parked, released: int(st.Settled.Released)})
	}
	r.left = len(drainAddress(t, conn, tg.address(q)))
	dead := drainAddress(t, conn, tg.deadLetterAddress(q))
	r.dead = len(dead)
	for _, m := range dead {
		v, _ := m.ApplicationProperties["seq"].(int64)
		if !seen[int(v)] {
			r.deadUnseen++
		}
	}
	r.distinct = len(seen)
	return r, each
}

// Deploys stop the consumer again and again. On a quorum queue every
// release counts toward the delivery-limit (20 by default), and returns go
// back to the head of the queue, so a stop that releases what is buffered
// has the same messages released at every stop until the queue
// dead-letters them, unseen. Under RabbitMQ4 a stop finishes what is
// buffered first: 20 graceful stops of a slow consumer (100 ms handlers,
// Workers(1)) release nothing and dead-letter nothing.
func TestRabbitMQ4StopsDeadLetterNothingUnseen(t *testing.T) {
	tg := newTarget(t, onRabbitMQ4Quorum)
	const n, stops = 400, 20
	q := tg.queue(t)
	r := repeatedStops(t, tg, q, q, n, stops, tg.opts...)
	t.Logf("%d stops, RabbitMQ4, adaptive credit: %+v", stops, r)
	if r.released != 0 || r.dead != 0 || r.deadUnseen != 0 {
		t.Fatalf("%d stops released %d and dead-lettered %d (%d unseen); want 0", stops, r.released, r.dead, r.deadUnseen)
	}
	if r.distinct+r.left != n+1 { // publishFast's barrier too
		t.Fatalf("%d handled + %d left != %d published", r.distinct, r.left, n+1)
	}
}

// What repeated stops cost on a quorum queue otherwise: releasing at once
// (what every profile did before RabbitMQ4, here Generic), with the
// adaptive credit and with a fixed one of 256, and RabbitMQ4 with a fixed
// credit, whose finishing runs out at half the grace period. 22 stops, as
// in the report that found it. A measurement (docs/performance.md): only
// with AMQPSUB_CREDIT=1 (make credit); it asserts that the counts add up.
func TestRabbitMQ4StopCost(t *testing.T) {
	if os.Getenv("AMQPSUB_CREDIT") == "" {
		t.Skip("a measurement: AMQPSUB_CREDIT=1 (make credit) runs it")
	}
	tg := newTarget(t, onRabbitMQ4Quorum)
	const n, stops = 1000, 22
	for _, tc := range []struct {
		name string
		opts []amqpsub.Option
	}{
		{"release at once, adaptive credit", []amqpsub.Option{amqpsub.WithProfile(amqpsub.Generic)}},
		{"release at once, FixedCredit", []amqpsub.Option{amqpsub.WithProfile(amqpsub.Generic), amqpsub.FixedCredit()}},
		{"RabbitMQ4, FixedCredit", []amqpsub.Option{amqpsub.WithProfile(amqpsub.RabbitMQ4), amqpsub.FixedCredit()}},
		{"RabbitMQ4, adaptive credit", []amqpsub.Option{amqpsub.WithProfile(amqpsub.RabbitMQ4)}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			q := tg.queue(t)
			// Generic sends the name as it is; RabbitMQ4 passes a
			// /queues/ address through.
			r := repeatedStops(t, tg, q, tg.address(q), n, stops, tc.opts...)
			t.Logf("%d stops, %s: %+v", stops, tc.name, r)
			// Every message is handled, left, or dead-lettered unseen.
			if r.distinct+r.left+r.deadUnseen != n+1 || r.dead < r.deadUnseen {
				t.Fatalf("counts do not add up: %+v", r)
			}
		})
	}
}

// What a graceful stop releases with lanes: 2,000 messages over 40
// groups, 4 lanes of 100 ms handlers, GracePeriod(2s), the RabbitMQ4
// profile and the adaptive credit, stopped 8 times, each time once 40
// more are handled (about a second), under WorkersByKey(4) (hash lanes
// and BalanceKeys) and Workers(4). Each release is a return counted
// toward the quorum queue's delivery-limit. A measurement
// (docs/performance.md): only with AMQPSUB_CREDIT=1 (make credit); it
// asserts that the counts add up.
func TestRabbitMQ4StopCostLanes(t *testing.T) {
	if os.Getenv("AMQPSUB_CREDIT") == "" {
		t.Skip("a measurement: AMQPSUB_CREDIT=1 (make credit) runs it")
	}
	tg := newTarget(t, onRabbitMQ4Quorum)
	const n, stops = 2000, 8
	base := []amqpsub.Option{amqpsub.WithProfile(amqpsub.RabbitMQ4), amqpsub.GracePeriod(2 * time.Second)}
	for _, tc := range []struct {
		name string
		opts []amqpsub.Option
	}{
		{"WorkersByKey(4)", []amqpsub.Option{amqpsub.WorkersByKey(4)}},
		{"WorkersByKey(4), BalanceKeys", []amqpsub.Option{amqpsub.WorkersByKey(4), amqpsub.BalanceKeys()}},
		{"Workers(4)", []amqpsub.Option{amqpsub.Workers(4)}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			q := tg.queue(t)
			r, each := stopRounds(t, tg, q, tg.address(q), stopPlan{
				msgs: uniqueSeqs(n, 40), stops: stops, every: 40, opts: append(slices.Clone(base), tc.opts...),
			})
			var rel, at []string
			for _, e := range each {
				rel = append(rel, fmt.Sprint(e.released))
				at = append(at, fmt.Sprintf("held %d credit %d parked %d", e.held, e.credit, e.parked))
			}
			t.Logf("%d stops, %s: released per stop %s; before each stop: %s; %+v", stops, tc.name, strings.Join(rel, ", "), strings.Join(at, "; "), r)
			if r.distinct+r.left+r.deadUnseen != n+1 || r.dead < r.deadUnseen {
				t.Fatalf("counts do not add up: %+v", r)
			}
		})
	}
}

// Cancel while 200 deliveries are buffered and 8 in progress: the buffered
// reach a second consumer within 1 s, the in-progress are settled, nothing is
// lost. (RabbitMQ 4's profile finishes what is buffered instead: see
// TestRabbitMQ4StopsDeadLetterNothingUnseen.)
func TestArtemisStopHandsBufferedToAnotherConsumer(t *testing.T) {
	stopHandsBufferedToAnotherConsumer(t, newTarget(t, onArtemis))
}

// The same stop on RabbitMQ 3.10, where a drain requeues what the link
// holds unsettled: the stop must not drain, or the second consumer gets
// the 8 in handlers too.
func TestRabbitMQStopHandsBufferedToAnotherConsumer(t *testing.T) {
	stopHandsBufferedToAnotherConsumer(t, newTarget(t, onRabbitMQ3))
}

func stopHandsBufferedToAnotherConsumer(t *testing.T, tg target) {
	const buffered, inProgress = 200, 8
	msgs := make([]msgSpec, buffered+inProgress)
	for i := range msgs {
		msgs[i] = msgSpec{seq: i}
	}
	q, conn := tg.filled(t, msgs)
	release := make(chan struct{})
	var mu sync.Mutex
	firstDone := map[int]bool{}
	s := tg.subscriber(t, q, amqpsub.HandlerFunc(func(ctx context.Context, d *amqpsub.Delivery) error {
		<-release
		mu.Lock()
		firstDone[seqOf(d)] = true
		mu.Unlock()
		return nil
	}), amqpsub.Credit(buffered+inProgress+1), amqpsub.FixedCredit(), amqpsub.Workers(inProgress))
	stop, wait := runSub(t, s)
	waitFor(t, 30*time.Second, "208 held", func() bool {
		st := s.Stats()
		return st.Handling == inProgress && st.Buffered >= buffered
	})
	second := rawReceiver(t, conn, tg.address(q), 500)
	start := time.Now()
	stop()
	got := receiveN(t, second, buffered+1, time.Second)
	elapsed := time.Since(start)
	close(release)
	if err := wait(); err != nil {
		t.Fatal(err)
	}
	// The barrier message (seq -1) was buffered too unless a worker holds it.
	secondSeqs := map[int]bool{}
	for _, m := range got {
		secondSeqs[int(m.ApplicationProperties["seq"].(int64))] = true
	}
	mu.Lock()
	defer mu.Unlock()
	t.Logf("second consumer got %d in %v; first settled %d", len(got), elapsed, len(firstDone))
	if len(got) != buffered+1 || len(firstDone) != inProgress {
		t.Fatalf("second got %d (want %d within 1 s), first handled %d (want %d)", len(got), buffered+1, len(firstDone), inProgress)
	}
	for seq := range firstDone {
		if secondSeqs[seq] {
			t.Fatalf("message %d handled by both", seq)
		}
	}
	for i := -1; i < buffered+inProgress; i++ {
		if !firstDone[i] && !secondSeqs[i] {
			t.Fatalf("message %d lost", i)
		}
	}
	if st := s.Stats(); st.Settled.Accepted != inProgress || st.Settled.Released != buffered+1 || st.Held != 0 {
		t.Fatalf("first consumer: %+v", st)
	}
	// The in-progress deliveries did not come back after being settled:
	// once the second consumer's acceptances land, the queue is empty.
	tg.assertDrained(t, conn, q)
}

// A stop with 200 deliveries buffered releases them at once, to a second
// consumer, uncounted (delivery count 0); the one in its handler is
// completed; the lease book is empty after.
func TestServiceBusStopReleasesBuffered(t *testing.T) {
	p := serviceBusPeer(t)
	q := p.entity(t, map[string]any{"lock_duration_ms": 10000})
	p.send(t, q, 300)
	in, finish := make(chan struct{}), make(chan struct{})
	var once sync.Once
	s, _ := amqpsub.New(sbConnector(t, p), q, amqpsub.HandlerFunc(func(ctx context.Context, d *amqpsub.Delivery) error {
		once.Do(func() { close(in) })
		<-finish
		return nil
	}), amqpsub.Credit(201), amqpsub.FixedCredit(), amqpsub.Logger(logger(t)))
	stop, wait := runSub(t, s)
	<-in
	waitFor(t, 10*time.Second, "201 held", func() bool { return s.Stats().Held == 201 })
	began := time.Now()
	stop()
	waitFor(t, 5*time.Second, "200 released", func() bool { return p.info(t, q).Stats["released"] >= 200 })
	released := time.Since(began)
	close(finish)
	if err := wait(); err != nil {
		t.Fatal(err)
	}
	st := s.Stats()
	t.Logf("released in %v; stats %v", released.Round(time.Millisecond), st)
	if released > time.Second || st.Held != 0 || st.Locks.Held != 0 || st.Settled.Released != 200 || st.Settled.Accepted != 1 {
		t.Fatalf("released after %v; stats %v", released, st)
	}
	var second, recounted atomic.Int32
	r, _ := amqpsub.New(sbConnector(t, p), q, amqpsub.HandlerFunc(func(_ context.Context, d *amqpsub.Delivery) error {
		second.Add(1)
		if d.DeliveryCount() != 0 {
			recounted.Add(1)
		}
		return nil
	}), amqpsub.Logger(logger(t)))
	stopR, waitR := runSub(t, r)
	waitFor(t, 30*time.Second, "the other 299 at the second consumer", func() bool { return second.Load() == 299 })
	stopR()
	if err := waitR(); err != nil {
		t.Fatal(err)
	}
	if recounted.Load() != 0 {
		t.Fatalf("%d released deliveries came back with a delivery count", recounted.Load())
	}
}
