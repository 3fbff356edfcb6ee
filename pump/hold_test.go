package pump_test

import (
	"context"
	"errors"
	"testing"
	"testing/synctest"
	"time"

	"github.com/Azure/go-amqp"

	"github.com/amqpsub/amqpsub/internal/fake"
	"github.com/amqpsub/amqpsub/pump"
)

// Hold while the pump has no link (attach blocking, as during a
// reconnect's backoff): nothing is held and nothing can arrive, so Emptied
// closes at once.
func TestHoldWithoutALinkEmptiesAtOnce(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		src := fake.New(true)
		p := pump.New(pump.Config{Credit: 8})
		_, errc := start(t, p, attachTo(src)) // the second attach blocks until ctx ends
		synctest.Wait()
		src.Fail(fake.ErrLinkLost) // the link goes; the pump waits in attach
		synctest.Wait()
		if p.Held() != 0 {
			t.Fatalf("held %d", p.Held())
		}
		p.Hold()
		select {
		case <-p.Emptied():
		case <-time.After(time.Minute):
			t.Errorf("Emptied not closed a minute after Hold, with nothing held and no link")
		}
		p.Stop()
		if err := <-errc; !errors.Is(err, pump.ErrStopped) {
			t.Fatalf("Run = %v", err)
		}
	})
}

// inflight is a source whose broker has sent deliveries that have not
// reached the client yet: they arrive after a network delay. A drain's
// answer comes after them, as on a real link.
type inflight struct {
	*fake.Source
	delay time.Duration
}

func (s inflight) Receive(ctx context.Context, o *amqp.ReceiveOptions) (*amqp.Message, error) {
	m, err := s.Source.Receive(ctx, o)
	if err != nil {
		return nil, err
	}
	t := time.NewTimer(s.delay) // on the wire
	defer t.Stop()
	select {
	case <-t.C:
		return m, nil
	case <-ctx.Done():
		return nil, ctx.Err() // lost with the link: the broker gets it back at detach
	}
}

func (s inflight) DrainCredit(ctx context.Context, o *amqp.DrainCreditOptions) error {
	t := time.NewTimer(2 * s.delay) // the answer comes after what was on its way
	defer t.Stop()
	select {
	case <-t.C:
	case <-ctx.Done():
		return ctx.Err()
	}
	return s.Source.DrainCredit(ctx, o)
}

// Hold at an instant when nothing is held but a delivery is on its way:
// Emptied waits for the drain's answer, so the delivery that was on its
// way is handed on and accepted, not released at the Stop after it (a
// counted return on a quorum queue, which is what Hold is for avoiding).
func TestHoldHandsOnWhatWasOnItsWay(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		src := fake.New(true)
		p := pump.New(pump.Config{Credit: 8})
		_, errc := start(t, p, attachTo(inflight{src, 5 * time.Millisecond}))
		synctest.Wait() // credit granted, nothing queued
		src.Push(fake.Messages(1)...)
		time.Sleep(time.Millisecond) // the broker sent it; it is on the wire
		p.Hold()
		select {
		case tk := <-p.Out():
			p.Settle(tk, pump.Outcome{Kind: pump.Accept})
		case <-p.Emptied():
			t.Fatal("Emptied before the delivery on its way arrived")
		}
		<-p.Emptied()
		p.Stop()
		if err := <-errc; !errors.Is(err, pump.ErrStopped) {
			t.Fatalf("Run = %v", err)
		}
		if src.Count(fake.Accepted) != 1 || src.Count(fake.Released) != 0 {
			t.Fatalf("accepted %d, released %d; want 1 and 0", src.Count(fake.Accepted), src.Count(fake.Released))
		}
	})
}
