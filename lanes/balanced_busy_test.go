package lanes_test

import (
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/amqpsub/amqpsub/lanes"
)

// A batch lane running its handler is not on the pool's idle list: the
// next key goes to the lane that is really idle, not to it (it was, when
// a poll that found nothing left it listed as idle).
func TestBalancedBusyBatchLaneIsNotWokenForANewKey(t *testing.T) {
	for _, wait := range []time.Duration{time.Millisecond, 0} {
		t.Run(wait.String(), func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				start := time.Now()
				in := make(chan item)
				var mu sync.Mutex
				at := map[string]time.Duration{}
				release := make(chan struct{})
				cfg := lanes.Config[item]{Lanes: 2, Key: keyOf, Balanced: true,
					BatchSize: 10, BatchWait: wait,
					HandleBatch: func(_ int, items []item) {
						mu.Lock()
						at[items[0].key] = time.Since(start)
						mu.Unlock()
						if items[0].key == "a" {
							<-release // a slow handler: 1 min
						}
					},
					Drop: func(item) {}}
				done := make(chan struct{})
				go func() { defer close(done); lanes.Run(in, cfg) }()
				go func() { time.Sleep(time.Minute); close(release) }()
				synctest.Wait()
				in <- item{"a", 0}
				time.Sleep(10 * time.Millisecond) // a's batch closes and its handler runs
				in <- item{"b", 0}
				time.Sleep(10 * time.Millisecond)
				mu.Lock()
				_, ok := at["b"]
				mu.Unlock()
				<-release
				synctest.Wait()
				close(in)
				<-done
				mu.Lock()
				defer mu.Unlock()
				t.Logf("BatchWait %v: a at %v, b at %v", wait, at["a"], at["b"])
				if !ok {
					t.Errorf("BatchWait %v: b handled at %v (a at %v): it waited for a's handler while the other lane was idle", wait, at["b"], at["a"])
				}
			})
		})
	}
}
