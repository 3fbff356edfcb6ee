package integration

import (
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/amqpsub/amqpsub/amqpsub"
)

// orderChecker records, per group, the sequence numbers handled and where.
type orderChecker struct {
	mu         sync.Mutex
	next       map[string]int
	laneOf     map[string]int
	seen       map[string]map[int]int
	violations int
	dups       int
	handled    int
	// moves: a group may change lanes (BalanceKeys); then two of its
	// deliveries at once are what is checked.
	moves   bool
	running map[string]bool
}

func newOrderChecker() *orderChecker {
	return &orderChecker{next: map[string]int{}, laneOf: map[string]int{}, seen: map[string]map[int]int{}}
}

func (c *orderChecker) record(t testing.TB, d *amqpsub.Delivery) {
	g, seq := d.GroupID(), seqOf(d)
	c.mu.Lock()
	defer c.mu.Unlock()
	c.handled++
	if c.seen[g] == nil {
		c.seen[g] = map[int]int{}
	}
	c.seen[g][seq]++
	if c.seen[g][seq] > 1 {
		c.dups++
	}
	if seq != c.next[g] {
		c.violations++
	}
	c.next[g] = seq + 1
	if l, ok := c.laneOf[g]; ok && l != d.Lane() && !c.moves {
		t.Errorf("group %s on lanes %d and %d", g, l, d.Lane())
	}
	c.laneOf[g] = d.Lane()
}

// enter and leave bracket a handler call, for a checker that lets groups
// move between lanes: a group's deliveries must never run at once.
func (c *orderChecker) enter(t testing.TB, g string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.running == nil {
		c.running = map[string]bool{}
	}
	if c.running[g] {
		t.Errorf("group %s in two handlers at once", g)
	}
	c.running[g] = true
}

func (c *orderChecker) leave(g string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	delete(c.running, g)
}

func (c *orderChecker) count() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.handled
}

// pipelineRow is one run of the pipeline scenario: 10,000 messages over
// groups group-ids, WorkersByKey(8), random handler delays; every group is
// handled in publish order (one consumer: the queue's order), no group in
// two handlers at once, every message accepted exactly once, nothing left
// on the queue.
type pipelineRow struct {
	name     string // the subtest's
	target   string
	groups   int
	balanced bool // BalanceKeys: groups may move between lanes
	// check holds what this broker promises beyond the shared assertions.
	check func(t *testing.T, st amqpsub.Stats)
}

var pipelineRows = []pipelineRow{
	{name: "balanced=false", target: onArtemis, groups: 100},
	{name: "balanced=true", target: onArtemis, groups: 100, balanced: true},
	{name: "classic", target: onRabbitMQ4Classic, groups: 50, check: withinCredit},
	{name: "quorum", target: onRabbitMQ4Quorum, groups: 50, check: withinCredit},
	{name: "classic", target: onRabbitMQ3, groups: 50},
}

// withinCredit: the broker sent nothing past the credit, 256 at most.
func withinCredit(t *testing.T, st amqpsub.Stats) {
	if st.Overshoot != 0 || st.MaxHeld > 256 {
		t.Fatalf("overshoot %d, max held %d; want 0 and at most 256: %+v", st.Overshoot, st.MaxHeld, st)
	}
}

// pipeline runs the rows of pipelineRows whose target is among targets.
func pipeline(t *testing.T, targets ...string) {
	for _, r := range pipelineRows {
		if slices.Contains(targets, r.target) {
			t.Run(r.name, func(t *testing.T) { r.run(t, newTarget(t, r.target)) })
		}
	}
}

// The pipeline on Artemis, with hash lanes and with BalanceKeys.
func TestArtemisPerGroupOrder(t *testing.T) { pipeline(t, onArtemis) }

// The pipeline on a RabbitMQ 4 classic and quorum queue.
func TestRabbitMQ4Pipeline(t *testing.T) { pipeline(t, onRabbitMQ4Classic, onRabbitMQ4Quorum) }

// The pipeline on RabbitMQ 3.10, under its profile.
func TestRabbitMQPipeline(t *testing.T) { pipeline(t, onRabbitMQ3) }

func (r pipelineRow) run(t *testing.T, tg target) {
	q := tg.queue(t)
	conn := dial(t, tg.url)
	const n = 10000
	tg.publish(t, conn, q, groups(n, r.groups))

	check := newOrderChecker()
	check.moves = r.balanced
	s := tg.subscriber(t, q, amqpsub.HandlerFunc(func(ctx context.Context, d *amqpsub.Delivery) error {
		if seqOf(d) == -1 {
			return nil // the publisher's barrier
		}
		check.enter(t, d.GroupID())
		defer check.leave(d.GroupID())
		time.Sleep(time.Duration(rand.IntN(300)) * time.Microsecond)
		check.record(t, d)
		return nil
	}), amqpsub.WorkersByKey(8), placement(r.balanced))
	stop, wait := runSub(t, s)
	waitFor(t, 2*time.Minute, "10,000 deliveries", func() bool { return check.count() >= n })
	stop()
	if err := wait(); err != nil {
		t.Fatalf("Run = %v", err)
	}
	st := s.Stats()
	t.Logf("handled %d, violations %d, duplicates %d, stats %+v", check.count(), check.violations, check.dups, st)
	if check.violations != 0 || check.dups != 0 || check.count() != n {
		t.Fatalf("handled %d, %d order violations, %d duplicates", check.count(), check.violations, check.dups)
	}
	if st.Settled.Accepted != n+1 || st.Settled.Modified != 0 || st.Settled.Released != 0 {
		t.Fatalf("settlements: %+v", st)
	}
	for g, seqs := range check.seen {
		if len(seqs) != n/r.groups {
			t.Fatalf("group %s: %d distinct messages, want %d", g, len(seqs), n/r.groups)
		}
	}
	if r.check != nil {
		r.check(t, st)
	}
	tg.assertDrained(t, conn, q)
}

// Messages without a group-id spread over all lanes: they rotate.
// placement returns BalanceKeys when balanced, and an option that changes
// nothing otherwise.
func placement(balanced bool) amqpsub.Option {
	if balanced {
		return amqpsub.BalanceKeys()
	}
	return amqpsub.Credit(256)
}

func TestArtemisKeylessRotation(t *testing.T) {
	url := artemisURL(t)
	q := queueName(t)
	conn := dial(t, url)
	const n = 800
	msgs := make([]msgSpec, n)
	for i := range msgs {
		msgs[i] = msgSpec{seq: i}
	}
	publishFast(t, conn, q, true, msgs)
	var perLane [8]atomic.Int64
	var total atomic.Int64
	s, _ := amqpsub.New(amqpsub.Dial(url, nil), q, amqpsub.HandlerFunc(func(ctx context.Context, d *amqpsub.Delivery) error {
		if d.GroupID() != "" {
			t.Errorf("group-id %q on a keyless message", d.GroupID())
		}
		perLane[d.Lane()].Add(1)
		total.Add(1)
		return nil
	}), amqpsub.WorkersByKey(8), amqpsub.Logger(logger(t)))
	stop, wait := runSub(t, s)
	waitFor(t, time.Minute, "all deliveries", func() bool { return total.Load() == n+1 })
	stop()
	if err := wait(); err != nil {
		t.Fatal(err)
	}
	for i := range perLane {
		// n+1 with the barrier: the lanes get 101 or 100 each.
		if c := perLane[i].Load(); c < n/8 || c > n/8+1 {
			t.Errorf("lane %d handled %d keyless messages, want ~%d", i, c, n/8)
		}
	}
}

// With Credit(32) and handlers that block, the deliveries held in the
// process never exceed 32; Stats shows it.
func TestArtemisCreditBound(t *testing.T) {
	url := artemisURL(t)
	q := queueName(t)
	conn := dial(t, url)
	const n = 500
	publishFast(t, conn, q, true, groups(n, 50))
	unblock := make(chan struct{})
	var handled atomic.Int64
	s, _ := amqpsub.New(amqpsub.Dial(url, nil), q, amqpsub.HandlerFunc(func(ctx context.Context, d *amqpsub.Delivery) error {
		<-unblock
		handled.Add(1)
		return nil
	}), amqpsub.Credit(32), amqpsub.FixedCredit(), amqpsub.WorkersByKey(4), amqpsub.Logger(logger(t)))
	stop, wait := runSub(t, s)
	waitFor(t, 30*time.Second, "32 deliveries held", func() bool { return s.Stats().Held == 32 })
	// The broker's own count of the deliveries it has out: were a 33rd on
	// its way, it would count it already.
	if out := queueAttribute(t, conn, q, "deliveringCount"); out != "32" {
		t.Fatalf("the broker has %s deliveries out, want 32", out)
	}
	st := s.Stats()
	if st.Handling != 4 || st.Buffered != 28 || st.Received != 32 {
		t.Fatalf("with blocked handlers: %+v", st)
	}
	close(unblock)
	waitFor(t, time.Minute, "all deliveries", func() bool { return handled.Load() == n+1 })
	stop()
	if err := wait(); err != nil {
		t.Fatal(err)
	}
	if st := s.Stats(); st.MaxHeld != 32 || st.Settled.Accepted != n+1 || st.Overshoot != 0 {
		t.Fatalf("after the run: %+v", st)
	}
}

// Cancel while 200 deliveries are buffered and 8 in progress: the buffered
// reach a second consumer within 1 s, the in-progress are settled, nothing is
// lost.
func TestArtemisStopHandsBufferedToAnotherConsumer(t *testing.T) {
	url := artemisURL(t)
	q := queueName(t)
	conn := dial(t, url)
	const buffered, inProgress = 200, 8
	msgs := make([]msgSpec, buffered+inProgress)
	for i := range msgs {
		msgs[i] = msgSpec{seq: i}
	}
	publishFast(t, conn, q, true, msgs)
	// Take the barrier off first, so the queue holds exactly the 208.
	release := make(chan struct{})
	var mu sync.Mutex
	firstDone := map[int]bool{}
	s, _ := amqpsub.New(amqpsub.Dial(url, nil), q, amqpsub.HandlerFunc(func(ctx context.Context, d *amqpsub.Delivery) error {
		<-release
		mu.Lock()
		firstDone[seqOf(d)] = true
		mu.Unlock()
		return nil
	}), amqpsub.Credit(buffered+inProgress+1), amqpsub.FixedCredit(), amqpsub.Workers(inProgress), amqpsub.Logger(logger(t)))
	stop, wait := runSub(t, s)
	waitFor(t, 30*time.Second, "208 held", func() bool {
		st := s.Stats()
		return st.Handling == inProgress && st.Buffered >= buffered
	})
	second := rawReceiver(t, conn, q, 500)
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
	waitFor(t, 10*time.Second, "the queue empty", func() bool { return queueAttribute(t, conn, q, "messageCount") == "0" })
}

func TestArtemisBatchClosesAtSizeAndAtWait(t *testing.T) {
	url := artemisURL(t)
	conn := dial(t, url)
	run := func(t *testing.T, n, size int, wait time.Duration) []int {
		q := queueName(t)
		msgs := make([]msgSpec, n)
		for i := range msgs {
			msgs[i] = msgSpec{seq: i}
		}
		publishFast(t, conn, q, true, msgs)
		var mu sync.Mutex
		var sizes []int
		total := 0
		s, err := amqpsub.NewBatch(amqpsub.Dial(url, nil), q, amqpsub.BatchHandlerFunc(func(ctx context.Context, b []*amqpsub.Delivery) []error {
			mu.Lock()
			defer mu.Unlock()
			sizes = append(sizes, len(b))
			total += len(b)
			return nil
		}), amqpsub.Batch(size, wait), amqpsub.Logger(logger(t)))
		if err != nil {
			t.Fatal(err)
		}
		stop, waitRun := runSub(t, s)
		waitFor(t, time.Minute, "all deliveries", func() bool { mu.Lock(); defer mu.Unlock(); return total == n+1 })
		stop()
		if err := waitRun(); err != nil {
			t.Fatal(err)
		}
		if st := s.Stats(); st.Settled.Accepted != uint64(n+1) {
			t.Fatalf("accepted %d", st.Settled.Accepted)
		}
		return sizes
	}
	t.Run("size", func(t *testing.T) {
		sizes := run(t, 999, 50, time.Second)
		full := 0
		for _, s := range sizes {
			if s > 50 {
				t.Fatalf("batch of %d > 50", s)
			}
			if s == 50 {
				full++
			}
		}
		if full < 15 {
			t.Fatalf("only %d batches closed at size 50: %v", full, sizes)
		}
	})
	t.Run("wait", func(t *testing.T) {
		// 3 messages and a size of 100: only the wait can close the batch.
		start := time.Now()
		sizes := run(t, 2, 100, 200*time.Millisecond)
		if time.Since(start) < 200*time.Millisecond {
			t.Fatal("batch closed before its wait")
		}
		if fmt.Sprint(sizes) != "[3]" {
			t.Logf("batches %v (the broker sent them apart)", sizes)
		}
		for _, s := range sizes {
			if s >= 100 {
				t.Fatal("closed at size")
			}
		}
	})
}

// The library must not stall on RabbitMQ 3.10, which sends past the credit
// it was given: 40,000 messages drained with Credit(256), three runs
// (about 160 windows of the credit each).
func TestRabbitMQDrainsWithoutStall(t *testing.T) {
	url := rabbitURL(t)
	conn := dial(t, url)
	const n = 40000
	msgs := make([]msgSpec, n)
	for i := range msgs {
		msgs[i] = msgSpec{seq: i, body: make([]byte, 100)}
	}
	for run := 1; run <= 3; run++ {
		t.Run(fmt.Sprint("run", run), func(t *testing.T) {
			q := queueName(t)
			publishFast(t, conn, "/queue/"+q, false, msgs)
			// handled counts distinct messages (the barrier's seq is -1), so
			// that a redelivery cannot stand in for one not yet handled;
			// calls counts every handler call.
			var handled, calls atomic.Int64
			seen := make([]atomic.Bool, n+1)
			s, _ := amqpsub.New(amqpsub.Dial(url, nil), q, amqpsub.HandlerFunc(func(ctx context.Context, d *amqpsub.Delivery) error {
				calls.Add(1)
				if !seen[seqOf(d)+1].Swap(true) {
					handled.Add(1)
				}
				return nil
			}), amqpsub.Credit(256), amqpsub.Workers(4), amqpsub.WithProfile(amqpsub.RabbitMQ3), amqpsub.Logger(logger(t)))
			start := time.Now()
			stop, wait := runSub(t, s)
			waitProgress(t, handled.Load, n+1, 5*time.Minute, s.Stats)
			elapsed := time.Since(start)
			stop()
			if err := wait(); err != nil {
				t.Fatal(err)
			}
			st := s.Stats()
			t.Logf("run %d: %d msgs in %v (%.0f msg/s); overshoot %d; max held %d", run, n+1, elapsed.Round(time.Millisecond),
				float64(n+1)/elapsed.Seconds(), st.Overshoot, st.MaxHeld)
			if st.Settled.Accepted != n+1 || calls.Load() != n+1 {
				t.Fatalf("accepted %d, %d handler calls for %d messages; %v", st.Settled.Accepted, calls.Load(), n+1, st)
			}
		})
	}
}

// Continuous credit on RabbitMQ 3.10 (the Generic profile) with a small
// credit meets its overshoot (measured: thousands of deliveries past a credit
// of 8 over 30,000 messages): the pump counts it, switches to windows and
// never stalls.
func TestRabbitMQSmallCreditOvershootDoesNotStall(t *testing.T) {
	url := rabbitURL(t)
	conn := dial(t, url)
	const n = 30000
	msgs := make([]msgSpec, n)
	for i := range msgs {
		msgs[i] = msgSpec{seq: i, body: make([]byte, 100)}
	}
	q := queueName(t)
	publishFast(t, conn, "/queue/"+q, false, msgs)
	var handled atomic.Int64
	s, _ := amqpsub.New(amqpsub.Dial(url, nil), "/amq/queue/"+q, amqpsub.HandlerFunc(func(ctx context.Context, d *amqpsub.Delivery) error {
		handled.Add(1)
		return nil
	}), amqpsub.Credit(8), amqpsub.Workers(8), amqpsub.WithProfile(amqpsub.Generic),
		amqpsub.CloseTimeout(time.Second), amqpsub.Logger(logger(t)))
	stop, wait := runSub(t, s)
	waitProgress(t, handled.Load, n+1, 5*time.Minute, s.Stats)
	stop()
	if err := wait(); err != nil {
		t.Fatal(err)
	}
	st := s.Stats()
	t.Logf("overshoot %d deliveries, max held %d of credit 8", st.Overshoot, st.MaxHeld)
	if st.Settled.Accepted != n+1 {
		t.Fatalf("accepted %d", st.Settled.Accepted)
	}
	// The premise: the broker did send past the credit, and it was seen.
	if st.Overshoot == 0 {
		t.Fatalf("no overshoot counted with a credit of 8 (stats %v)", st)
	}
}
