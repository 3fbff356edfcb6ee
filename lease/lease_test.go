package lease_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/Azure/go-amqp"
	"go.uber.org/goleak"

	"github.com/amqpsub/amqpsub/internal/fake"
	"github.com/amqpsub/amqpsub/lease"
	"github.com/amqpsub/amqpsub/pump"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// The known answer of the Azure SDK for Go's own test of the lock token
// (sdk/messaging/azservicebus/message_test.go, TestAMQPMessageToMessage):
// the same GUID in .NET's layout (the delivery tag) and in RFC 4122's.
func TestLockTokenKnownAnswer(t *testing.T) {
	dotNet := []byte{205, 89, 49, 187, 254, 253, 77, 205, 162, 38, 172, 76, 45, 235, 91, 225}
	want := amqp.UUID{187, 49, 89, 205, 253, 254, 205, 77, 162, 38, 172, 76, 45, 235, 91, 225}
	got, ok := lease.LockToken(dotNet)
	if !ok || got != want {
		t.Fatalf("LockToken = %v, %v; want %v", got, ok, want)
	}
	for _, bad := range [][]byte{nil, make([]byte, 15), make([]byte, 17)} {
		if _, ok := lease.LockToken(bad); ok {
			t.Fatalf("a %d-byte tag gave a lock token", len(bad))
		}
	}
}

// service plays Service Bus's side of message locks: each message's lock
// lasts lockFor from its delivery or last renewal; renewing a lock that has
// expired, or one in lost, fails with ErrLockLost for the whole request.
type service struct {
	lockFor time.Duration
	mu      sync.Mutex
	until   map[amqp.UUID]time.Time
	lost    map[amqp.UUID]bool
	fail    error                          // every request fails with it, when set
	delay   time.Duration                  // each request takes this long
	during  func(tokens []amqp.UUID) error // called within each request; its error is the answer
	reqs    int
	tokens  int
	expired int // renewals asked for a lock already expired: a lock lost
}

func newService(lockFor time.Duration) *service {
	return &service{lockFor: lockFor, until: map[amqp.UUID]time.Time{}, lost: map[amqp.UUID]bool{}}
}

// message returns message i with a lock starting now.
func (s *service) message(i int) *amqp.Message {
	tag := make([]byte, 16)
	copy(tag, fmt.Sprintf("%016d", i))
	token, _ := lease.LockToken(tag)
	until := time.Now().Add(s.lockFor)
	s.mu.Lock()
	s.until[token] = until
	s.mu.Unlock()
	return &amqp.Message{DeliveryTag: tag, Value: i, Annotations: amqp.Annotations{"x-opt-locked-until": until}}
}

func (s *service) RenewLocks(ctx context.Context, tokens []amqp.UUID) ([]time.Time, error) {
	if s.delay > 0 {
		time.Sleep(s.delay)
	}
	s.mu.Lock()
	during := s.during
	s.mu.Unlock()
	if during != nil {
		if err := during(tokens); err != nil {
			s.mu.Lock()
			s.reqs++
			s.mu.Unlock()
			return nil, err
		}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.reqs++
	s.tokens += len(tokens)
	if s.fail != nil {
		return nil, s.fail
	}
	now := time.Now()
	out := make([]time.Time, len(tokens))
	for i, tok := range tokens {
		if s.lost[tok] {
			return nil, fmt.Errorf("status 410: %w", lease.ErrLockLost)
		}
		if !s.until[tok].After(now) {
			s.expired++
			return nil, fmt.Errorf("status 410: %w", lease.ErrLockLost)
		}
		out[i] = now.Add(s.lockFor)
	}
	for i, tok := range tokens {
		s.until[tok] = out[i]
	}
	return out, nil
}

// lostOnes returns the messages whose locks were reported lost, sorted.
func (r *rig) lostOnes() string {
	r.lostM.Lock()
	defer r.lostM.Unlock()
	return fmt.Sprint(sortedInts(r.lost))
}

type rig struct {
	svc   *service
	src   *fake.Source
	pump  *pump.Pump
	book  *lease.Book
	lostM sync.Mutex
	lost  []int
	stop  func()
}

// newRig runs a pump holding n messages of svc, with a book renewing
// their locks.
func newRig(t *testing.T, svc *service, n int, cfg lease.Config) *rig {
	r := &rig{svc: svc}
	msgs := make([]*amqp.Message, n)
	for i := range msgs {
		msgs[i] = svc.message(i)
	}
	r.src = fake.New(true, msgs...)
	cfg.Renewer = svc
	cfg.OnLost = func(t pump.Ticket) {
		r.lostM.Lock()
		r.lost = append(r.lost, t.Message().Value.(int))
		r.lostM.Unlock()
		r.pump.LoseLock(t)
	}
	r.book = lease.New(cfg)
	r.pump = pump.New(pump.Config{Credit: 256, Leases: r.book})
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Go(func() { r.pump.Run(ctx, func(context.Context, error) (pump.Source, error) { return r.src, nil }) })
	wg.Go(func() { r.book.Run(ctx) })
	r.stop = func() { cancel(); wg.Wait() }
	return r
}

// Locks of deliveries that wait are renewed in time, in batched requests:
// far fewer requests than locks renewed, and none lost.
func TestLocksOfWaitingDeliveriesAreRenewedInBatches(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		svc := newService(2 * time.Second)
		r := newRig(t, svc, 100, lease.Config{})
		time.Sleep(30 * time.Second) // nobody takes them from Out
		st := r.book.Stats()
		r.stop()
		if r.lostOnes() != "[]" || svc.expired != 0 || st.Lost != 0 {
			t.Fatalf("locks lost %s (%d renewals too late)", r.lostOnes(), svc.expired)
		}
		// Renewed once a second (2 s locks renewed at half), 100 at a time.
		if st.Renewed < 100*25 || st.Requests > 35 || st.Held != 100 {
			t.Fatalf("stats %+v", st)
		}
		t.Logf("%d locks renewed in %d requests", st.Renewed, st.Requests)
	})
}

// Deliveries arriving one by one still share requests, since each round
// takes every lock due within a window.
func TestStaggeredLocksShareRequests(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		svc := newService(2 * time.Second)
		r := newRig(t, svc, 0, lease.Config{})
		for i := range 200 {
			r.src.Push(svc.message(i))
			time.Sleep(10 * time.Millisecond)
		}
		time.Sleep(10 * time.Second)
		st := r.book.Stats()
		r.stop()
		if svc.expired != 0 || st.Lost != 0 || st.Renewed == 0 {
			t.Fatalf("stats %+v, %d too late", st, svc.expired)
		}
		if st.Requests*10 > st.Renewed {
			t.Fatalf("%d requests for %d renewals: not batched", st.Requests, st.Renewed)
		}
		t.Logf("%d locks renewed in %d requests", st.Renewed, st.Requests)
	})
}

// A lock the service refuses is found in its batch, reported once, and
// only that delivery is disturbed: a waiting one is dropped, a handler's
// ctx is cancelled with ErrLockLost and its settlement skipped.
func TestLostLockIsFoundAndOnlyItsDeliveryDisturbed(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		svc := newService(2 * time.Second)
		r := newRig(t, svc, 10, lease.Config{})
		synctest.Wait()
		var tickets []pump.Ticket
		for range 10 {
			tickets = append(tickets, <-r.pump.Out())
		}
		handled := tickets[3]
		handled.Begin()
		hctx, cancel := context.WithCancelCause(context.Background())
		if !r.book.Bind(handled, cancel) {
			t.Fatal("Bind refused a held delivery")
		}
		tok3, _ := lease.LockToken(handled.Message().DeliveryTag)
		tok7, _ := lease.LockToken(tickets[7].Message().DeliveryTag)
		svc.mu.Lock()
		svc.lost[tok3], svc.lost[tok7] = true, true
		svc.mu.Unlock()
		time.Sleep(5 * time.Second)
		if context.Cause(hctx) != lease.ErrLockLost {
			t.Fatalf("the handler's ctx: %v", context.Cause(hctx))
		}
		if r.lostOnes() != "[3 7]" {
			t.Fatalf("lost %s, want [3 7]", r.lostOnes())
		}
		if tickets[7].State() != pump.Dropped {
			t.Fatalf("waiting delivery with a lost lock is %s", tickets[7].State())
		}
		for i, tk := range tickets {
			o := pump.Outcome{Kind: pump.Accept}
			if i == 7 {
				o.Kind = pump.Drop
			}
			r.pump.Settle(tk, o)
		}
		synctest.Wait()
		ps, bs := r.pump.Stats(), r.book.Stats()
		r.stop()
		if ps.Accepted != 8 || ps.LockLostSkipped != 1 || ps.LockLostDropped != 1 || bs.Lost != 2 || bs.Held != 0 {
			t.Fatalf("pump %+v\nbook %+v", ps, bs)
		}
	})
}

// A lock settled while its renewal was on its way makes the service refuse
// the whole request; the others are asked again as one batch, not lock by
// lock.
func TestALockSettledDuringItsRenewalCostsOneMoreRequest(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		svc := newService(2 * time.Second)
		r := newRig(t, svc, 50, lease.Config{})
		synctest.Wait()
		var tickets []pump.Ticket
		for range 50 {
			tickets = append(tickets, <-r.pump.Out())
		}
		first := true
		svc.mu.Lock()
		defer svc.mu.Unlock()
		svc.during = func(tokens []amqp.UUID) error {
			if !first {
				return nil
			}
			first = false
			r.book.Remove(tickets[7].Entry()) // settled meanwhile
			return fmt.Errorf("status 410: %w", lease.ErrLockLost)
		}
		svc.mu.Unlock()
		time.Sleep(1500 * time.Millisecond)
		svc.mu.Lock()
		st := r.book.Stats()
		r.stop()
		if st.Requests != 2 || st.Renewed != 49 || st.Lost != 0 || r.lostOnes() != "[]" {
			t.Fatalf("stats %+v, lost %s", st, r.lostOnes())
		}
	})
}

// After MaxRenewal a lock is left to expire, and then reported lost.
func TestRenewalStopsAfterMaxRenewal(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		svc := newService(2 * time.Second)
		r := newRig(t, svc, 1, lease.Config{MaxRenewal: 10 * time.Second})
		time.Sleep(9 * time.Second)
		if r.lostOnes() != "[]" {
			t.Fatal("lost before MaxRenewal")
		}
		time.Sleep(5 * time.Second) // MaxRenewal + at most one lock duration
		st := r.book.Stats()
		r.stop()
		if r.lostOnes() != "[0]" || st.PastMaxRenew != 1 || st.Held != 0 {
			t.Fatalf("lost %s, stats %+v", r.lostOnes(), st)
		}
	})
}

// Requests that fail (no answer) are tried again until the lock expires,
// then it is lost; a delivery without a usable lock is kept, never renewed.
func TestFailingRenewalsAndUnrenewableDeliveries(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		svc := newService(2 * time.Second)
		svc.fail = context.DeadlineExceeded
		r := newRig(t, svc, 1, lease.Config{Timeout: 100 * time.Millisecond})
		r.src.Push(&amqp.Message{DeliveryTag: []byte("short"), Value: 99})
		time.Sleep(5 * time.Second)
		st := r.book.Stats()
		r.stop()
		if r.lostOnes() != "[0]" || st.Failures < 2 || st.Unrenewable != 1 || st.Held != 1 {
			t.Fatalf("lost %s, stats %+v", r.lostOnes(), st)
		}
	})
}

// Stopping while a request is out is not a failure.
func TestStopDuringARenewalIsNotAFailure(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		svc := newService(2 * time.Second)
		r := newRig(t, svc, 1, lease.Config{})
		time.Sleep(1500 * time.Millisecond) // a renewal was due at 1 s and went through
		svc.mu.Lock()
		svc.fail = errors.New("unreachable")
		svc.mu.Unlock()
		r.stop()
		if st := r.book.Stats(); st.Lost != 0 || st.Renewed != 1 {
			t.Fatalf("stats %+v", st)
		}
	})
}

func sortedInts(xs []int) []int {
	out := append([]int(nil), xs...)
	for i := range out {
		for j := i + 1; j < len(out); j++ {
			if out[j] < out[i] {
				out[i], out[j] = out[j], out[i]
			}
		}
	}
	return out
}
