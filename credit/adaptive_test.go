package credit

import (
	"container/heap"
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
