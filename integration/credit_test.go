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
)

// TestArtemisCreditFairness measures, for docs/performance.md, how three
// replicas on one queue share a backlog under the adaptive credit and under
// a fixed one: each replica is its own connection with Workers(8), two with
// fast handlers and one slow, on 6,000 preloaded keyless messages; the
// ideal drain shares the work by speed. It runs each setting three times,
// interleaved, and logs the median. Only with AMQPSUB_CREDIT=1 (`make
// credit`): it takes a minute or two, and its figures mean something only on
// a quiet machine. It asserts that every message was handled once.
func TestArtemisCreditFairness(t *testing.T) {
	if os.Getenv("AMQPSUB_CREDIT") == "" {
		t.Skip("a measurement: AMQPSUB_CREDIT=1 (make credit) runs it")
	}
	url := artemisURL(t)
	const n, runs = 6000, 3
	for _, shape := range []struct {
		name string
		took [3]time.Duration
	}{
		{"10/10/40 ms", [3]time.Duration{10 * time.Millisecond, 10 * time.Millisecond, 40 * time.Millisecond}},
		{"10/10/100 ms", [3]time.Duration{10 * time.Millisecond, 10 * time.Millisecond, 100 * time.Millisecond}},
	} {
		rate := 0.0
		for _, d := range shape.took {
			rate += 8 / d.Seconds()
		}
		ideal := time.Duration(float64(n) / rate * float64(time.Second))
		settings := []struct {
			name string
			opts []amqpsub.Option
		}{
			{"adaptive (default)", nil},
			{"FixedCredit 256", []amqpsub.Option{amqpsub.FixedCredit()}},
			{"FixedCredit 16", []amqpsub.Option{amqpsub.FixedCredit(), amqpsub.Credit(16)}},
		}
		results := make([][]fairRun, len(settings))
		for r := range runs {
			for i, st := range settings {
				results[i] = append(results[i], fairnessRun(t, url, n, shape.took, st.opts))
				_ = r
			}
		}
		for i, st := range settings {
			rs := results[i]
			sort.Slice(rs, func(a, b int) bool { return rs[a].drained < rs[b].drained })
			var all []string
			for _, x := range rs {
				all = append(all, fmt.Sprintf("%.2fs %v held≤%v rtt %v", x.drained.Seconds(), x.handled, x.maxHeld, x.rtt))
			}
			med := rs[len(rs)/2]
			t.Logf("%s, %s: median drain %.2f s = %.2f× ideal %.2f s (%.2f× the ideal of the handler times measured, %.2f s); runs: %s",
				shape.name, st.name, med.drained.Seconds(), med.drained.Seconds()/ideal.Seconds(), ideal.Seconds(),
				med.drained.Seconds()/med.ideal.Seconds(), med.ideal.Seconds(), strings.Join(all, "; "))
		}
	}
}

type fairRun struct {
	drained time.Duration
	// ideal is the ideal drain with the handlers' times as measured in
	// the run (a sleep of 10 ms takes a little longer).
	ideal   time.Duration
	handled [3]int64
	maxHeld [3]int
	rtt     [3]time.Duration
}

// fairnessRun preloads n messages, starts three replicas at once with the
// handler times given, and returns how long the queue took to drain and
// what each replica handled.
func fairnessRun(t *testing.T, url string, n int, took [3]time.Duration, opts []amqpsub.Option) fairRun {
	t.Helper()
	q := queueName(t)
	conn := dial(t, url)
	publishFast(t, conn, q, true, uniqueSeqs(n, 0))
	var total atomic.Int64
	seen := make([]atomic.Bool, n)
	var dup atomic.Int64
	done := make(chan struct{})
	var once sync.Once
	var handled, busy [3]atomic.Int64
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
			if total.Add(1) == int64(n) {
				once.Do(func() { close(done) })
			}
			return nil
		})
		s, err := amqpsub.New(amqpsub.Dial(url, nil), q, h, append([]amqpsub.Option{amqpsub.Workers(8)}, opts...)...)
		if err != nil {
			t.Fatal(err)
		}
		subs[i] = s
	}
	start := time.Now()
	var stops []context.CancelFunc
	var waits []func() error
	for _, s := range subs {
		stop, wait := runSub(t, s)
		stops, waits = append(stops, stop), append(waits, wait)
	}
	select {
	case <-done:
	case <-time.After(5 * time.Minute):
		t.Fatalf("handled %d of %d in 5 min", total.Load(), n)
	}
	drained := time.Since(start)
	var r fairRun
	r.drained = drained
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
		}
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
// under each credit, on the peer: 2,000 messages, handlers of 1 s,
// Workers(8), a 30 s lock; both settings run side by side on queues of
// their own (about 250 s). Only with AMQPSUB_CREDIT=1. It asserts that
// every message was completed once and no lock was lost.
func TestServiceBusCreditLocks(t *testing.T) {
	if os.Getenv("AMQPSUB_CREDIT") == "" {
		t.Skip("a measurement: AMQPSUB_CREDIT=1 (make credit) runs it")
	}
	p := serviceBusPeer(t)
	const n = 2000
	type result struct {
		name              string
		maxLocks          int
		meanLocks         float64
		requests, renewed uint64
		took              time.Duration
		redelivered, lost int
	}
	results := make([]result, len(creditSettings))
	var wg sync.WaitGroup
	for i, st := range creditSettings {
		q := p.entity(t, map[string]any{"lock_duration_ms": 30000})
		p.send(t, q, n)
		var opts []amqpsub.Option
		if st.flags != nil {
			opts = append(opts, amqpsub.FixedCredit())
		}
		seen := make([]atomic.Int32, n)
		s, err := amqpsub.New(sbConnector(t, p), q, amqpsub.HandlerFunc(func(ctx context.Context, d *amqpsub.Delivery) error {
			seen[sbIndex(d)].Add(1)
			time.Sleep(time.Second)
			return nil
		}), append(opts, amqpsub.Workers(8), amqpsub.Logger(logger(t)))...)
		if err != nil {
			t.Fatal(err)
		}
		wg.Go(func() {
			start := time.Now()
			stop, wait := runSub(t, s)
			var samples, sum, most int
			for p.info(t, q).Stats["completed"] < n {
				if time.Since(start) > 10*time.Minute {
					t.Errorf("%s: not done after 10 min", st.name)
					break
				}
				l := s.Stats().Locks.Held
				sum, most, samples = sum+l, max(most, l), samples+1
				time.Sleep(100 * time.Millisecond)
			}
			took := time.Since(start)
			stop()
			if err := wait(); err != nil {
				t.Error(err)
			}
			sst := s.Stats()
			r := result{name: st.name, maxLocks: most, meanLocks: float64(sum) / float64(max(1, samples)),
				requests: sst.Locks.RenewRequests, renewed: sst.Locks.Renewed, took: took, lost: int(sst.Locks.Lost)}
			for i := range seen {
				if seen[i].Load() > 1 {
					r.redelivered++
				}
			}
			results[i] = r
		})
	}
	wg.Wait()
	for _, r := range results {
		mins := r.took.Minutes()
		t.Logf("%s: %.0f s; locks held max %d, mean %.1f; %d renew-lock requests (%.1f/min) renewing %d locks (%.0f/min); %d handled twice, %d locks lost",
			r.name, r.took.Seconds(), r.maxLocks, r.meanLocks, r.requests, float64(r.requests)/mins, r.renewed, float64(r.renewed)/mins, r.redelivered, r.lost)
		if r.lost != 0 || r.redelivered != 0 {
			t.Errorf("%s: %d locks lost, %d handled twice", r.name, r.lost, r.redelivered)
		}
	}
}
