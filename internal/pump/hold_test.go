package pump_test

import (
	"context"
	"errors"
	"testing"
	"testing/synctest"
	"time"

	"github.com/Azure/go-amqp"

	"github.com/amqpsub/amqpsub/internal/driver"
	"github.com/amqpsub/amqpsub/internal/fake"
	"github.com/amqpsub/amqpsub/internal/pump"
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
			p.Settle(tk, driver.Outcome{Kind: driver.Accept})
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

// prefetching plays go-amqp's receiver around a drain: the broker sent a
// delivery and then the drain's answer; go-amqp's mux enqueues the delivery
// in the prefetch queue (receiver.go muxReceive: messagesQ.Enqueue) and then,
// on the flow that follows, ends the drain (EndDrain), so DrainCredit
// returns while the delivery is still in the prefetch queue: the pump's
// receive goroutine has not yet taken it. lag is how long that goroutine
// takes to run once woken (a busy process).
type prefetching struct {
	*fake.Source
	q   chan *amqp.Message // go-amqp's messagesQ
	lag time.Duration
}

func (s *prefetching) Receive(ctx context.Context, _ *amqp.ReceiveOptions) (*amqp.Message, error) {
	select {
	case m := <-s.q:
		if s.lag > 0 {
			time.Sleep(s.lag)
		}
		return m, nil
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

func (s *prefetching) DrainCredit(ctx context.Context, o *amqp.DrainCreditOptions) error {
	// The transfers the broker had sent before its answer: in the
	// prefetch queue first.
	done, cancel := context.WithCancel(ctx)
	cancel()
	for {
		m, err := s.Source.Receive(done, nil)
		if err != nil {
			break
		}
		s.q <- m
	}
	return s.Source.DrainCredit(ctx, o) // then the answer
}

func holdRace(t *testing.T, lag time.Duration) (emptiedFirst bool, released int) {
	synctest.Test(t, func(t *testing.T) {
		src := &prefetching{Source: fake.New(true), q: make(chan *amqp.Message, 8), lag: lag}
		p := pump.New(pump.Config{Credit: 8})
		_, errc := start(t, p, attachTo(src))
		synctest.Wait()               // credit granted
		src.Push(fake.Messages(1)...) // sent by the broker, before the drain's answer
		p.Hold()
		select {
		case tk := <-p.Out():
			p.Settle(tk, driver.Outcome{Kind: driver.Accept})
			<-p.Emptied()
		case <-p.Emptied():
			emptiedFirst = true
		}
		p.Stop() // what amqpsub's finishBuffered does once Emptied is closed
		if err := <-errc; !errors.Is(err, pump.ErrStopped) {
			t.Fatalf("Run = %v", err)
		}
		released = src.Count(fake.Released)
	})
	return emptiedFirst, released
}

// A delivery the broker sent before its drain answer may still be in
// go-amqp's prefetch queue when the answer comes: Emptied waits for it to
// be handed on, so the Stop that follows releases nothing (a release is a
// counted return on a quorum queue).
func TestHoldWaitsForWhatIsPrefetched(t *testing.T) {
	if first, rel := holdRace(t, time.Microsecond); first || rel != 0 {
		t.Errorf("Emptied closed before the delivery in the prefetch queue reached Out (first=%v); %d released at the Stop after it", first, rel)
	}
}

// The same without any lag, many times: plain scheduling lost that race
// in most runs before Emptied waited for the receive loop's marker.
func TestHoldWaitsForWhatIsPrefetchedNoLag(t *testing.T) {
	n, lost := 500, 0
	for range n {
		if first, rel := holdRace(t, 0); first || rel != 0 {
			lost++
		}
	}
	if lost > 0 {
		t.Errorf("%d of %d holds closed Emptied before the prefetched delivery was handed on", lost, n)
	}
}

// A quorum queue that answers the drain after 30 ms (a Raft round: the
// credit command goes through the log), with a delivery sent before the
// answer that arrives at 25 ms: Hold waits longer for the answer than a
// stop's drainWait (20 ms), and the delivery is handed on.
func TestHoldWaitsForASlowDrainAnswer(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		src := fake.New(true)
		p := pump.New(pump.Config{Credit: 8})
		_, errc := start(t, p, attachTo(inflight{src, 25 * time.Millisecond}))
		synctest.Wait()
		src.Push(fake.Messages(1)...)
		time.Sleep(time.Millisecond)
		p.Hold()
		select {
		case tk := <-p.Out():
			p.Settle(tk, driver.Outcome{Kind: driver.Accept})
		case <-p.Emptied():
			t.Errorf("Emptied closed after drainWait, before the drain's answer and the delivery on its way")
		}
		p.Stop()
		if err := <-errc; !errors.Is(err, pump.ErrStopped) {
			t.Fatalf("Run = %v", err)
		}
		t.Logf("accepted %d released %d", src.Count(fake.Accepted), src.Count(fake.Released))
	})
}
