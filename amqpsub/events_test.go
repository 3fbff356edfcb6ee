package amqpsub_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/Azure/go-amqp"

	"github.com/amqpsub/amqpsub/amqpsub"
	"github.com/amqpsub/amqpsub/internal/fake"
)

func TestEventsReachTheHook(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		msgs := fake.Messages(3, "h") // LaneOf("h", 2) == 1: a lane number that can be wrong
		id := "m-1"
		msgs[1].Properties.MessageID = id
		msgs[1].Header = &amqp.MessageHeader{DeliveryCount: 2}
		first := fake.New(true, msgs...)
		second := fake.New(true)
		boom := errors.New("store down")
		var mu sync.Mutex
		var got []amqpsub.Event
		var calls [3]atomic.Int64 // the fake broker redelivers without counting
		s, _ := amqpsub.New(amqpsub.SourcesOf(sources(first, second)), "orders", amqpsub.HandlerFunc(func(_ context.Context, d *amqpsub.Delivery) error {
			first := calls[index(d)].Add(1) == 1
			switch {
			case index(d) == 1 && first:
				return boom
			case index(d) == 2 && first:
				panic("bad")
			}
			return nil
		}), amqpsub.WorkersByKey(2), amqpsub.Backoff(time.Millisecond, time.Millisecond),
			amqpsub.OnEvent(func(e amqpsub.Event) {
				mu.Lock()
				got = append(got, e)
				mu.Unlock()
			}))
		cancel, errc := run(t, s)
		synctest.Wait()
		first.Fail(fake.ErrLinkLost)
		synctest.Wait()
		time.Sleep(time.Second)
		cancel()
		if err := <-errc; err != nil {
			t.Fatal(err)
		}
		mu.Lock()
		defer mu.Unlock()
		var kinds []string
		for _, e := range got {
			kinds = append(kinds, e.Kind.String())
		}
		// The panic also ends as a failed attempt sent to the broker.
		want := "[handler-failed handler-panicked handler-failed link-lost reconnected]"
		if fmt.Sprint(kinds) != want {
			t.Fatalf("events %v, want %s", kinds, want)
		}
		if e := got[0]; e.MessageID != id || e.GroupID != "h" || e.DeliveryCount != 2 || e.Lane != 1 ||
			e.Queue != "orders" || !errors.Is(e.Err, boom) {
			t.Fatalf("first event %+v", e)
		}
		if e := got[1]; !errors.Is(e.Err, amqpsub.ErrHandlerPanic) {
			t.Fatalf("panic event %+v", e)
		}
		if e := got[4]; e.Attempt != 1 || !errors.Is(e.Err, fake.ErrLinkLost) {
			t.Fatalf("reconnect event %+v", e)
		}
	})
}
