package lanes

import (
	"slices"
	"strings"
	"sync"
	"testing"
	"testing/synctest"
	"time"
)

// The pool's parked count: items of a key a lane holds wait for that lane
// and are parked; once the lane lets the key go, they are ready for any
// lane and no longer parked; a stop parks nothing.
func TestPoolParkedCount(t *testing.T) {
	g := NewGauge(2)
	p := newPool(func(s string) string { return s[:1] }, 2, g)
	a, b := newPoolFeed(p, 0), newPoolFeed(p, 1)
	for _, it := range []string{"x1", "x2", "x3", "y1"} {
		p.push(it)
	}
	if n := parkedNow(g); n != 0 {
		t.Fatalf("parked %d before any lane took a key, want 0", n)
	}
	if it, st := a.poll(); st != got || it != "x1" {
		t.Fatalf("lane a took %q, %v", it, st)
	}
	if n := parkedNow(g); n != 2 {
		t.Fatalf("parked %d with x held by lane a and x2, x3 waiting, want 2", n)
	}
	p.push("x4")
	if n := parkedNow(g); n != 3 {
		t.Fatalf("parked %d after x4, want 3", n)
	}
	if it, st := b.poll(); st != got || it != "y1" {
		t.Fatalf("lane b took %q, %v: x is lane a's", it, st)
	}
	if it, _ := a.poll(); it != "x2" {
		t.Fatalf("lane a took %q, want x2", it)
	}
	if n := parkedNow(g); n != 2 {
		t.Fatalf("parked %d after lane a took x2, want 2", n)
	}
	p.finish("x")
	p.finish("x") // lane a let x go: x3, x4 are ready for any lane
	if n := parkedNow(g); n != 0 {
		t.Fatalf("parked %d once no lane holds x, want 0", n)
	}
	if it, _ := b.poll(); it != "x3" {
		t.Fatalf("lane b took %q, want x3", it)
	}
	if n := parkedNow(g); n != 1 {
		t.Fatalf("parked %d with x4 behind lane b, want 1", n)
	}
	p.stop(func(string) {})
	if n := parkedNow(g); n != 0 {
		t.Fatalf("parked %d after a stop, want 0", n)
	}
}

// The hash placement's parked count: an item with an earlier item of its
// key in its lane is parked; a keyless item, or the first of its key, is
// not, until the lane's handler call has run for longer than StallAfter
// and four times the calls' mean, when all that is queued behind it is
// (once a first call has set the mean).
func TestHashParkedCount(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		g, in, release, done := stuckOnA1(1, false)
		in <- "c1" // a first call, which sets the calls' mean
		synctest.Wait()
		for _, it := range []string{"a1", "a2", "b1", "7", "a3"} { // "7": keyless
			in <- it
		}
		synctest.Wait()
		if n := parkedNow(g); n != 2 {
			t.Fatalf("parked %d with a1 in the handler and a2, b1, a keyless item and a3 queued, want 2 (a2, a3)", n)
		}
		time.Sleep(StallAfter + time.Microsecond)
		if n := parkedNow(g); n != 4 {
			t.Fatalf("parked %d once a1's call has run past StallAfter, want the 4 queued", n)
		}
		close(release)
		close(in)
		<-done
		if n := parkedNow(g); n != 0 {
			t.Fatalf("parked %d once the lane is empty, want 0", n)
		}
	})
}

// A lane is stalled at four times the calls' mean duration, not before.
func TestHashParkedStallFollowsTheMean(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		g := NewGauge(1)
		g.begin(0, 1)
		time.Sleep(10 * time.Millisecond)
		g.end(0) // the mean: 10 ms
		g.lanes[0].load.Store(3)
		g.begin(0, 1)
		parkedNow(g) // the pump reads the gauge as the call begins
		time.Sleep(39 * time.Millisecond)
		if n := parkedNow(g); n != 0 {
			t.Fatalf("parked %d after 39 ms of a call, mean 10 ms: want 0", n)
		}
		time.Sleep(2 * time.Millisecond)
		if n := parkedNow(g); n != 2 {
			t.Fatalf("parked %d after 41 ms of a call, mean 10 ms: want the 2 queued", n)
		}
	})
}

// stuckOnA1 runs n lanes, keyed by an item's letters, whose handler is
// stuck on item a1 until release is closed; done is closed once Run has
// returned, after in is closed.
func stuckOnA1(n int, balanced bool) (g *Gauge, in chan string, release, done chan struct{}) {
	g, in, release, done = NewGauge(n), make(chan string), make(chan struct{}), make(chan struct{})
	go func() {
		defer close(done)
		Run(in, Config[string]{
			Lanes:    n,
			Key:      func(s string) string { return strings.TrimRight(s, "0123456789") },
			Balanced: balanced,
			Gauge:    g,
			Handle: func(_ int, s string) {
				if s == "a1" {
					<-release
				}
			},
			Drop: func(string) {},
		})
	}()
	return g, in, release, done
}

// parkedNow is all that Gauge.Parked counts now.
func parkedNow(g *Gauge) int {
	group, stalled := g.Parked(time.Now())
	return group + stalled
}

// What waits behind a stalled call is told apart from what waits behind
// its group: under Balanced, the pool's items of the key a stalled lane
// holds.
func TestBalancedParkedBehindAStall(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		g, in, release, done := stuckOnA1(2, true)
		for _, it := range []string{"a1", "a2", "a3", "b1"} {
			in <- it
		}
		synctest.Wait()
		if group, stalled := g.Parked(time.Now()); group != 2 || stalled != 0 {
			t.Fatalf("parked %d behind a group, %d behind a stall; want 2 (a2, a3), 0", group, stalled)
		}
		time.Sleep(StallAfter + time.Microsecond)
		if group, stalled := g.Parked(time.Now()); group != 0 || stalled != 2 {
			t.Fatalf("parked %d behind a group, %d behind a stall once a1's call has run past StallAfter; want 0, 2", group, stalled)
		}
		close(release)
		close(in)
		<-done
		if n := parkedNow(g); n != 0 {
			t.Fatalf("parked %d once the lanes are empty, want 0", n)
		}
	})
}

// calls runs n calls of d on lane, under synctest.
func calls(g *Gauge, lane, n int, d time.Duration) {
	for range n {
		g.begin(lane, 1)
		time.Sleep(d)
		g.end(lane)
	}
}

// stalledBehindAStuckCall puts 50 items behind a call on lane that has run
// for a second since the pump first saw it, and returns what Parked counts
// as stalled; under synctest.
func stalledBehindAStuckCall(g *Gauge, lane int) int {
	g.lanes[lane].load.Store(51)
	g.begin(lane, 1)
	g.Parked(time.Now())
	time.Sleep(time.Second)
	_, stalled := g.Parked(time.Now())
	return stalled
}

// A very long call (a handler that waited 10 minutes for its ctx), or
// slow first calls (a cold start), count for at most four times the mean,
// so the next stuck call is still seen as stalled within a few times the
// usual call: on the same lane, on another lane, as a lane's first call
// (which sets its own mean), and after every lane's first call was slow.
// (Lanes time one call in timeEvery: the long calls of the first row are
// timeEvery in a row, so that one of them is timed.)
func TestHashParkedALongCallDoesNotBlindTheStallRule(t *testing.T) {
	for _, tc := range []struct {
		name  string
		calls func(g *Gauge)
		stuck int // the lane of the stuck call
	}{
		{"after 1 ms calls on another lane", func(g *Gauge) {
			calls(g, 0, 1000, time.Millisecond)
			calls(g, 0, timeEvery, 10*time.Minute)
		}, 1},
		{"another lane's first call", func(g *Gauge) {
			calls(g, 0, 100, time.Millisecond)
			calls(g, 1, 1, 10*time.Minute)
			calls(g, 1, 100, time.Millisecond)
		}, 0},
		{"a cold start on every lane", func(g *Gauge) {
			calls(g, 0, 1, 2*time.Second)
			calls(g, 1, 1, 2*time.Second)
			for range 200 {
				calls(g, 0, 1, time.Millisecond)
				calls(g, 1, 1, time.Millisecond)
			}
		}, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				g := NewGauge(2)
				tc.calls(g)
				if stalled := stalledBehindAStuckCall(g, tc.stuck); stalled != 50 {
					t.Fatalf("a call stuck for a second behind 50 queued: stalled %d (mean %v), want 50", stalled, time.Duration(g.took()))
				}
			})
		})
	}
}

// A call is timed from the first read of the gauge that sees it, and a
// new call starts its time anew, even when no read saw the lane idle in
// between.
func TestParkedTimesACallFromItsFirstSight(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		g := NewGauge(1)
		for range timeEvery {
			g.begin(0, 1)
			time.Sleep(time.Millisecond)
			g.end(0)
		}
		g.lanes[0].load.Store(3)
		g.begin(0, 1)
		time.Sleep(time.Second) // unseen: it does not count
		if _, stalled := g.Parked(time.Now()); stalled != 0 {
			t.Fatalf("stalled %d at the first sight of a call, want 0", stalled)
		}
		time.Sleep(5 * time.Millisecond)
		if _, stalled := g.Parked(time.Now()); stalled != 2 {
			t.Fatalf("stalled %d 5 ms after the first sight of a call, 1 ms mean: want the 2 queued", stalled)
		}
		g.end(0)
		g.begin(0, 1) // the next call, no read in between
		if _, stalled := g.Parked(time.Now()); stalled != 0 {
			t.Fatalf("stalled %d at the first sight of the next call, want 0", stalled)
		}
	})
}

// Stats takes its now before it reads each pipe's gauge, and the pump
// reads the gauge with the time of its turn's event: a reader's now can
// predate the call it first sees. That call does not count as having run
// since then.
func TestParkedAStaleFirstSightIsNoStall(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		g := NewGauge(1)
		calls(g, 0, timeEvery, time.Millisecond) // a mean of 1 ms
		stale := time.Now()                      // a reader takes its now (Stats, or the pump's turn)...
		time.Sleep(100 * time.Millisecond)
		g.lanes[0].load.Store(3)
		g.begin(0, 1)   // ...a call begins...
		g.Parked(stale) // ...and the reader sees it
		if _, stalled := g.Parked(time.Now()); stalled != 0 {
			t.Fatalf("stalled %d for a call that began now, seen first by a reader whose now was 100 ms old (mean 1 ms): want 0", stalled)
		}
	})
}

// Two readers (the pump and Stats) see a lane's new call at once.
// One stores the call, then its time; the other, between the two stores,
// pairs the new call with the time the previous call was first seen, and
// counts the new call as stalled.
func TestParkedConcurrentReadersSeeNoFalseStall(t *testing.T) {
	base := time.Now()
	const n = 100000 // the window is two atomic stores: a few in 20000 here
	for i := range n {
		g := NewGauge(1)
		g.base = base
		g.lanes[0].took.Store(int64(time.Millisecond))
		g.lanes[0].load.Store(3)
		g.begin(0, 1)
		g.Parked(base) // call 1 first seen at 0
		g.end(0)
		g.begin(0, 1) // call 2 begins 50 ms later, and two readers see it
		now := base.Add(50 * time.Millisecond)
		var wg sync.WaitGroup
		var st [2]int
		start := make(chan struct{})
		for i := range 2 {
			wg.Go(func() {
				<-start
				_, st[i] = g.Parked(now)
			})
		}
		close(start)
		wg.Wait()
		if st[0]+st[1] > 0 {
			t.Fatalf("call %d of %d seen as stalled (%d, %d) at its first sight by two readers at once, want 0", i+1, n, st[0], st[1])
		}
	}
}

// A batch call under a key is timed and seen
// like a single call; what is queued behind a stuck batch, beyond the
// batch's own items, is stalled, under either placement.
func TestParkedBehindAStuckBatch(t *testing.T) {
	for _, balanced := range []bool{false, true} {
		synctest.Test(t, func(t *testing.T) {
			g, in, release, done := NewGauge(1), make(chan string), make(chan struct{}), make(chan struct{})
			go func() {
				defer close(done)
				Run(in, Config[string]{
					Lanes: 1, Balanced: balanced, Gauge: g, BatchSize: 2,
					Key: func(s string) string { return s[:1] },
					HandleBatch: func(_ int, items []string) {
						if slices.Contains(items, "a1") {
							<-release
						}
					},
					Drop: func(string) {},
				})
			}()
			for _, it := range []string{"c1", "c2", "a1", "a2", "a3", "a4", "a5"} {
				in <- it
			}
			synctest.Wait() // the c's: the mean; a1 in the handler, with a2 perhaps
			g.Parked(time.Now())
			time.Sleep(StallAfter + time.Microsecond)
			group, stalled := g.Parked(time.Now())
			if stalled < 3 || group != 0 { // a3, a4, a5 at least wait (Balanced: in the pool, for the lane that holds a)
				t.Errorf("balanced=%v: parked %d behind a group, %d behind a stuck batch of 2; want 0, 3 or more", balanced, group, stalled)
			}
			close(release)
			close(in)
			<-done
			if n := parkedNow(g); n != 0 {
				t.Errorf("balanced=%v: parked %d once the lane is empty, want 0", balanced, n)
			}
		})
	}
}

// Of a lane's timeEvery calls, only the first is timed for the mean.
func TestOnlyOneCallInTimeEveryIsTimed(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		g := NewGauge(1)
		for i := range 2 * timeEvery { // the timed calls take 1 ms, the others 100 ms
			g.begin(0, 1)
			if i%timeEvery == 0 {
				time.Sleep(time.Millisecond)
			} else {
				time.Sleep(100 * time.Millisecond)
			}
			g.end(0)
		}
		if m := time.Duration(g.took()); m < time.Millisecond-time.Microsecond || m > time.Millisecond {
			t.Fatalf("mean %v after calls of 1 ms timed and of 100 ms untimed, want 1 ms", m)
		}
	})
}
