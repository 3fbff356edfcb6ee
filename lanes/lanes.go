// Package lanes fans a stream of deliveries out to handlers.
//
// Two shapes:
//   - By key (Config.Key set): n lanes, each a goroutine that runs its
//     items one at a time, in arrival order. An item goes to the lane its key
//     hashes to (xxhash mod n); items without a key rotate over the lanes.
//     Each lane's queue is as deep as the stream (the credit), so one slow
//     lane's backlog never blocks dispatch to the others while credit lasts.
//   - Unordered (no Key): n workers take items from the stream as they come.
//
// With BatchSize > 1 each lane or worker assembles its own batches (package
// batch), so under a key the order within a lane holds across batches.
//
// Run owns every goroutine it starts and returns only when all have ended:
// once the input is closed and every item has gone to Handle, HandleBatch or
// Drop.
package lanes

import (
	"sync"
	"time"

	"github.com/cespare/xxhash/v2"

	"github.com/amqpsub/amqpsub/batch"
)

// Config says how Run spreads items. Handle or HandleBatch is required.
type Config[T any] struct {
	// Lanes is the number of lanes or workers. Required, ≥ 1.
	Lanes int
	// Key, when set, gives an item's key and turns on keyed lanes. An empty
	// key counts as none.
	Key func(T) string
	// Depth is the queue depth of each keyed lane; it should be the credit.
	// 0 means the capacity of the input channel.
	Depth int
	// BatchSize > 1 hands items to HandleBatch in batches of up to this many.
	BatchSize int
	// BatchWait closes a batch this long after its first item. Used with
	// BatchSize > 1.
	BatchWait time.Duration
	// Stop, when closed, makes lanes pass every item not yet given to a
	// handler to Drop instead. nil never closes.
	Stop <-chan struct{}
	// Skip reports items to pass to Drop unhandled, such as deliveries of a
	// lost link. nil skips none.
	Skip func(T) bool

	Handle      func(lane int, item T)
	HandleBatch func(lane int, items []T)
	Drop        func(item T)
}

// Run spreads the items of in over the lanes until in is closed and every
// lane is done.
func Run[T any](in <-chan T, cfg Config[T]) {
	if cfg.Lanes < 1 {
		panic("lanes: Lanes < 1")
	}
	if cfg.Skip == nil {
		cfg.Skip = func(T) bool { return false }
	}
	var wg sync.WaitGroup
	if cfg.Key == nil {
		for i := range cfg.Lanes {
			wg.Go(func() { runLane(i, in, &cfg) })
		}
		wg.Wait()
		return
	}
	depth := cfg.Depth
	if depth == 0 {
		depth = max(1, cap(in))
	}
	queues := make([]chan T, cfg.Lanes)
	for i := range queues {
		queues[i] = make(chan T, depth)
		wg.Go(func() { runLane(i, queues[i], &cfg) })
	}
	dispatch(in, queues, &cfg)
	for _, q := range queues {
		close(q)
	}
	wg.Wait()
}

// dispatch routes each item to its lane until in is closed. Once Stop is
// closed it empties every lane's queue into Drop, so the deliveries queued
// behind a handler that is still running go back at once rather than when
// it returns, and drops whatever else arrives.
func dispatch[T any](in <-chan T, queues []chan T, cfg *Config[T]) {
	n := uint64(len(queues))
	var next uint64
	stop, stopped := cfg.Stop, false
	for {
		select {
		case item, ok := <-in:
			if !ok {
				return
			}
			if stopped {
				cfg.Drop(item)
				continue
			}
			var lane uint64
			if k := cfg.Key(item); k != "" {
				lane = xxhash.Sum64String(k) % n
			} else {
				lane = next % n
				next++
			}
			queues[lane] <- item
		case <-stop:
			stop, stopped = nil, true
			for _, q := range queues {
				for drained := false; !drained; {
					select {
					case item := <-q:
						cfg.Drop(item)
					default:
						drained = true
					}
				}
			}
		}
	}
}

// LaneOf returns the lane a key goes to among n lanes, as Run routes it.
// Empty keys rotate and have no fixed lane: LaneOf returns -1 for them.
func LaneOf(key string, n int) int {
	if key == "" {
		return -1
	}
	return int(xxhash.Sum64String(key) % uint64(n))
}

func stopped(stop <-chan struct{}) bool {
	select {
	case <-stop:
		return true
	default:
		return false
	}
}

func runLane[T any](lane int, in <-chan T, cfg *Config[T]) {
	if cfg.BatchSize <= 1 {
		for item := range in {
			if stopped(cfg.Stop) || cfg.Skip(item) {
				cfg.Drop(item)
				continue
			}
			cfg.Handle(lane, item)
		}
		return
	}
	runBatchLane(lane, in, cfg)
}

func runBatchLane[T any](lane int, in <-chan T, cfg *Config[T]) {
	b := batch.New[T](cfg.BatchSize, cfg.BatchWait)
	timer := time.NewTimer(time.Hour)
	timer.Stop()
	defer timer.Stop()
	armed := false
	flush := func() {
		if armed {
			timer.Stop()
			armed = false
		}
		items := b.Flush()
		if len(items) == 0 {
			return
		}
		if stopped(cfg.Stop) {
			for _, it := range items {
				cfg.Drop(it)
			}
			return
		}
		cfg.HandleBatch(lane, items)
	}
	stop := cfg.Stop
	for {
		if b.Len() > 0 && !armed {
			d, _ := b.UntilNext(time.Now())
			if d <= 0 {
				flush()
				continue
			}
			timer.Reset(d)
			armed = true
		}
		var fire <-chan time.Time
		if armed {
			fire = timer.C
		}
		select {
		case item, ok := <-in:
			if !ok {
				flush()
				return
			}
			if stopped(cfg.Stop) || cfg.Skip(item) {
				cfg.Drop(item)
				continue
			}
			if b.Add(time.Now(), item) {
				flush()
			}
		case <-fire:
			armed = false
			flush()
		case <-stop:
			// Items still in the open batch were never given to a handler.
			stop = nil
			flush()
		}
	}
}
