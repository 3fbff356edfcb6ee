package amqpsubtest_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/amqpsub/amqpsub/amqpsub"
	"github.com/amqpsub/amqpsub/amqpsubtest"
)

type outcomeRec struct {
	mu      sync.Mutex
	settled []string
	handled []amqpsub.Result
}

func (r *outcomeRec) Recorder(amqpsub.MetricsInfo) amqpsub.Recorder { return r }
func (r *outcomeRec) Received()                                     {}
func (r *outcomeRec) Handled(c amqpsub.HandlerCall) {
	r.mu.Lock()
	r.handled = append(r.handled, c.Result)
	r.mu.Unlock()
}
func (r *outcomeRec) Settled(o amqpsub.Outcome, err error) {
	r.mu.Lock()
	r.settled = append(r.settled, fmt.Sprintf("%v/%v", o, err != nil))
	r.mu.Unlock()
}
func (r *outcomeRec) Event(amqpsub.Event) {}
func (r *outcomeRec) LocksRenewed(int)    {}
func (r *outcomeRec) Dropped(int)         {}

// A handler whose lock is lost returns Retry (its ctx's error). Nothing is
// sent, and OnSettled and Recorder.Settled say so with ErrNotSettled, with
// the outcome the handler asked for (modified: an abandon), not another;
// Stats counts the result.
func TestLockLostSettlementNamesTheHandlersOutcome(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		q := amqpsubtest.NewQueue(amqpsubtest.WithProfile(amqpsub.AzureServiceBus))
		q.Publish(amqpsubtest.Message("", "slow"))
		rec := &outcomeRec{}
		var mu sync.Mutex
		var heard []string
		first := true
		h := func(ctx context.Context, d *amqpsub.Delivery) error {
			d.OnSettled(func(o amqpsub.Outcome, err error) {
				mu.Lock()
				heard = append(heard, fmt.Sprintf("%v/%v", o, errors.Is(err, amqpsub.ErrNotSettled)))
				mu.Unlock()
			})
			if !first {
				return nil
			}
			first = false
			<-ctx.Done() // lock lost past MaxLockRenewal
			return ctx.Err()
		}
		sub, err := amqpsub.New(q.Connector(), "orders", amqpsub.HandlerFunc(h),
			amqpsub.MaxLockRenewal(90*time.Second), amqpsub.WithMetrics(rec))
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithTimeout(t.Context(), time.Hour)
		defer cancel()
		if err := q.Drain(ctx, sub); err != nil {
			t.Fatal(err)
		}
		mu.Lock()
		defer mu.Unlock()
		t.Logf("handler results %v; Recorder.Settled %v; OnSettled %v; Stats.Results %+v", rec.handled, rec.settled, heard, sub.Stats().Results)
		if len(heard) == 0 || heard[0] != "modified/true" {
			t.Errorf("OnSettled for the lost-lock Retry heard %v, want modified with ErrNotSettled first", heard)
		}
		if len(rec.settled) == 0 || rec.settled[0] != "modified/true" {
			t.Errorf("Recorder.Settled heard %v, want modified, not taken, first", rec.settled)
		}
		if r := sub.Stats().Results; r.Retry != 1 || r.Accept != 1 {
			t.Errorf("Stats.Results = %+v, want the Retry and the Accept counted", r)
		}
	})
}

type countRec struct {
	mu                         sync.Mutex
	received, settled, dropped int
}

func (r *countRec) Recorder(amqpsub.MetricsInfo) amqpsub.Recorder { return r }
func (r *countRec) Received()                                     { r.mu.Lock(); r.received++; r.mu.Unlock() }
func (r *countRec) Handled(amqpsub.HandlerCall)                   {}
func (r *countRec) Settled(amqpsub.Outcome, error)                { r.mu.Lock(); r.settled++; r.mu.Unlock() }
func (r *countRec) Event(amqpsub.Event)                           {}
func (r *countRec) LocksRenewed(int)                              {}
func (r *countRec) Dropped(n int)                                 { r.mu.Lock(); r.dropped += n; r.mu.Unlock() }

// Deliveries buffered when their link is lost are dropped (Stats.Dropped):
// the Recorder hears of them too, so that after a drain received equals
// settled plus dropped, as in Stats.
func TestRecorderHearsOfDroppedDeliveries(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		q := amqpsubtest.NewQueue()
		for range 10 {
			q.Publish(amqpsubtest.Message("", "x"))
		}
		rec := &countRec{}
		in, reconnected := make(chan struct{}), make(chan struct{})
		var once, onceRe sync.Once
		h := amqpsub.HandlerFunc(func(context.Context, *amqpsub.Delivery) error {
			once.Do(func() { close(in); <-reconnected })
			return nil
		})
		sub, err := amqpsub.New(q.Connector(), "orders", h, amqpsub.WithMetrics(rec),
			amqpsub.FixedCredit(), // deliveries buffered behind the blocked one, for the loss to drop
			amqpsub.Backoff(time.Millisecond, time.Millisecond),
			amqpsub.OnEvent(func(e amqpsub.Event) {
				if e.Kind == amqpsub.EventReconnected {
					onceRe.Do(func() { close(reconnected) })
				}
			}))
		if err != nil {
			t.Fatal(err)
		}
		go func() {
			<-in
			// Every other delivery is buffered behind the busy handler
			// before the link goes: they are the ones dropped.
			synctest.Wait()
			q.LoseLinks(nil)
		}()
		ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
		defer cancel()
		if err := q.Drain(ctx, sub); err != nil {
			t.Fatal(err)
		}
		st := sub.Stats()
		rec.mu.Lock()
		defer rec.mu.Unlock()
		t.Logf("Stats: received %d settled %+v stale %d dropped %d; Recorder: received %d settled %d",
			st.Received, st.Settled, st.Stale, st.Dropped, rec.received, rec.settled)
		if rec.received != rec.settled+rec.dropped || uint64(rec.dropped) != st.Dropped || st.Dropped == 0 {
			t.Errorf("Recorder: %d received, %d settled, %d dropped after a drain; Stats.Dropped %d",
				rec.received, rec.settled, rec.dropped, st.Dropped)
		}
	})
}

// After a stop that cuts handlers short (GracePeriod(0)), the deliveries
// still held when Run returns reach the Recorder as dropped, so that
// received = settled + dropped, as Recorder.Dropped says.
func TestRecorderCountsAfterAStopWithoutGrace(t *testing.T) {
	q := amqpsubtest.NewQueue()
	for range 4 {
		q.Publish(amqpsubtest.Message("", "x"))
	}
	rec := &countRec{}
	began := make(chan struct{}, 4)
	h := amqpsub.HandlerFunc(func(ctx context.Context, _ *amqpsub.Delivery) error {
		began <- struct{}{}
		<-ctx.Done()
		return ctx.Err()
	})
	sub, err := amqpsub.New(q.Connector(), "orders", h, amqpsub.WithMetrics(rec), amqpsub.Workers(2), amqpsub.GracePeriod(0))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(t.Context())
	errc := make(chan error, 1)
	go func() { errc <- sub.Run(ctx) }()
	<-began
	<-began
	cancel()
	if err := <-errc; err != nil {
		t.Fatal(err)
	}
	st := sub.Stats()
	rec.mu.Lock()
	defer rec.mu.Unlock()
	t.Logf("Recorder: received %d settled %d dropped %d; Stats: received %d held %d", rec.received, rec.settled, rec.dropped, st.Received, st.Held)
	if rec.received != rec.settled+rec.dropped {
		t.Errorf("after a stop the Recorder heard %d received, %d settled, %d dropped: %d deliveries unaccounted for",
			rec.received, rec.settled, rec.dropped, rec.received-rec.settled-rec.dropped)
	}
}
