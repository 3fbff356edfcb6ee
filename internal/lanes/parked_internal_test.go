package lanes

import (
	"strings"
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

// One very long call (a handler that waited 10 minutes for its ctx)
// counts for at most four times the mean, so the next stuck call is still
// seen as stalled within a few times the usual call. (Lanes time one call
// in timeEvery: the long calls here are timeEvery in a row, so that one of
// them is timed.)
func TestHashParkedALongCallDoesNotBlindTheStallRule(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		g := NewGauge(2)
		call := func(lane int, d time.Duration) {
			g.begin(lane, 1)
			time.Sleep(d)
			g.end(lane)
		}
		for range 1000 {
			call(0, time.Millisecond)
		}
		for range timeEvery {
			call(0, 10*time.Minute)
		}
		g.lanes[1].load.Store(51) // stuck on a call, 50 queued behind it
		g.begin(1, 1)
		g.Parked(time.Now())
		time.Sleep(time.Second)
		if _, stalled := g.Parked(time.Now()); stalled != 50 {
			t.Fatalf("a call stuck for a second behind 50 queued, after a 10 min call among 1 ms ones: stalled %d (mean %v), want 50",
				stalled, time.Duration(g.took()))
		}
	})
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
