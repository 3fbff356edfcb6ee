package lanes

import (
	"time"
)

// batchLoop assembles the items of one lane or worker into batches and
// hands them to HandleBatch: a batch closes when it is full, when
// BatchWait has passed since its first item, or, with no wait (or once
// Flush is closed), as soon as nothing more is waiting. At a stop the open
// batch is dropped.
func (r *runner[T]) batchLoop(lane int, f feed[T]) {
	// The dispatcher counted a hash lane's items already.
	_, counted := f.(*queue[T])
	cfg := r.cfg
	b := newBatcher[T](cfg.BatchSize, cfg.BatchWait)
	timer := time.NewTimer(time.Hour)
	timer.Stop()
	defer timer.Stop()
	armed := false
	var keys []string // the keys of a batch handed over, for finish
	flush := func() {
		if armed {
			timer.Stop()
			armed = false
		}
		r.handOver(lane, b.flush(), &keys)
	}
	add := func(item T) {
		if !counted {
			r.gauge.lanes[lane].load.Add(1)
		}
		var now time.Time
		if b.count() == 0 && cfg.BatchWait > 0 {
			now = time.Now()
		}
		b.add(now, item)
	}
	stop := cfg.Stop
	for {
		// Take what is waiting, up to a full batch, without waiting.
		for b.count() < cfg.BatchSize {
			item, st := f.poll()
			if st == closed {
				flush()
				return
			}
			if st != got {
				break
			}
			add(item)
		}
		if b.count() >= cfg.BatchSize || b.count() > 0 && (cfg.BatchWait == 0 || r.stopped() || r.flushing()) {
			flush()
			continue
		}
		var fire <-chan time.Time
		var flushing <-chan struct{}
		if b.count() > 0 {
			flushing = cfg.Flush
			if !armed {
				d, _ := b.untilNext(time.Now())
				if d <= 0 {
					flush()
					continue
				}
				timer.Reset(d)
				armed = true
			}
			fire = timer.C
		}
		item, st := f.wait(fire, flushing, stop)
		switch st {
		case got:
			add(item)
		case closed:
			flush()
			return
		case timedOut:
			armed = false
			flush()
		case stopping:
			// The open batch was never given to a handler: drop it now.
			stop = nil
			if armed {
				timer.Stop()
				armed = false
			}
			for _, it := range b.flush() {
				r.drop(lane, it)
			}
		}
	}
}

// handOver gives a closed batch to HandleBatch, after passing to Drop the
// items that must not be handled (stopping, or refused by Take).
func (r *runner[T]) handOver(lane int, items []T, scratch *[]string) {
	if len(items) == 0 {
		return
	}
	if r.stopped() {
		for _, it := range items {
			r.drop(lane, it)
		}
		return
	}
	keep := items[:0]
	for _, it := range items {
		if r.cfg.Take != nil && !r.cfg.Take(it) {
			r.drop(lane, it)
			continue
		}
		keep = append(keep, it)
	}
	if len(keep) > 0 {
		keys := (*scratch)[:0]
		for _, it := range keep {
			keys = append(keys, r.keyOf(it))
		}
		*scratch = keys
		if r.keyed() {
			r.gauge.begin(lane, len(keep))
			r.cfg.HandleBatch(lane, keep)
			r.gauge.end(lane)
		} else {
			r.cfg.HandleBatch(lane, keep)
		}
		for _, k := range keys {
			r.finish(lane, k)
		}
	}
}
