package amqpsub

import (
	"context"
	"time"

	"github.com/amqpsub/amqpsub/internal/backoff"
)

// retry says whether and when a failed delivery is retried in the lane.
type retry struct {
	p     RetryPolicy
	until time.Time // end of the budget; zero: none
}

func (s *Subscriber) retrier() retry {
	r := retry{p: s.cfg.localRetry}
	if r.p.Budget > 0 {
		r.until = time.Now().Add(r.p.Budget)
	}
	return r
}

// allows reports whether retry number attempt (from 1) is within the
// policy.
func (r retry) allows(attempt int) bool {
	if r.p.Attempts == 0 && r.p.Budget == 0 {
		return false // LocalRetry off
	}
	if r.p.Attempts > 0 && attempt > r.p.Attempts {
		return false
	}
	return r.until.IsZero() || time.Now().Before(r.until)
}

func isRetry(err error) bool {
	kind, _ := decide(err)
	return kind == ResultRetry
}

// wait returns the wait before retry number attempt, within the budget.
func (r retry) wait(attempt int) time.Duration {
	w := backoff.Ceiling(attempt-1, r.p.Initial, r.p.Max)
	if !r.until.IsZero() {
		w = min(w, max(0, time.Until(r.until)))
	}
	return w
}

// pause waits d before a retry in the lane; false means the subscriber is
// stopping and the retry goes to the broker instead.
//
// It returns true early when the link is lost meanwhile: the caller then
// finds its delivery stale.
func (s *Subscriber) pause(ctx context.Context, p *pipe, d time.Duration) bool {
	var down <-chan struct{}
	if !p.keeps { // a lost link leaves nothing stale when the pipe keeps its deliveries
		down = *p.linkDown.Load()
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-down:
		return true
	case <-ctx.Done():
	case <-p.pump.Stopping():
	}
	return false
}
