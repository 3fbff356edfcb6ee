package amqpsub_test

import (
	"context"
	"math"
	"testing"
	"testing/synctest"

	"github.com/amqpsub/amqpsub/amqpsub"
	"github.com/amqpsub/amqpsub/internal/fake"
)

// MaxHeldBytes(n) with a large n (math.MaxInt64 as "no practical bound")
// must not bound the process more tightly than a small one.
func TestMaxHeldBytesTooLargeToScaleIsUnbounded(t *testing.T) {
	for _, n := range []int64{1 << 40, math.MaxInt64} {
		synctest.Test(t, func(t *testing.T) {
			msgs := fake.Messages(100)
			for _, m := range msgs {
				m.Data = [][]byte{make([]byte, 10)}
			}
			src := fake.New(true, msgs...)
			release := make(chan struct{})
			s, err := amqpsub.New(amqpsub.SourceOf(src), "q", amqpsub.HandlerFunc(func(context.Context, *amqpsub.Delivery) error {
				<-release
				return nil
			}), amqpsub.Credit(256), amqpsub.MaxHeldBytes(n))
			if err != nil {
				t.Fatal(err)
			}
			cancel, errc := run(t, s)
			for range 20 { // let a few round trips of credit happen
				synctest.Wait()
			}
			st := s.Stats()
			close(release)
			cancel()
			<-errc
			t.Logf("MaxHeldBytes(%d): held %d of 100 (bytes %d)", n, st.Held, st.BytesHeld)
			if st.Held != 100 {
				t.Errorf("MaxHeldBytes(%d): held %d, want all 100 (1000 bytes, far under the budget)", n, st.Held)
			}
		})
	}
}
