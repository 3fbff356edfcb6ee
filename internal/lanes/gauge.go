package lanes

import (
	"sync/atomic"
	"time"
)

// Gauge is what the lanes hold and have done, kept up to date by [Run] and
// read from any goroutine.
type Gauge struct {
	lanes []laneGauge
	keys  atomic.Int64
	// took is the handler calls' mean duration in nanoseconds (under a
	// key: a moving average over about 16 calls), 0 before any.
	took atomic.Int64
}

type laneGauge struct {
	load     atomic.Int64 // items queued or in the handler
	finished atomic.Uint64
	// Under a key only:
	parked atomic.Int64 // items behind an earlier item of their key, in the lane (hash) or waiting for it (Balanced)
	inCall atomic.Int64 // items in the handler call now
	since  atomic.Int64 // when that call began (Unix nanoseconds); 0: none
	_      [24]byte     // a cache line each: lanes update their own
}

// StallAfter is the least time a lane's handler call must have run
// for the lane to count as stalled (see [Gauge.Parked]); it is also at
// least four times the calls' mean duration.
const StallAfter = time.Millisecond

// begin records that lane's handler call of n items begins at now.
func (g *Gauge) begin(lane, n int, now time.Time) {
	l := &g.lanes[lane]
	l.inCall.Store(int64(n))
	l.since.Store(now.UnixNano())
}

// end records that lane's call ended at now, and takes its duration into
// the mean. Lanes end calls concurrently: an update lost to another is
// harmless, the mean being an estimate.
func (g *Gauge) end(lane int, now time.Time) {
	l := &g.lanes[lane]
	d := max(0, now.UnixNano()-l.since.Load())
	l.since.Store(0)
	l.inCall.Store(0)
	m := g.took.Load()
	if m == 0 {
		g.took.Store(max(1, d))
		return
	}
	// A call counts for at most four times the mean, the stall threshold:
	// one very long call (a handler that waited out its ctx) would
	// otherwise raise the mean so far that no stall is seen for minutes,
	// and the mean moves only as calls end, which a stall stops.
	d = min(d, 4*m)
	g.took.Store(max(1, m+(d-m)/16))
}

// NewGauge returns a [Gauge] for n lanes.
func NewGauge(n int) *Gauge { return &Gauge{lanes: make([]laneGauge, n)} }

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
//     the calls' mean duration, and at least [StallAfter] (a slow or stuck
//     call): what waits for that lane is stalled, all that is queued in it
//     under the hash placement, whatever its key. Until a first call has
//     ended there is no mean, and nothing is stalled;
//   - unordered workers park nothing.
//
// A keyless item, or one with nothing earlier of its key in its lane,
// waits behind a lane of normal pace only as long as the lanes' load
// says: it is not parked, since an adaptive credit that held such waits
// on top would feed on its own backlog. group counts the items not
// stalled. It does not allocate.
func (g *Gauge) Parked(now time.Time) (group, stalled int) {
	took := g.took.Load()
	stall := max(int64(StallAfter), 4*took)
	at := now.UnixNano()
	for i := range g.lanes {
		l := &g.lanes[i]
		p := l.parked.Load()
		if since := l.since.Load(); took > 0 && since != 0 && at-since > stall {
			stalled += int(max(p, l.load.Load()-l.inCall.Load()))
			continue
		}
		group += int(p)
	}
	return group, stalled
}
