package credit

import (
	"container/heap"
	"math"
	"testing"
	"time"
)

// sim runs an Account against a simulated broker and lanes on a fake
// clock: the broker answers a grant after rtt with as many deliveries as
// it has (backlog), and each of lanes handlers takes took(now) a delivery.
type sim struct {
	t       *testing.T
	a       *Account
	now     time.Time
	rtt     time.Duration
	lanes   int
	took    func(now time.Time) time.Duration
	backlog func(now time.Time) bool // the queue has messages now

	events    eventHeap
	buffered  int // received, waiting for a lane
	busy      int // lanes in a handler
	handled   int
	maxHeld   int
	maxCredit int
	// waiting is credit the broker holds while its queue is empty: it is
	// spent as soon as the queue has messages again (checked each tick).
	waiting int
}

type event struct {
	at   time.Time
	kind int // arrive (n deliveries), finish (one handler), tick
	n    int
}

const (
	arrive = iota
	finish
	tick
)

type eventHeap []event

func (h eventHeap) Len() int           { return len(h) }
func (h eventHeap) Less(i, j int) bool { return h[i].at.Before(h[j].at) }
func (h eventHeap) Swap(i, j int)      { h[i], h[j] = h[j], h[i] }
func (h *eventHeap) Push(x any)        { *h = append(*h, x.(event)) }
func (h *eventHeap) Pop() any {
	old := *h
	e := old[len(old)-1]
	*h = old[:len(old)-1]
	return e
}

func newSim(t *testing.T, ceiling, lanes int, rtt time.Duration, took func(time.Time) time.Duration) *sim {
	s := &sim{t: t, now: time.Unix(1e9, 0), rtt: rtt, lanes: lanes, took: took,
		backlog: func(time.Time) bool { return true }}
	s.a = New(ceiling, Continuous)
	s.a.Adapt(lanes, func() time.Time { return s.now })
	s.a.Attach()
	return s
}

// grant asks the Account for credit, as the pump does after every event,
// and has the broker answer it.
func (s *sim) grant() {
	if n := int(s.a.Grant()); n > 0 {
		s.send(n)
	}
	s.maxCredit = max(s.maxCredit, s.a.Limit())
	if held := s.a.Held(); held > s.maxHeld {
		s.maxHeld = held
	}
	if out := s.a.Snapshot().Outstanding; int(out)+s.a.Held() > s.a.Snapshot().Limit {
		s.t.Fatalf("held %d + outstanding %d past the ceiling", s.a.Held(), out)
	}
}

func (s *sim) send(n int) {
	if !s.backlog(s.now) {
		s.waiting += n
		return
	}
	heap.Push(&s.events, event{at: s.now.Add(s.rtt), kind: arrive, n: n})
}

func (s *sim) startLanes() {
	for s.busy < s.lanes && s.buffered > 0 {
		s.buffered--
		s.busy++
		heap.Push(&s.events, event{at: s.now.Add(s.took(s.now)), kind: finish})
	}
}

// run advances the clock to until, and returns the deliveries handled
// meanwhile.
func (s *sim) run(until time.Time) int {
	start := s.handled
	if s.events.Len() == 0 {
		s.grant()
	}
	heap.Push(&s.events, event{at: s.now.Add(time.Millisecond), kind: tick})
	for s.events.Len() > 0 && !s.events[0].at.After(until) {
		e := heap.Pop(&s.events).(event)
		s.now = e.at
		switch e.kind {
		case arrive:
			for range e.n {
				s.a.Received()
			}
			s.buffered += e.n
			s.startLanes()
		case finish:
			s.busy--
			s.handled++
			s.a.Settled(1)
			s.startLanes()
		case tick:
			if s.waiting > 0 && s.backlog(s.now) {
				// The queue has messages again: the broker spends the credit
				// it held at once.
				n := s.waiting
				s.waiting = 0
				heap.Push(&s.events, event{at: s.now, kind: arrive, n: n})
			}
			heap.Push(&s.events, event{at: s.now.Add(time.Millisecond), kind: tick})
		}
		s.grant()
	}
	s.now = until
	return s.handled - start
}

func constant(d time.Duration) func(time.Time) time.Duration {
	return func(time.Time) time.Duration { return d }
}

// Slow handlers: the credit stays near the lanes, and the lanes stay busy.
func TestAdaptiveSlowHandlersHoldLittleMoreThanTheLanes(t *testing.T) {
	s := newSim(t, 256, 8, 500*time.Microsecond, constant(10*time.Millisecond))
	s.run(s.now.Add(time.Second))
	got := s.run(s.now.Add(2 * time.Second))
	if ideal := 2 * 8 * 100; got < ideal*95/100 {
		t.Errorf("handled %d in 2 s, want ≥ 95%% of %d", got, ideal)
	}
	// 8 lanes + ⌈4 × 800/s × 2 ms (MinRoundTrip)⌉ = 15.
	if s.maxCredit > 15 || s.maxHeld > 15 {
		t.Errorf("credit up to %d, held up to %d; want ≤ 15", s.maxCredit, s.maxHeld)
	}
	if rtt := s.a.RoundTrip(); rtt != 500*time.Microsecond {
		t.Errorf("round trip %v, want 500µs", rtt)
	}
}

// Fast handlers behind a long round trip: the credit grows until the
// round trip is covered, and the rate is the lanes'.
func TestAdaptiveFastHandlersGrowTheCreditToCoverTheRoundTrip(t *testing.T) {
	// One lane of 20 µs: 50,000/s, which needs 50 in flight over 1 ms.
	s := newSim(t, 256, 1, time.Millisecond, constant(20*time.Microsecond))
	warm := s.run(s.now.Add(500 * time.Millisecond))
	got := s.run(s.now.Add(time.Second))
	if got < 50000*95/100 {
		t.Errorf("handled %d in 1 s after %d in the first 0.5 s, want ≥ 95%% of 50,000 (credit now %d)", got, warm, s.a.Limit())
	}
	if l := s.a.Limit(); l < 51 || l > 256 {
		t.Errorf("credit %d, want between the 51 in flight and the ceiling", l)
	}
	// Full rate is reached within 100 ms.
	s2 := newSim(t, 256, 1, time.Millisecond, constant(20*time.Microsecond))
	s2.run(s2.now.Add(100 * time.Millisecond))
	if got := s2.run(s2.now.Add(100 * time.Millisecond)); got < 5000*95/100 {
		t.Errorf("handled %d in the second 100 ms, want ≥ 95%% of 5,000", got)
	}
}

// A ceiling below what the round trip needs is the credit: the Account
// never passes it.
func TestAdaptiveKeepsTheCeiling(t *testing.T) {
	s := newSim(t, 16, 1, time.Millisecond, constant(10*time.Microsecond))
	got := s.run(s.now.Add(time.Second))
	if s.maxCredit != 16 || s.maxHeld > 16 {
		t.Errorf("credit up to %d, held up to %d; want 16", s.maxCredit, s.maxHeld)
	}
	// 16 per round trip of 1 ms plus the handlers' 16 × 10 µs: about
	// 13,800/s.
	if got < 13000 {
		t.Errorf("handled %d in 1 s, want about 13,800", got)
	}
}

// Handlers that slow down mid-run: the credit comes down without a drain
// (it is spent, not taken back), and nothing stalls.
func TestAdaptiveFollowsHandlersThatSlowDown(t *testing.T) {
	slowFrom := time.Unix(1e9, 0).Add(time.Second)
	took := func(now time.Time) time.Duration {
		if now.Before(slowFrom) {
			return 20 * time.Microsecond
		}
		return 10 * time.Millisecond
	}
	s := newSim(t, 256, 4, time.Millisecond, took)
	s.run(slowFrom)
	high := s.a.Limit()
	if high < 100 {
		t.Fatalf("credit %d with fast handlers, want it grown past 100", high)
	}
	s.maxCredit, s.maxHeld = 0, 0
	s.run(slowFrom.Add(2 * time.Second)) // what was held runs down
	s.maxCredit, s.maxHeld = 0, 0
	got := s.run(s.now.Add(time.Second))
	// 4 lanes + ⌈4 × 400/s × 2 ms⌉ = 8.
	if s.maxCredit > 8 || s.maxHeld > 8 {
		t.Errorf("with 10 ms handlers: credit up to %d, held up to %d (from %d); want ≤ 8", s.maxCredit, s.maxHeld, high)
	}
	if got < 400*95/100 {
		t.Errorf("handled %d in 1 s, want ≥ 95%% of 400", got)
	}
}

// Handlers that speed up mid-run: the credit follows within a fraction of
// a second.
func TestAdaptiveFollowsHandlersThatSpeedUp(t *testing.T) {
	fastFrom := time.Unix(1e9, 0).Add(time.Second)
	took := func(now time.Time) time.Duration {
		if now.Before(fastFrom) {
			return 10 * time.Millisecond
		}
		return 20 * time.Microsecond
	}
	s := newSim(t, 256, 4, time.Millisecond, took)
	s.run(fastFrom)
	if l := s.a.Limit(); l > 8 {
		t.Fatalf("credit %d with 10 ms handlers, want ≤ 8", l)
	}
	s.run(fastFrom.Add(200 * time.Millisecond))
	// 4 lanes of 20 µs: 200,000/s, which 256 in flight over 1 ms caps at
	// 256,000/s: the lanes are the limit.
	if got := s.run(s.now.Add(time.Second)); got < 200000*90/100 {
		t.Errorf("handled %d in the second after, want ≥ 90%% of 200,000 (credit %d)", got, s.a.Limit())
	}
}

// An idle link keeps the floor, so that a burst after idle starts every
// lane at once, and the round trip a grant to an empty queue measures
// (the producer's pause) does not inflate the credit.
func TestAdaptiveIdleKeepsTheFloorAndABurstStartsEveryLane(t *testing.T) {
	start := time.Unix(1e9, 0)
	idleFrom, burstAt := start.Add(time.Second), start.Add(6*time.Second)
	s := newSim(t, 256, 8, 500*time.Microsecond, constant(10*time.Millisecond))
	s.backlog = func(now time.Time) bool { return now.Before(idleFrom) || !now.Before(burstAt) }
	s.run(idleFrom)
	s.run(burstAt.Add(-time.Millisecond))
	if l := s.a.Limit(); l != 8 {
		t.Errorf("credit %d after 5 s idle, want the floor of 8", l)
	}
	if out := s.a.Snapshot().Outstanding; int(out)+s.a.Held() < 8 {
		t.Errorf("idle: outstanding %d, held %d; want 8 ready for the lanes", out, s.a.Held())
	}
	// The broker spends the waiting credit at the next tick: all 8 lanes
	// are busy within a tick and a round trip.
	s.run(burstAt.Add(2 * time.Millisecond))
	if s.busy != 8 {
		t.Errorf("%d of 8 lanes busy 2 ms into the burst", s.busy)
	}
	s.maxCredit = 0
	s.run(s.now.Add(time.Second))
	if s.maxCredit > 15 {
		t.Errorf("credit up to %d in the burst after idle, want ≤ 15 (round trip %v)", s.maxCredit, s.a.RoundTrip())
	}
}

// Windowed granting (a broker that overshoots) and a byte budget combine
// with the adaptive limit: the least of them holds.
func TestAdaptiveWithWindowsAndAByteBudget(t *testing.T) {
	a := New(256, Windowed)
	now := time.Unix(1e9, 0)
	a.Adapt(4, func() time.Time { return now })
	a.Attach()
	if g := a.Grant(); g != 4 {
		t.Fatalf("first grant %d, want the floor of 4", g)
	}
	a.SetByteBudget(3000)
	for range 4 {
		a.Received()
		a.ReceivedBytes(1000)
	}
	if g := a.Grant(); g != 0 {
		t.Fatalf("grant %d past the byte budget", g)
	}
	if l := a.Limit(); l != 3 {
		t.Fatalf("limit %d, want the budget's 3", l)
	}
	a.Settled(4)
	a.SettledBytes(4000)
	if g := a.Grant(); g != 3 {
		t.Fatalf("grant %d, want 3 (budget 3000 / 1000 B)", g)
	}
}

// trickle runs a: after idle with nothing sent, a producer sends one
// message every gap, each handled in took, for d. It returns the highest
// limit and held+outstanding seen after the first settle.
func trickle(a *Account, now *time.Time, gap, took, d time.Duration) (most, mostOut int) {
	end := now.Add(d)
	for now.Before(end) {
		if a.Snapshot().Outstanding <= 0 {
			*now = now.Add(gap) // no credit: the next waits for a grant
			a.Grant()
			continue
		}
		a.Received()
		*now = now.Add(took)
		a.Settled(1)
		a.Grant()
		most = max(most, a.Limit())
		mostOut = max(mostOut, int(a.Snapshot().Outstanding)+a.Held())
		*now = now.Add(gap - took)
	}
	return most, mostOut
}

// A subscriber started before its producer: the first grant waits for
// the producer, not for the broker, and is not timed, so a trickle
// afterwards keeps the credit at what its lanes need: floor +
// ⌈4 × 100/s × 2 ms⌉ = floor + 1. Before, the pause (capped at 1 s) was
// the round trip, and the trickle's rate times it held the ceiling.
func TestAdaptiveAnIdleStartDoesNotPinTheCredit(t *testing.T) {
	now := time.Unix(1e9, 0)
	a := adaptiveAt(&now, 256, 8, Continuous)
	if g := a.Grant(); g != 8 {
		t.Fatalf("first grant %d, want the floor", g)
	}
	now = now.Add(3 * time.Second)
	most, mostOut := trickle(a, &now, 10*time.Millisecond, time.Millisecond, time.Second)
	if rtt := a.RoundTrip(); rtt > 10*time.Millisecond || most > 10 || mostOut > 10 {
		t.Fatalf("round trip %v, credit up to %d, held+outstanding up to %d; want ≤ 10 ms and ≤ floor+2", rtt, most, mostOut)
	}
}

// The first timed grant found the queue empty (a burst of exactly the
// first credit, then a pause): its sample counts for at most
// RoundTripCap. Once no grant has confirmed it for RoundTripTTL, the
// Account lets the credit run out and times the next grant: under a
// trickle that is the trickle's gap, which holds about Headroom
// deliveries in flight.
func TestAdaptiveAPauseSampledFirstIsProbedAgain(t *testing.T) {
	now := time.Unix(1e9, 0)
	a := adaptiveAt(&now, 256, 8, Continuous)
	a.Grant()
	for range 8 {
		a.Received()
	}
	now = now.Add(time.Millisecond)
	a.Settled(8)
	a.Grant() // timed: the credit ran out
	now = now.Add(3 * time.Second)
	most, _ := trickle(a, &now, 10*time.Millisecond, time.Millisecond, 500*time.Millisecond)
	if rtt := a.RoundTrip(); rtt != RoundTripCap {
		t.Fatalf("round trip %v after a 3 s pause, want the cap %v", rtt, RoundTripCap)
	}
	// The rate, a count decaying over 100 ms, reads 105/s at 100/s:
	// floor + ⌈4 × 105/s × 100 ms⌉ = 50 at most while the sample lasts.
	if most > 50 {
		t.Fatalf("credit up to %d with the capped sample, want ≤ 50", most)
	}
	trickle(a, &now, 10*time.Millisecond, time.Millisecond, RoundTripTTL+time.Second)
	most, mostOut := trickle(a, &now, 10*time.Millisecond, time.Millisecond, time.Second)
	// The probe's sample is the gap less the handler's 1 ms:
	// floor + ⌈4 × 105/s × 9 ms⌉ = 12.
	if rtt := a.RoundTrip(); rtt > 10*time.Millisecond || most > 12 || mostOut > 12 {
		t.Fatalf("after a probe: round trip %v, credit up to %d, held+outstanding up to %d; want ≤ 10 ms and ≤ 12",
			rtt, most, mostOut)
	}
}

// A low sample is believed at once: every sample is an upper bound of
// the round trip. A high one moves the estimate by an eighth of the gap,
// and counts for at most four times the estimate.
func TestAdaptiveSamplesAreUpperBounds(t *testing.T) {
	now := time.Unix(1e9, 0)
	a := adaptiveAt(&now, 256, 1, Continuous)
	// sample has the link spend its credit, grants at once (timed) and
	// brings the grant's first delivery rtt later.
	sample := func(rtt time.Duration) {
		t.Helper()
		for a.Snapshot().Outstanding > 0 {
			a.Received()
			a.Settled(1)
		}
		if a.Grant() == 0 {
			t.Fatal("no grant with the credit spent")
		}
		now = now.Add(rtt)
		a.Received()
		a.Settled(1)
	}
	a.Grant() // the link's first grant: not timed
	now = now.Add(time.Hour)
	a.Received()
	a.Settled(1)
	if rtt := a.RoundTrip(); rtt != 0 {
		t.Fatalf("round trip %v from the link's first grant, want none", rtt)
	}
	for _, c := range []struct{ sample, want time.Duration }{
		{time.Second, RoundTripCap}, // the first, capped
		{10 * time.Millisecond, 10 * time.Millisecond},
		{18 * time.Millisecond, 11 * time.Millisecond},
		{time.Second, 11*time.Millisecond + 33*time.Millisecond/8}, // 4 × 11 ms at most
	} {
		sample(c.sample)
		if rtt := a.RoundTrip(); rtt != c.want {
			t.Fatalf("round trip %v after a sample of %v, want %v", rtt, c.sample, c.want)
		}
	}
}

// A long round trip that the credit covers is not forgotten at a cost:
// when RoundTripTTL passes without a sample the credit falls, runs out,
// and is sampled again. Two lanes of 1 ms behind 20 ms: the adaptive
// credit drains at least 90% of what a fixed one does.
func TestAdaptiveALongRoundTripKeepsItsRate(t *testing.T) {
	s := newSim(t, 256, 2, 20*time.Millisecond, constant(time.Millisecond))
	s.run(s.now.Add(time.Second))
	got := s.run(s.now.Add(5 * time.Second))
	f := newSim(t, 256, 2, 20*time.Millisecond, constant(time.Millisecond))
	f.a = New(256, Continuous)
	f.a.Attach()
	f.run(f.now.Add(time.Second))
	fixed := f.run(f.now.Add(5 * time.Second))
	t.Logf("adaptive %d, fixed %d in 5 s; round trip %v, credit %d", got, fixed, s.a.RoundTrip(), s.a.Limit())
	if got < fixed*90/100 {
		t.Fatalf("adaptive drained %d in 5 s, fixed %d: want ≥ 90%%", got, fixed)
	}
}

// The adaptive limit under random arrivals, settlements, parked counts,
// clock steps and new links: it stays within [floor, ceiling] and within
// floor + parked + ⌈Headroom × rate × max(round trip, MinRoundTrip)⌉, the
// rate computed here on its own from the settlements (a count decaying
// with DrainWindow); the round trip never exceeds the longest wait
// between a grant and an arrival; what is held and outstanding stays
// within the limit after a grant of more than one (a single credit past
// it is the flow owed after the last settlement, within the ceiling).
func FuzzAdaptiveLimit(f *testing.F) {
	f.Add(uint8(64), uint8(4), []byte{0, 1, 1, 2, 3, 9, 0, 1, 2, 4, 5, 0})
	f.Add(uint8(255), uint8(8), []byte{6, 0, 7, 1, 1, 1, 1, 2, 8, 3, 0, 9, 9, 9, 1})
	f.Fuzz(func(t *testing.T, ceiling, floor uint8, ops []byte) {
		ceil, fl := int(ceiling)+1, int(floor%32)+1
		now := time.Unix(1e9, 0)
		a := New(ceil, Continuous)
		a.Adapt(fl, func() time.Time { return now })
		a.Attach()
		type settled struct {
			at time.Time
			n  int
		}
		var drains []settled
		rate := func() float64 {
			sum := 0.0
			for _, d := range drains {
				sum += float64(d.n) * math.Exp(-float64(now.Sub(d.at))/float64(DrainWindow))
			}
			return sum / DrainWindow.Seconds()
		}
		var granted, arrived int64 // this link
		type grantAt struct {
			end int64
			at  time.Time
		}
		var grants []grantAt // this link's grants not yet covered
		var longest time.Duration
		parked := 0
		for i, op := range ops {
			arg := int(op >> 4)
			switch op % 10 {
			case 0, 8: // a grant
				g := int64(a.Grant())
				if g > 0 {
					granted += g
					grants = append(grants, grantAt{granted, now})
				}
				held, out := int64(a.Held()), granted-arrived
				if held+out > int64(ceil) {
					t.Fatalf("op %d: held %d + outstanding %d past the ceiling %d", i, held, out, ceil)
				}
				if g > 1 && held+out > int64(a.Limit()) {
					t.Fatalf("op %d: a grant of %d left held %d + outstanding %d past the limit %d", i, g, held, out, a.Limit())
				}
				lim := a.Limit()
				if lim < min(fl, ceil) || lim > ceil {
					t.Fatalf("op %d: limit %d outside [%d, %d]", i, lim, min(fl, ceil), ceil)
				}
				rtt := max(a.RoundTrip(), MinRoundTrip)
				bound := fl + parked + int(math.Ceil(Headroom*rate()*rtt.Seconds()+1e-9))
				if lim > bound {
					t.Fatalf("op %d: limit %d past floor %d + parked %d + ⌈4 × %.1f/s × %v⌉ = %d", i, lim, fl, parked, rate(), rtt, bound)
				}
			case 1, 9: // arrivals, within the credit
				for range arg + 1 {
					if arrived < granted {
						arrived++
						for grants[0].end < arrived {
							grants = grants[1:]
						}
						longest = max(longest, now.Sub(grants[0].at)) // from the grant that covers it
						if a.Received() {
							t.Fatal("overshoot reported within credit")
						}
					}
				}
			case 2, 3: // settlements
				if n := min(arg+1, a.Held()); n > 0 {
					a.Settled(n)
					drains = append(drains, settled{now, n})
				}
			case 4, 5: // the clock
				now = now.Add(time.Duration(1<<arg) * 50 * time.Microsecond)
			case 6: // parked
				parked = min(arg, a.Held())
				a.Park(parked)
			case 7: // a new link: what was outstanding is gone
				a.Attach()
				granted, arrived, grants = 0, 0, nil
			}
			if rtt := a.RoundTrip(); rtt > max(longest, time.Microsecond) {
				t.Fatalf("op %d: round trip %v, past the longest wait %v", i, rtt, longest)
			}
		}
	})
}

// After a burst leaves credit in excess, a trickle slower than
// FlowOwedAfter (one message a second) runs it down: the flow owed after
// each last settlement waits longer each time a delivery follows one, so
// it stops adding back what each delivery takes. The pump calls Grant on
// every event and every 10 ms while a flow is owed.
func TestAdaptiveASlowTrickleRunsTheExcessDown(t *testing.T) {
	now := time.Unix(1e9, 0)
	a := adaptiveAt(&now, 256, 8, Continuous)
	a.Grant()
	// A burst: the broker sends what is outstanding, 50 µs apart, each
	// handled at once.
	for end := now.Add(200 * time.Millisecond); now.Before(end); now = now.Add(50 * time.Microsecond) {
		if a.Snapshot().Outstanding > 0 {
			a.Received()
			a.Settled(1)
		}
		a.Grant()
	}
	burst := a.Snapshot().Outstanding
	for range 200 { // the queue is empty, then one message a second
		for end := now.Add(time.Second); now.Before(end); now = now.Add(10 * time.Millisecond) {
			a.Grant()
		}
		if a.Snapshot().Outstanding > 0 {
			a.Received()
			a.Grant()
			now = now.Add(time.Millisecond)
			a.Settled(1)
			a.Grant()
		}
	}
	// One a delivery but for the first few flows owed: 200 deliveries run
	// down the 147 the burst left.
	if out := a.Snapshot().Outstanding; burst < 100 || out > int64(a.Limit())+1 {
		t.Fatalf("outstanding %d after the burst, %d after 200 deliveries at 1/s; limit %d: want the excess run down", burst, out, a.Limit())
	}
}

// windowedTrickle sends one message every gap to a, handled in 1 ms, with
// Grant on every event and every 10 ms, for d; it returns the most held
// and outstanding, and the highest limit.
func windowedTrickle(a *Account, now *time.Time, gap, d time.Duration) (mostOut, mostLimit int) {
	next := now.Add(gap)
	for end := now.Add(d); now.Before(end); {
		if !now.Before(next) {
			next = now.Add(gap)
			if a.Snapshot().Outstanding > 0 {
				a.Received()
				a.Grant()
				*now = now.Add(time.Millisecond)
				a.Settled(1)
			}
		}
		a.Grant()
		mostOut = max(mostOut, int(a.Snapshot().Outstanding)+a.Held())
		mostLimit = max(mostLimit, a.Limit())
		*now = now.Add(10 * time.Millisecond)
	}
	return mostOut, mostLimit
}

// Windowed (RabbitMQ 3.10): every grant is made with the credit spent, so
// every grant is timed, and under a trickle every sample is the
// producer's gap. A sample counts for at most RoundTripCap, so the limit
// a single settlement reads stays floor + ⌈4 × 10/s × 100 ms⌉ = floor + 4.
// Before, a 10 s gap became a 10 s round trip, and the limit the ceiling.
func TestAdaptiveAWindowedTrickleIsNoRoundTrip(t *testing.T) {
	for _, gap := range []time.Duration{time.Second, 10 * time.Second} {
		now := time.Unix(1e9, 0)
		a := adaptiveAt(&now, 256, 4, Windowed)
		a.Grant()
		windowedTrickle(a, &now, gap, 200*gap)
		mostOut, mostLimit := windowedTrickle(a, &now, gap, 100*gap)
		if a.RoundTrip() > RoundTripCap || mostLimit > 4+Headroom+1 || mostOut > 4+Headroom+1 {
			t.Errorf("gap %v: round trip %v, limit up to %d, held+outstanding up to %d; want ≤ %v and ≤ %d",
				gap, a.RoundTrip(), mostLimit, mostOut, RoundTripCap, 4+Headroom+1)
		}
	}
}

// A flow owed that Grant cannot send (a window out) is not reported by
// FlowOwed, so the pump does not tick for it.
func TestFlowOwedOnlyWhenGrantCanSendIt(t *testing.T) {
	now := time.Unix(1e9, 0)
	a := adaptiveAt(&now, 256, 4, Windowed)
	a.Grant() // a window of 4
	a.Received()
	a.Settled(1)
	for range 100 {
		now = now.Add(10 * time.Millisecond)
		if g := a.Grant(); g != 0 {
			t.Fatalf("grant %d with the window out", g)
		}
	}
	if a.FlowOwed() {
		t.Fatalf("FlowOwed with the window out (outstanding %d): nothing Grant could send", a.Snapshot().Outstanding)
	}
}

// adaptiveAt returns an adaptive Account on the clock *now, attached.
func adaptiveAt(now *time.Time, ceiling, floor int, mode Mode) *Account {
	a := New(ceiling, mode)
	a.Adapt(floor, func() time.Time { return *now })
	a.Attach()
	return a
}
