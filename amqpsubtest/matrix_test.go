package amqpsubtest_test

import (
	"context"
	"errors"
	"fmt"
	"math"
	"strconv"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/amqpsub/amqpsub/amqpsub"
	"github.com/amqpsub/amqpsub/amqpsubtest"
	"github.com/amqpsub/amqpsub/internal/credit"
	"github.com/amqpsub/amqpsub/internal/shapes"
)

// matrixHandling is how long every handler call takes in the matrix, on
// the fake clock: a delivery, or a whole batch.
const matrixHandling = 10 * time.Millisecond

// matrixRun is about how long each case of the matrix runs at its lanes'
// full rate; the bounds are asserted after its first second.
const matrixRun = 1300 * time.Millisecond

// Every lane mode on every broker profile and workload (internal/shapes),
// with handlers that take 10 ms: the adaptive credit keeps within its
// bound, what is held within the credit, nothing is lost, and each
// group keeps its order where the lanes promise it.
//
// The credit's bound is floor + in-flight + allowance, within CreditLimit:
// floor is a delivery (a batch) per lane; in-flight is Headroom round
// trips (at least MinRoundTrip) of the drain rate, which is bounded from
// the handlers' pace (see drainRateBound); allowance is what waits behind
// an earlier delivery of its own group (Stats.Parked, see parkedBound):
// all of it on a broker that pins groups to a consumer, at most the floor
// elsewhere, where other replicas could take that backlog. (What waits
// behind a stalled call is held in full everywhere, but with handlers of
// one pace no call stalls once the first have set the mean.) A keyless
// delivery, or one whose group has nothing earlier held, is never parked,
// nor is anything under Workers.
func TestShapeMatrix(t *testing.T) {
	for _, p := range shapes.Profiles() {
		t.Run(p.Name, func(t *testing.T) {
			for _, l := range shapes.Lanes() {
				t.Run(l.Name, func(t *testing.T) {
					for _, w := range shapes.Workloads() {
						t.Run(w.Name, func(t *testing.T) {
							synctest.Test(t, func(t *testing.T) { runShape(t, p, l, w) })
						})
					}
				})
			}
		})
	}
}

// drainRateBound is the most the credit's drain rate can measure with
// lanes that each settle at most need deliveries per handler call of
// duration d. The rate is a count of settlements decaying with time
// constant τ = DrainWindow, divided by τ; a lane's count is largest just
// after a settlement of need, when every earlier one came d apart:
// need × Σₖ e^(-k·d/τ) = need / (1 - e^(-d/τ)). All lanes settling at once
// (as they do on the fake clock) add up, so the bound is
//
//	lanes × need / (τ × (1 - e^(-d/τ)))
//
// which for d = 10 ms and τ = 100 ms is 1.051 × lanes × need / d: a batch
// settled at once raises the count by need at one instant, but decays
// before the next; spreading the settlements only lowers the peak.
func drainRateBound(lanes, need int, d time.Duration) float64 {
	tau := credit.DrainWindow.Seconds()
	return float64(lanes*need) / (tau * (1 - math.Exp(-d.Seconds()/tau)))
}

// creditBound is the most the adaptive credit may be at st, for a credit
// computed with at most parked deliveries parked (see parkedBound).
func creditBound(p shapes.Profile, l shapes.Lane, st amqpsub.Stats, parked int) (bound, inFlight, allowance int) {
	rtt := max(st.RoundTrip, credit.MinRoundTrip)
	inFlight = int(math.Ceil(credit.Headroom * drainRateBound(l.Workers, l.Need(), matrixHandling) * rtt.Seconds()))
	floor := l.Floor()
	allowance = parked
	if !p.PinsGroups {
		allowance = min(allowance, floor)
	}
	return min(st.CreditLimit, floor+inFlight+allowance), inFlight, allowance
}

// parkedBound bounds the parked count the credit shown in a sample was
// computed with, from Stats.Parked in this sample and the one before,
// 10 ms earlier. The credit is the pump's as of its last grant, made on an
// event or its 10 ms tick, which may come within the same instant as a
// sample, or the one before, and before the lanes started their next
// deliveries: each lane's start takes at most a delivery (a batch) out of
// the parked ones, so the count it saw is at most the floor more than
// what a sample sees. Only where a group has more than one message can
// anything be parked at all.
func parkedBound(l shapes.Lane, w shapes.Workload, prev, now int) int {
	if !w.Repeats {
		return now
	}
	return max(prev, now) + l.Floor()
}

// shapeSub returns a subscriber on q for profile p and lane mode l (with
// opts after theirs): each handler call (of a delivery, or of a batch)
// first sleeps for delay(), then runs h on each of its deliveries in turn.
func shapeSub(t *testing.T, q *amqpsubtest.Queue, p shapes.Profile, l shapes.Lane, delay func() time.Duration,
	h func(context.Context, *amqpsub.Delivery) error, opts ...amqpsub.Option) *amqpsub.Subscriber {
	t.Helper()
	opts = append(append(append([]amqpsub.Option(nil), p.Options...), l.Options()...), opts...)
	var sub *amqpsub.Subscriber
	var err error
	if l.Batch > 0 {
		sub, err = amqpsub.NewBatch(q.Connector(), "orders", amqpsub.BatchHandlerFunc(func(ctx context.Context, b []*amqpsub.Delivery) []error {
			time.Sleep(delay())
			r := make([]error, len(b))
			for i, d := range b {
				r[i] = h(ctx, d)
			}
			return r
		}), opts...)
	} else {
		sub, err = amqpsub.New(q.Connector(), "orders", amqpsub.HandlerFunc(func(ctx context.Context, d *amqpsub.Delivery) error {
			time.Sleep(delay())
			return h(ctx, d)
		}), opts...)
	}
	if err != nil {
		t.Fatal(err)
	}
	return sub
}

func runShape(t *testing.T, p shapes.Profile, l shapes.Lane, w shapes.Workload) {
	rate := float64(l.Workers*l.Need()) / matrixHandling.Seconds()
	n := int(rate * matrixRun.Seconds())
	groups := w.Groups(n)
	q := amqpsubtest.NewQueue(p.QueueOptions...)
	for i, g := range groups {
		q.Publish(amqpsubtest.Message(g, fmt.Sprintf("%0*d", shapes.BodySize, i)))
	}
	// Every 37th message is rejected; with LocalRetry the first attempt
	// of every 7th fails, and is retried in the lane.
	rejected := func(i int) bool { return i%37 == 36 }
	var (
		mu      sync.Mutex
		failed  = map[int]bool{}
		handled []int // message indexes, in the order their handler finished
	)
	result := func(d *amqpsub.Delivery) error {
		i, err := strconv.Atoi(text(d))
		if err != nil {
			panic(err)
		}
		mu.Lock()
		defer mu.Unlock()
		if l.Retries() && i%7 == 3 && !failed[i] {
			failed[i] = true
			return errors.New("first attempt fails")
		}
		handled = append(handled, i)
		if rejected(i) {
			return amqpsub.Reject("matrix")
		}
		return nil
	}
	sub := shapeSub(t, q, p, l, func() time.Duration { return matrixHandling }, func(_ context.Context, d *amqpsub.Delivery) error { return result(d) },
		amqpsub.GracePeriod(0))

	t0 := time.Now()
	stop := start(sub)
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	drained := make(chan error, 1)
	go func() { drained <- q.Wait(ctx) }()
	chunk := 0
	mostBound, mostCredit, samples, violations, prevParked := 0, 0, 0, 0, 0
	var first, parkedWrong string
	for done := false; !done; {
		select {
		case err := <-drained:
			if err != nil {
				t.Error(err)
			}
			done = true
		case <-time.After(10 * time.Millisecond):
		}
		synctest.Wait()
		st := sub.Stats()
		chunk = max(1, st.CreditLimit/8)
		bound, inFlight, allowance := creditBound(p, l, st, parkedBound(l, w, prevParked, st.Parked))
		prevParked = st.Parked
		mostBound = max(mostBound, bound)
		// Nothing is parked where no group has two messages, nor where
		// Workers ignore groups: the lanes park what waits behind an
		// earlier delivery of its group, or behind a call that has run for
		// four times the mean, and here every call takes as long.
		if (!w.Repeats || !l.ByKey) && st.Parked != 0 && parkedWrong == "" {
			parkedWrong = fmt.Sprintf("at %v parked %d, want 0 (held %d)", time.Since(t0), st.Parked, st.Held)
		}
		if time.Since(t0) < time.Second || done {
			continue
		}
		samples++
		mostCredit = max(mostCredit, st.Credit)
		if st.Credit > bound {
			violations++
			if first == "" {
				first = fmt.Sprintf("at %v credit %d > %d = min(limit %d, floor %d + in-flight %d + allowance %d) (held %d)",
					time.Since(t0), st.Credit, bound, st.CreditLimit, l.Floor(), inFlight, allowance, st.Held)
			}
		}
	}
	if err := stop(); err != nil && !errors.Is(err, context.Canceled) {
		t.Errorf("Run: %v", err)
	}
	st := sub.Stats()
	t.Logf("%d messages in %v; credit at most %d after 1 s (bound at most %d), max held %d", n, time.Since(t0).Round(10*time.Millisecond), mostCredit, mostBound, st.MaxHeld)
	if samples == 0 {
		t.Errorf("drained within a second: nothing sampled")
	}
	if violations > 0 {
		t.Errorf("credit past its bound in %d of %d samples; first %s", violations, samples, first)
	}
	if parkedWrong != "" {
		t.Errorf("%s", parkedWrong)
	}
	if st.MaxHeld > mostBound+chunk {
		t.Errorf("max held %d > bound %d + a grant %d", st.MaxHeld, mostBound, chunk)
	}

	// Nothing lost: every message consumed, or dead-lettered where the
	// handler rejected it.
	for _, r := range q.Records() {
		want := amqpsubtest.Consumed
		if rejected(r.Index) {
			want = amqpsubtest.DeadLettered
		}
		if r.State != want {
			t.Errorf("want %v: %v", want, r)
		}
	}
	if l.Ordered() && w.Repeats {
		mu.Lock()
		defer mu.Unlock()
		if err := amqpsubtest.GroupOrder(handled, func(i int) (string, int) { return groups[i], i }); err != nil {
			t.Errorf("handled: %v", err)
		}
		if err := amqpsubtest.GroupOrder(q.Accepted(), func(r amqpsubtest.Record) (string, int) { return r.GroupID(), r.Index }); err != nil {
			t.Errorf("accepted: %v", err)
		}
	}
}
