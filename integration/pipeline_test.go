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
	const n = 10000
	q, conn := tg.filled(t, groups(n, r.groups))

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

// placement returns BalanceKeys when balanced, and an option that changes
// nothing otherwise.
func placement(balanced bool) amqpsub.Option {
	if balanced {
		return amqpsub.BalanceKeys()
	}
	return amqpsub.Credit(256)
}

// Messages without a group-id spread over all lanes: they rotate.
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
