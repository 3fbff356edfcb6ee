// Package wait holds the small waits on channels and clocks that amqpsub,
// its pump and its Service Bus support share.
package wait

import (
	"context"
	"time"
)

// Closed reports, without blocking, whether c is closed.
func Closed(c <-chan struct{}) bool {
	select {
	case <-c:
		return true
	default:
		return false
	}
}

// Sleep waits d or until ctx ends; false means ctx ended.
func Sleep(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}

// Until waits for c to be closed until by, or until stop is closed (nil:
// never); it reports whether c was closed.
func Until(c <-chan struct{}, by time.Time, stop <-chan struct{}) bool {
	t := time.NewTimer(time.Until(by))
	defer t.Stop()
	select {
	case <-c:
		return true
	case <-t.C:
		return false
	case <-stop:
		return Closed(c)
	}
}
