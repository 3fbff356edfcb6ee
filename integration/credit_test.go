package integration

import (
	"context"
	"fmt"
	"os"
	"slices"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/amqpsub/amqpsub/amqpsub"
	"github.com/amqpsub/amqpsub/internal/lanes"
)

// TestArtemisCreditFairness measures, for docs/performance.md, how three
// replicas on one queue share a backlog under the adaptive credit and under
// a fixed one, in each lane mode: each replica is its own connection with
// Workers(8) or WorkersByKey(8), two with fast handlers and one slow, on
// 6,000 preloaded keyless messages; the ideal drain shares the work by
// speed. It runs each setting three times, interleaved, and logs the
// median. Only with AMQPSUB_CREDIT=1 (`make credit`): it takes a few
// minutes, and its figures mean something only on a quiet machine. It
// asserts that every message was handled once.
func TestArtemisCreditFairness(t *testing.T) {
	if os.Getenv("AMQPSUB_CREDIT") == "" {
		t.Skip("a measurement: AMQPSUB_CREDIT=1 (make credit) runs it")
	}
	b := fairBroker{url: artemisURL(t), artemis: true}
	const n = 6000
	w8, k8 := amqpsub.Workers(8), amqpsub.WorkersByKey(8)
	fixed, bal := amqpsub.FixedCredit(), amqpsub.BalanceKeys()
	for _, shape := range []struct {
		took     [3]time.Duration
		settings []fairSetting
	}{
		{fairTook(40), []fairSetting{
			{"Workers(8), adaptive (default)", []amqpsub.Option{w8}},
			{"WorkersByKey(8), adaptive (default)", []amqpsub.Option{k8}},
			{"WorkersByKey(8), FixedCredit 256", []amqpsub.Option{k8, fixed}},
			{"WorkersByKey(8), BalanceKeys, adaptive", []amqpsub.Option{k8, bal}},
			{"Workers(8), FixedCredit 256", []amqpsub.Option{w8, fixed}},
			{"Workers(8), FixedCredit 16", []amqpsub.Option{w8, fixed, amqpsub.Credit(16)}},
		}},
		{fairTook(100), []fairSetting{
			{"Workers(8), adaptive (default)", []amqpsub.Option{w8}},
			{"WorkersByKey(8), adaptive (default)", []amqpsub.Option{k8}},
			{"Workers(8), FixedCredit 256", []amqpsub.Option{w8, fixed}},
			{"Workers(8), FixedCredit 16", []amqpsub.Option{w8, fixed, amqpsub.Credit(16)}},
		}},
	} {
		fairness(t, b, uniqueSeqs(n, 0), shape.took, shape.settings, 3)
	}
}

// TestRabbitMQ4CreditFairness is TestArtemisCreditFairness on a RabbitMQ 4
// quorum queue, with 6,000 messages over 100 groups, 10/10/40 ms handlers:
// RabbitMQ does not pin a group to a consumer, so every replica takes
// deliveries of every group. Under WorkersByKey(8) a group's deliveries go
// to the lane its group-id hashes to in every replica, so the hash bound
// (the fullest lane's messages at the three replicas' combined rate for one
// lane) is what hash lanes can reach; BalanceKeys can reach the ideal.
// Only with AMQPSUB_CREDIT=1 (`make credit`). It asserts that every message
// was handled once.
func TestRabbitMQ4CreditFairness(t *testing.T) {
	if os.Getenv("AMQPSUB_CREDIT") == "" {
		t.Skip("a measurement: AMQPSUB_CREDIT=1 (make credit) runs it")
	}
	b := fairBroker{url: rabbit4URL(t), rabbit4: true}
	const n = 6000
	k8 := amqpsub.WorkersByKey(8)
	fairness(t, b, uniqueSeqs(n, 100), fairTook(40), []fairSetting{
		{"WorkersByKey(8), BalanceKeys, adaptive (default)", []amqpsub.Option{k8, amqpsub.BalanceKeys()}},
		{"WorkersByKey(8), adaptive (default)", []amqpsub.Option{k8}},
		{"WorkersByKey(8), FixedCredit 256", []amqpsub.Option{k8, amqpsub.FixedCredit()}},
		{"Workers(8), adaptive (default)", []amqpsub.Option{amqpsub.Workers(8)}},
	}, 3)
}

// fairTook is 10/10/slow ms.
func fairTook(slow int) [3]time.Duration {
	return [3]time.Duration{10 * time.Millisecond, 10 * time.Millisecond, time.Duration(slow) * time.Millisecond}
}

// fairBroker is where the fairness runs go: Artemis (a queue of its own
// per run) or a RabbitMQ 4 quorum queue (declared per run).
type fairBroker struct {
	url              string
	artemis, rabbit4 bool
}

type fairSetting struct {
	name string
	opts []amqpsub.Option
}

// fairness runs every setting runs times, interleaved, on msgs with the
// handler times took, and logs each setting's median drain against the
// ideal (the work shared by speed) and, where the messages have
// group-ids, against the hash bound: the fullest of the 8 lanes' messages
// (lanes.LaneOf) at the rate the three replicas drain one lane.
func fairness(t *testing.T, b fairBroker, msgs []msgSpec, took [3]time.Duration, settings []fairSetting, runs int) {
	t.Helper()
	rate, laneRate := 0.0, 0.0
	for _, d := range took {
		rate += 8 / d.Seconds()
		laneRate += 1 / d.Seconds()
	}
	perLane := make([]int, 8)
	keyed := false
	for _, m := range msgs {
		if m.group != "" {
			perLane[lanes.LaneOf(m.group, 8)]++
			keyed = true
		}
	}
	fullest := slices.Max(perLane)
	secs := func(x float64) time.Duration { return time.Duration(x * float64(time.Second)) }
	ideal := secs(float64(len(msgs)) / rate)
	hashBound := secs(float64(fullest) / laneRate)
	shape := fmt.Sprintf("%v/%v/%v", took[0], took[1], took[2])
	if keyed {
		t.Logf("%s: %d messages, per lane (lanes.LaneOf, 8) %v: hash bound %.2f s, ideal %.2f s", shape, len(msgs), perLane, hashBound.Seconds(), ideal.Seconds())
	}
	results := make([][]fairRun, len(settings))
	for range runs {
		for i, st := range settings {
			results[i] = append(results[i], fairnessRun(t, b, msgs, took, st.opts))
		}
	}
	for i, st := range settings {
		rs := results[i]
		sort.Slice(rs, func(a, b int) bool { return rs[a].drained < rs[b].drained })
		var all []string
		for _, x := range rs {
			all = append(all, fmt.Sprintf("%.2fs %v held≤%v credit≤%v parked≤%v lanes busy %.1f/%.1f/%.1f last at %v rtt %v",
				x.drained.Seconds(), x.handled, x.maxHeld, x.maxCredit, x.maxParked, x.busy[0], x.busy[1], x.busy[2], x.last, x.rtt))
		}
		med := rs[len(rs)/2]
		bound := ""
		if keyed {
			// The hash bound with the handler times measured: the fullest
			// lane at the three replicas' measured per-lane rate.
			bound = fmt.Sprintf(" = %.2f× hash bound %.2f s (%.2f× by the times measured)", med.drained.Seconds()/hashBound.Seconds(), hashBound.Seconds(),
				med.drained.Seconds()*med.laneRate/float64(fullest))
		}
		t.Logf("%s, %s: median drain %.2f s = %.2f× ideal %.2f s (%.2f× the ideal of the handler times measured, %.2f s)%s; runs: %s",
			shape, st.name, med.drained.Seconds(), med.drained.Seconds()/ideal.Seconds(), ideal.Seconds(),
			med.drained.Seconds()/med.ideal.Seconds(), med.ideal.Seconds(), bound, strings.Join(all, "; "))
	}
}

type fairRun struct {
	drained time.Duration
	// ideal is the ideal drain with the handlers' times as measured in
	// the run (a sleep of 10 ms takes a little longer); laneRate is one
	// lane's rate in the three replicas, by the same times.
	ideal    time.Duration
	laneRate float64
	handled  [3]int64
	maxHeld  [3]int
	rtt      [3]time.Duration
	// maxCredit and maxParked are the most Stats().Credit and
	// Stats().Parked seen, sampled every 10 ms; busy is the mean number of
	// lanes with a delivery (Stats().Lanes), by the same samples.
	maxCredit, maxParked [3]int
	busy                 [3]float64
	// last is when each replica finished its last message, from the start.
	last [3]time.Duration
}

// fairnessRun preloads msgs, starts three replicas at once with the
// handler times given, and returns how long the queue took to drain and
// what each replica handled.
func fairnessRun(t *testing.T, b fairBroker, msgs []msgSpec, took [3]time.Duration, opts []amqpsub.Option) fairRun {
	t.Helper()
	n := len(msgs)
	conn := dial(t, b.url)
	addr := queueName(t)
	if b.rabbit4 {
		q := declareRabbit4(t, "quorum")
		r4publish(t, conn, q, msgs)
		addr = "/queues/" + q
		opts = append([]amqpsub.Option{amqpsub.WithProfile(amqpsub.RabbitMQ4)}, opts...)
	} else {
		publishFast(t, conn, addr, b.artemis, msgs)
	}
	var total atomic.Int64
	seen := make([]atomic.Bool, n)
	var dup atomic.Int64
	done := make(chan struct{})
	var once sync.Once
	var handled, busy, last [3]atomic.Int64
	var start time.Time
	subs := make([]*amqpsub.Subscriber, 3)
	for i := range subs {
		h := amqpsub.HandlerFunc(func(ctx context.Context, d *amqpsub.Delivery) error {
			seq := seqOf(d)
			if seq < 0 {
				return nil // the barrier
			}
			began := time.Now()
			time.Sleep(took[i])
			busy[i].Add(int64(time.Since(began)))
			if seen[seq].Swap(true) {
				dup.Add(1)
			}
			handled[i].Add(1)
			last[i].Store(int64(time.Since(start)))
			if total.Add(1) == int64(n) {
				once.Do(func() { close(done) })
			}
			return nil
		})
		s, err := amqpsub.New(amqpsub.Dial(b.url, nil), addr, h, opts...)
		if err != nil {
			t.Fatal(err)
		}
		subs[i] = s
	}
	var r fairRun
	sampled, quit := make(chan struct{}), make(chan struct{})
	defer close(quit)
	start = time.Now()
	var stops []context.CancelFunc
	var waits []func() error
	for _, s := range subs {
		stop, wait := runSub(t, s)
		stops, waits = append(stops, stop), append(waits, wait)
	}
	go func() {
		defer close(sampled)
		tick := time.NewTicker(10 * time.Millisecond)
		defer tick.Stop()
		var busyLanes [3]int
		samples := 0
		defer func() {
			for i := range busyLanes {
				r.busy[i] = float64(busyLanes[i]) / float64(max(1, samples))
			}
		}()
		for {
			for i, s := range subs {
				st := s.Stats()
				r.maxCredit[i] = max(r.maxCredit[i], st.Credit)
				r.maxParked[i] = max(r.maxParked[i], st.Parked)
				for _, l := range st.Lanes {
					if l.Load > 0 {
						busyLanes[i]++
					}
				}
			}
			samples++
			select {
			case <-done:
				return
			case <-quit:
				return
			case <-tick.C:
			}
		}
	}()
	select {
	case <-done:
	case <-time.After(5 * time.Minute):
		t.Fatalf("handled %d of %d in 5 min", total.Load(), n)
	}
	r.drained = time.Since(start)
	<-sampled
	rate := 0.0 // msgs/s of the three, by the handler times measured
	for i, stop := range stops {
		stop()
		if err := waits[i](); err != nil {
			t.Fatal(err)
		}
		r.handled[i] = handled[i].Load()
		if r.handled[i] > 0 {
			mean := float64(busy[i].Load()) / float64(r.handled[i])
			rate += 8 / (mean / 1e9)
			r.laneRate += 1 / (mean / 1e9)
		} else {
			r.laneRate += 1 / took[i].Seconds()
			rate += 8 / took[i].Seconds()
		}
		r.last[i] = time.Duration(last[i].Load()).Round(time.Millisecond)
		r.maxHeld[i] = subs[i].Stats().MaxHeld
		r.rtt[i] = subs[i].Stats().RoundTrip
	}
	r.ideal = time.Duration(float64(n) / rate * float64(time.Second))
	if dup.Load() != 0 {
		t.Fatalf("%d messages handled twice", dup.Load())
	}
	return r
}

// creditSettings are the two credits the measurements compare.
var creditSettings = []struct {
	name  string
	flags []string
}{
	{"adaptive (default)", nil},
	{"FixedCredit 256", []string{"-fixed-credit"}},
}

// TestArtemisCreditCrashRedelivers measures, for docs/performance.md, what
// a replica killed with SIGKILL leaves to be redelivered under each
// credit: two examples/replicas processes (WorkersByKey(8), handlers of a
// random 0–200 ms, 100 ms on average) on 1,200 messages without a
// group-id (grouped, a replica's own groups wait behind its lanes and are
// held either way); one is killed once 200 are handled, the other
// finishes. Counted: the messages handled with a delivery count above 0. Three runs a setting,
// interleaved. Only with AMQPSUB_CREDIT=1 (`make credit`). It asserts that
// nothing was lost.
func TestArtemisCreditCrashRedelivers(t *testing.T) {
	if os.Getenv("AMQPSUB_CREDIT") == "" {
		t.Skip("a measurement: AMQPSUB_CREDIT=1 (make credit) runs it")
	}
	url := artemisURL(t)
	bin := buildReplicas(t, t.TempDir())
	const n = 1200
	results := make([][]string, len(creditSettings))
	counts := make([][]int, len(creditSettings))
	for range 3 {
		for i, st := range creditSettings {
			q := queueName(t)
			published := uniqueSeqs(n, 0)
			publishFast(t, dial(t, url), q, true, published)
			r := newReplicaRun(t, bin, url, q, append([]string{"-lanes", "8", "-work", "200ms"}, st.flags...)...)
			r.startTogether("a", "b")
			r.waitHandled(200, time.Minute)
			r.stop("a", syscall.SIGKILL)
			held := r.log.handledBy("a")
			r.waitHandled(n, 5*time.Minute)
			r.stopAll()
			f := analyse(r.log.snapshot(), published)
			if len(f.lost) != 0 {
				t.Fatalf("%s: %d messages lost", st.name, len(f.lost))
			}
			again := map[msgKey]bool{}
			for _, e := range r.log.snapshot() {
				if e.count > 0 && e.seq >= 0 {
					again[msgKey{e.group, e.seq}] = true
				}
			}
			counts[i] = append(counts[i], len(again))
			results[i] = append(results[i], fmt.Sprintf("%d redelivered (a handled %d before the kill)", len(again), held))
		}
	}
	for i, st := range creditSettings {
		c := slices.Clone(counts[i])
		slices.Sort(c)
		t.Logf("%s: median %d messages redelivered with a higher delivery count; runs: %s", st.name, c[len(c)/2], strings.Join(results[i], "; "))
	}
}

// TestArtemisCreditGroupSpread measures, for docs/performance.md, how 100
// groups spread over 3 examples/replicas processes started together
// (WorkersByKey(8), 0–20 ms handlers) on a preloaded queue of 3,000
// messages: Artemis pins a group to the consumer that first receives one of
// its messages, so what a replica takes at its attach decides the spread.
// Three runs a setting, interleaved. Only with AMQPSUB_CREDIT=1.
func TestArtemisCreditGroupSpread(t *testing.T) {
	if os.Getenv("AMQPSUB_CREDIT") == "" {
		t.Skip("a measurement: AMQPSUB_CREDIT=1 (make credit) runs it")
	}
	url := artemisURL(t)
	bin := buildReplicas(t, t.TempDir())
	const n = 3000
	results := make([][]string, len(creditSettings))
	for range 3 {
		for i, st := range creditSettings {
			q := queueName(t)
			published := groups(n, 100)
			publishFast(t, dial(t, url), q, true, published)
			r := newReplicaRun(t, bin, url, q, append([]string{"-lanes", "8", "-work", "20ms"}, st.flags...)...)
			r.startTogether("a", "b", "c")
			r.waitHandled(n, 5*time.Minute)
			r.stopAll()
			f := analyse(r.log.snapshot(), published)
			if len(f.lost) != 0 || f.violations != 0 {
				t.Fatalf("%s: %d lost, %d order violations", st.name, len(f.lost), f.violations)
			}
			var spread []int
			for _, id := range []string{"a", "b", "c"} {
				spread = append(spread, len(f.groupsOf[id]))
			}
			slices.Sort(spread)
			results[i] = append(results[i], fmt.Sprint(spread))
		}
	}
	for i, st := range creditSettings {
		t.Logf("%s: groups per replica (sorted) %s", st.name, strings.Join(results[i], "; "))
	}
}

// TestServiceBusCreditLocks measures, for docs/performance.md, the locks
// a Service Bus subscriber holds and the renew-lock requests it makes
// under each credit and lane mode, on the peer: 480 messages, handlers of
// 1 s, 8 lanes, a 30 s lock; Workers(8) and WorkersByKey(8) on keyless
// messages, WorkersByKey(8) on messages over 100 group-ids (session ids
// on a queue without sessions), each with the adaptive credit, and
// Workers(8) and WorkersByKey(8) with a fixed one; all side by side on
// queues of their own (about 60 s). Only with AMQPSUB_CREDIT=1. It
// asserts that every message was completed once and no lock was lost.
func TestServiceBusCreditLocks(t *testing.T) {
	if os.Getenv("AMQPSUB_CREDIT") == "" {
		t.Skip("a measurement: AMQPSUB_CREDIT=1 (make credit) runs it")
	}
	p := serviceBusPeer(t)
	const n = 480
	type result struct {
		name              string
		maxLocks          int
		meanLocks         float64
		maxCredit         int
		busy              float64 // lanes with a delivery, mean of the samples
		requests, renewed uint64
		took              time.Duration
		redelivered, lost int
	}
	w8, k8, fixed := amqpsub.Workers(8), amqpsub.WorkersByKey(8), amqpsub.FixedCredit()
	settings := []struct {
		name   string
		groups int
		opts   []amqpsub.Option
	}{
		{"Workers(8), adaptive", 0, []amqpsub.Option{w8}},
		{"Workers(8), FixedCredit 256", 0, []amqpsub.Option{w8, fixed}},
		{"WorkersByKey(8), keyless, adaptive", 0, []amqpsub.Option{k8}},
		{"WorkersByKey(8), 100 groups, adaptive", 100, []amqpsub.Option{k8}},
		{"WorkersByKey(8), 100 groups, FixedCredit 256", 100, []amqpsub.Option{k8, fixed}},
	}
	results := make([]result, len(settings))
	var wg sync.WaitGroup
	for i, st := range settings {
		q := p.entity(t, map[string]any{"lock_duration_ms": 30000})
		var args []string
		if st.groups > 0 {
			args = []string{"-sessions", fmt.Sprint(st.groups)}
		}
		p.send(t, q, n, args...)
		seen := make([]atomic.Int32, n)
		s, err := amqpsub.New(sbConnector(t, p), q, amqpsub.HandlerFunc(func(ctx context.Context, d *amqpsub.Delivery) error {
			seen[sbIndex(d)].Add(1)
			time.Sleep(time.Second)
			return nil
		}), append(slices.Clone(st.opts), amqpsub.Logger(logger(t)))...)
		if err != nil {
			t.Fatal(err)
		}
		wg.Go(func() {
			start := time.Now()
			stop, wait := runSub(t, s)
			var samples, sum, most, credit, busy int
			for p.info(t, q).Stats["completed"] < n {
				if time.Since(start) > 10*time.Minute {
					t.Errorf("%s: not done after 10 min", st.name)
					break
				}
				sst := s.Stats()
				l := sst.Locks.Held
				sum, most, samples = sum+l, max(most, l), samples+1
				credit = max(credit, sst.Credit)
				for _, l := range sst.Lanes {
					if l.Load > 0 {
						busy++
					}
				}
				time.Sleep(100 * time.Millisecond)
			}
			took := time.Since(start)
			stop()
			if err := wait(); err != nil {
				t.Error(err)
			}
			sst := s.Stats()
			r := result{name: st.name, maxLocks: most, meanLocks: float64(sum) / float64(max(1, samples)), maxCredit: credit, busy: float64(busy) / float64(max(1, samples)),
				requests: sst.Locks.RenewRequests, renewed: sst.Locks.Renewed, took: took, lost: int(sst.Locks.Lost)}
			for i := range seen {
				switch c := seen[i].Load(); {
				case c > 1:
					r.redelivered++
				case c == 0:
					t.Errorf("%s: message %d not handled", st.name, i)
				}
			}
			results[i] = r
		})
	}
	wg.Wait()
	// sbsend -sessions names message i's session s%03d of i mod 100: under
	// WorkersByKey(8) the fullest lane's messages, at 1 s each, bound the
	// drain.
	perLane := make([]int, 8)
	for i := range n {
		perLane[lanes.LaneOf(fmt.Sprintf("s%03d", i%100), 8)]++
	}
	t.Logf("100 groups over 8 lanes (lanes.LaneOf): %v messages; hash bound %d s, ideal %d s", perLane, slices.Max(perLane), n/8)
	for _, r := range results {
		mins := r.took.Minutes()
		t.Logf("%s: %.0f s; locks held max %d, mean %.1f; credit max %d; lanes busy %.1f of 8; %d renew-lock requests (%.1f/min) renewing %d locks (%.0f/min); %d handled twice, %d locks lost",
			r.name, r.took.Seconds(), r.maxLocks, r.meanLocks, r.maxCredit, r.busy, r.requests, float64(r.requests)/mins, r.renewed, float64(r.renewed)/mins, r.redelivered, r.lost)
		if r.lost != 0 || r.redelivered != 0 {
			t.Errorf("%s: %d locks lost, %d handled twice", r.name, r.lost, r.redelivered)
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
