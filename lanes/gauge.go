package lanes

import "sync/atomic"

// Gauge is what the lanes hold and have done, kept up to date by [Run] and
// read from any goroutine.
type Gauge struct {
	lanes  []laneGauge
	keys   atomic.Int64
	parked atomic.Int64 // Balanced: items waiting for the lane that holds their key
}

type laneGauge struct {
	load     atomic.Int64 // items queued or in the handler
	finished atomic.Uint64
	_        [48]byte // a cache line each: lanes update their own
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

// Parked returns the items queued behind a busy lane: over the lanes, what
// each holds past the first need (1 for single items, a batch's size for
// batches), and under Balanced the items waiting for the lane that holds
// their key. Those wait for their own lane, whatever the others do; an
// adaptive credit adds them to what it holds, so that they do not keep
// the free lanes waiting. It does not allocate.
func (g *Gauge) Parked(need int) int {
	n := int(g.parked.Load())
	for i := range g.lanes {
		n += max(0, int(g.lanes[i].load.Load())-need)
	}
	return n
}
