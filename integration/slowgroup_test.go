package integration

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/amqpsub/amqpsub/amqpsub"
)

// One slow group (50 ms a message) among 100 groups of 1 ms handlers, on 8
// lanes: how long do the other 99 take to be fully handled, against the
// same run without the slow group? Under the hash placement the groups
// that hash to the slow group's lane wait behind it; under BalanceKeys
// they go to the other lanes. The credit bounds how much of the slow
// group's backlog the process holds (see docs/performance.md).
func TestArtemisSlowGroup(t *testing.T) {
	url := artemisURL(t)
	const n, groupsN = 10000, 100
	run := func(t *testing.T, balanced, slow bool) time.Duration {
		q := queueName(t)
		conn := dial(t, url)
		msgs := groups(n, groupsN)
		publishFast(t, conn, q, true, msgs)
		var mu sync.Mutex
		othersLeft := n - n/groupsN
		var start, othersDone time.Time
		check := newOrderChecker()
		check.moves = balanced
		s, _ := amqpsub.New(amqpsub.Dial(url, nil), q, amqpsub.HandlerFunc(func(ctx context.Context, d *amqpsub.Delivery) error {
			if seqOf(d) == -1 {
				return nil
			}
			mu.Lock()
			if start.IsZero() {
				start = time.Now()
			}
			mu.Unlock()
			check.enter(t, d.GroupID())
			defer check.leave(d.GroupID())
			if slow && d.GroupID() == "g000" {
				time.Sleep(50 * time.Millisecond)
			} else {
				time.Sleep(time.Millisecond)
			}
			check.record(t, d)
			mu.Lock()
			if d.GroupID() != "g000" {
				if othersLeft--; othersLeft == 0 {
					othersDone = time.Now()
				}
			}
			mu.Unlock()
			return nil
		}), amqpsub.WorkersByKey(8), placement(balanced), amqpsub.Logger(logger(t)))
		stop, wait := runSub(t, s)
		waitFor(t, 3*time.Minute, "the other 99 groups", func() bool {
			mu.Lock()
			defer mu.Unlock()
			return !othersDone.IsZero()
		})
		stop()
		if err := wait(); err != nil {
			t.Fatal(err)
		}
		if check.violations != 0 || check.dups != 0 {
			t.Fatalf("%d order violations, %d duplicates", check.violations, check.dups)
		}
		return othersDone.Sub(start)
	}
	for _, balanced := range []bool{false, true} {
		t.Run(fmt.Sprintf("balanced=%v", balanced), func(t *testing.T) {
			without := run(t, balanced, false)
			with := run(t, balanced, true)
			ratio := with.Seconds() / without.Seconds()
			t.Logf("the other 99 groups: %v without the slow group, %v with it (%.2f×)", without.Round(time.Millisecond), with.Round(time.Millisecond), ratio)
			if balanced && ratio > 1.3 {
				t.Fatalf("with BalanceKeys the slow group held the others back %.2f×, want ≤ 1.3×", ratio)
			}
		})
	}
}
