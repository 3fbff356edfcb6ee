//go:build unix

package artemistest

import (
	"context"
	"errors"
	"fmt"
	"os"
	"syscall"
	"time"
)

// lockFile takes an exclusive flock(2) on path, as flock(1) in our
// scripts does, trying every 100 ms until ctx ends (flock itself cannot
// be cancelled). The lock goes with the process, so a crashed holder
// never blocks the others.
func lockFile(ctx context.Context, path string) (unlock func(), err error) {
	f, err := os.OpenFile(path, os.O_CREATE|os.O_RDWR, 0o600) //nolint:gosec // G304: the lock file in the cache dir
	if err != nil {
		return nil, fmt.Errorf("artemistest: lock file: %w", err)
	}
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	for {
		err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB)
		if err == nil {
			return func() { _ = f.Close() }, nil // closing releases the lock
		}
		if !errors.Is(err, syscall.EWOULDBLOCK) && !errors.Is(err, syscall.EINTR) {
			_ = f.Close()
			return nil, fmt.Errorf("artemistest: locking %s: %w", path, err)
		}
		select {
		case <-ctx.Done():
			_ = f.Close()
			return nil, fmt.Errorf("artemistest: waiting for the lock %s: %w", path, ctx.Err())
		case <-tick.C:
		}
	}
}
