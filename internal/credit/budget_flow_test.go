package credit_test

import (
	"testing"
	"time"

	"github.com/amqpsub/amqpsub/internal/credit"
)

// A byte budget of 1000 B, then a long run of 1000 B messages each settled
// before the next arrives: the outstanding credit runs down to the
// budget's 1, then stays there. The flow owed after the last settlement
// (a credit past the limit, for a paused Artemis queue) is not granted
// under a byte budget: when it was, it topped the credit up by one at
// every settlement that emptied the process, so it never ran down.
func TestFlowOwedKeepsTheByteBudget(t *testing.T) {
	for _, adapt := range []bool{false, true} {
		a := credit.New(64, credit.Continuous)
		a.SetByteBudget(1000)
		if adapt {
			now := time.Unix(0, 0)
			a.Adapt(64, func() time.Time { return now }) // floor at the ceiling: same as fixed
		}
		granted := int64(a.Grant())
		received := int64(0)
		recv := func(size int64) {
			a.Received()
			a.ReceivedBytes(size)
			received++
		}
		recv(10)
		a.Settled(1)
		a.SettledBytes(10)
		granted += int64(a.Grant())
		for range 1000 {
			recv(1000)
			a.Settled(1)
			a.SettledBytes(1000)
			granted += int64(a.Grant())
		}
		out := granted - received
		t.Logf("adapt=%v: after 1000 messages of the budget's size, outstanding %d, Limit() %d", adapt, out, a.Limit())
		if out > 1 {
			// the handler now stalls: the broker sends what it has credit for
			for range out {
				recv(1000)
			}
			_, most := a.BytesHeld()
			t.Errorf("adapt=%v: outstanding %d long after the run of large messages began; then %d B held against a 1000 B budget", adapt, out, most)
		}
	}
}
