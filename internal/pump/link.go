package pump

import (
	"context"
	"sync"

	"github.com/amqpsub/amqpsub/internal/driver"
	"github.com/amqpsub/amqpsub/internal/wait"
)

// attach asks for a source while still applying settlements (which, for
// deliveries of a lost link, only free their entries). After Stop it waits
// for nothing held and returns ErrStopped.
func (p *Pump) attach(ctx context.Context, attach AttachFunc, lost error) (driver.Source, error) {
	actx, cancel := context.WithCancel(ctx)
	defer cancel()
	type result struct {
		src driver.Source
		err error
	}
	res := make(chan result, 1)
	var wg sync.WaitGroup
	wg.Go(func() {
		src, err := attach(actx, lost)
		res <- result{src, err}
	})
	defer wg.Wait()
	stop, hold := p.stop, p.hold
	for {
		// Without a link nothing more arrives: Hold's wait is for what is
		// held to be settled (or, stale, dropped) only.
		if hold == nil && p.acct.Held() == 0 {
			p.markEmptied()
		}
		select {
		case r := <-res:
			if r.err != nil {
				if wait.Closed(p.stop) {
					p.markQuiet()
					return nil, p.waitIdle(ctx)
				}
				return nil, r.err
			}
			p.links.Next()
			p.acct.Attach()
			p.stats.links.Add(1)
			return r.src, nil
		case <-p.settle.wake:
			p.applyQueued(ctx)
		case <-hold:
			hold = nil
		case <-stop:
			// Without a link there is nothing to release: what Out holds
			// is stale, and is dropped by waitIdle (under LeasesOutliveLinks,
			// released through its source by waitIdle).
			stop = nil
			cancel()
			p.markReleased()
			p.markQuiet()
		case <-ctx.Done():
			cancel()
			return nil, ctx.Err()
		}
	}
}

// waitIdle applies settlements until nothing is held. What waits in the
// pump and Out is dropped, or, under LeasesOutliveLinks, released through
// the source it came from.
func (p *Pump) waitIdle(ctx context.Context) error {
	kind := driver.Drop
	if p.cfg.LeasesOutliveLinks {
		kind = driver.Release
		p.releaseBuffered(ctx)
	} else {
		p.dropBacklog()
	}
	for p.acct.Held() > 0 {
		select {
		case t := <-p.out:
			p.Settle(t, driver.Outcome{Kind: kind})
			p.applyQueued(ctx)
		case <-p.settle.wake:
			p.applyQueued(ctx)
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	return ErrStopped
}
