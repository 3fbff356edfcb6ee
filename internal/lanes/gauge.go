package lanes

import (
	"sync/atomic"
	"time"
)

// Gauge is what the lanes hold and have done, kept up to date by [Run] and
// read from any goroutine.
type Gauge struct {
	lanes []laneGauge
	seen  []seenCall // what readers saw of each lane's call: see Parked
	keys  atomic.Int64
	base  time.Time // the origin of the calls' clock (monotonic)
}

type laneGauge struct {
	load     atomic.Int64 // items queued or in the handler
	finished atomic.Uint64
	// Under a key only:
	parked atomic.Int64  // items behind an earlier item of their key, in the lane (hash) or waiting for it (Balanced)
	inCall atomic.Int64  // items in the handler call now
	calls  atomic.Uint64 // handler calls begun
	// took is the lane's mean call duration in nanoseconds, a moving
	// average over about 16 calls (2 timed ones); 0 before any. Each lane keeps its
	// own, on its own cache line: one mean written by every lane moved a
	// cache line between cores on every call.
	took atomic.Int64
	// timed is when the call being timed began (ns since base), 0 when
	// the current call is not timed. Only the lane's goroutine uses it.
	timed int64
	_     [8]byte // a cache line each: lanes update their own
}

// seenCall is, for one lane, the call a reader of the gauge last saw in
// progress, and when it first saw it.
type seenCall struct {
	call atomic.Uint64
	at   atomic.Int64 // ns since base
}

// timeEvery is how many of a lane's calls are timed for the mean: one in
// timeEvery, the lane's first among them. A clock read is tens of
// nanoseconds here, as much as the rest of a no-op call's bookkeeping, and
// a mean needs no more.
const timeEvery = 8

// StallAfter is the least time a lane's handler call must have run
// for the lane to count as stalled (see [Gauge.Parked]); it is also at
// least four times the calls' mean duration.
const StallAfter = time.Millisecond

// now returns the calls' clock: nanoseconds since the gauge's base, at
// least 1. time.Since of a monotonic time reads only the monotonic clock,
// at about half the cost of time.Now.
func (g *Gauge) now() int64 { return max(1, int64(time.Since(g.base))) }

// begin records that lane's handler call of n items begins. Only the
// lane's goroutine calls it, and end.
func (g *Gauge) begin(lane, n int) {
	l := &g.lanes[lane]
	c := l.calls.Add(1)
	l.inCall.Store(int64(n))
	if c%timeEvery == 1 {
		l.timed = g.now()
	}
}

// end records that lane's call ended; a timed call's duration goes into
// the lane's mean.
func (g *Gauge) end(lane int) {
	l := &g.lanes[lane]
	l.inCall.Store(0)
	if l.timed == 0 {
		return
	}
	d := max(0, g.now()-l.timed)
	l.timed = 0
	// A call counts for at most four times the mean, the stall threshold:
	// one very long call (a handler that waited out its ctx) would
	// otherwise raise the mean so far that no stall is seen for minutes,
	// and the mean moves only as calls end, which a stall stops. A lane's
	// first timed call is held to the other lanes' mean in the same way.
	m := l.took.Load()
	if m == 0 {
		if t := g.took(); t > 0 {
			d = min(d, 4*t)
		}
		l.took.Store(max(1, d))
		return
	}
	d = min(d, 4*m)
	// Each timed call stands for timeEvery calls: the mean moves as far
	// as a mean over about 16 calls would.
	l.took.Store(max(1, m+(d-m)*timeEvery/16))
}

// took returns the calls' mean duration in nanoseconds: the mean of the
// lanes' means, over the lanes that have timed a call; 0 before any has.
func (g *Gauge) took() int64 {
	var sum, n int64
	for i := range g.lanes {
		if m := g.lanes[i].took.Load(); m > 0 {
			sum += m
			n++
		}
	}
	if n == 0 {
		return 0
	}
	return sum / n
}

// NewGauge returns a [Gauge] for n lanes.
func NewGauge(n int) *Gauge {
	return &Gauge{lanes: make([]laneGauge, n), seen: make([]seenCall, n), base: time.Now()}
}

// Reading is a [Gauge]'s values at one moment, lane by lane.
type Reading struct {
	// Load is each lane's items queued or in its handler.
	Load []int
	// Finished is each lane's items handled or dropped, in all.
	Finished []uint64
	// Keys is the number of keys with items in the lanes (Balanced only).
	Keys int
}

// Read returns the gauge's values.
func (g *Gauge) Read() Reading {
	r := Reading{Load: make([]int, len(g.lanes)), Finished: make([]uint64, len(g.lanes)), Keys: int(g.keys.Load())}
	for i := range g.lanes {
		r.Load[i] = int(g.lanes[i].load.Load())
		r.Finished[i] = g.lanes[i].finished.Load()
	}
	return r
}

// Parked returns, as of now, the items that wait behind an earlier item of
// their own key (group), and of those and the others, the items that wait
// behind a stalled call (stalled):
//
//   - under the hash placement, an item with an earlier item of its key in
//     its lane (queued, in the handler, or in the same batch) waits behind
//     its group; under Balanced, an item waiting in the pool for the lane
//     that holds its key;
//   - a lane's call is stalled once it has run for longer than four times
//     the calls' mean duration (the mean of the lanes' means), and at least
//     [StallAfter] (a slow or stuck call): what waits for that lane is
//     stalled, all that is queued in it under the hash placement, whatever
//     its key. Until a first call has ended there is no mean, and nothing
//     is stalled;
//   - unordered workers park nothing.
//
// A call is timed from the first time Parked sees it running, not from
// its start: lanes do not read the clock for each call. The pump reads the
// gauge on each turn of its loop and every 10 ms while it holds a
// delivery, so a stall is seen that much late at most; a gauge read only
// by Stats sees a call from the first Stats during it.
//
// A keyless item, or one with nothing earlier of its key in its lane,
// waits behind a lane of normal pace only as long as the lanes' load
// says: it is not parked, since an adaptive credit that held such waits
// on top would feed on its own backlog. group counts the items not
// stalled. It does not allocate.
func (g *Gauge) Parked(now time.Time) (group, stalled int) {
	took := g.took()
	stall := max(int64(StallAfter), 4*took)
	at := int64(now.Sub(g.base))
	for i := range g.lanes {
		l := &g.lanes[i]
		p := l.parked.Load()
		if l.inCall.Load() > 0 {
			c, s := l.calls.Load(), &g.seen[i]
			if s.call.Load() != c {
				// The time first, then the call: a reader in between
				// sees the old call, not the new one with the old
				// call's time. The gauge's own clock, not the
				// reader's now, which may be older than the call.
				s.at.Store(max(at, g.now()))
				s.call.Store(c)
			} else if took > 0 && at-s.at.Load() > stall {
				stalled += int(max(p, l.load.Load()-l.inCall.Load()))
				continue
			}
		}
		group += int(p)
	}
	return group, stalled
}
