package servicebus_test

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/Azure/go-amqp"
	"go.uber.org/goleak"

	"github.com/amqpsub/amqpsub/internal/driver"
	"github.com/amqpsub/amqpsub/internal/driver/servicebus"
	"github.com/amqpsub/amqpsub/internal/fake"
	"github.com/amqpsub/amqpsub/internal/pump"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// The known answer of the Azure SDK for Go's own test of the lock token
// (sdk/messaging/azservicebus/message_test.go, TestAMQPMessageToMessage):
// the same GUID in .NET's layout (the delivery tag) and in RFC 4122's.
func TestLockTokenKnownAnswer(t *testing.T) {
	dotNet := []byte{205, 89, 49, 187, 254, 253, 77, 205, 162, 38, 172, 76, 45, 235, 91, 225}
	want := amqp.UUID{187, 49, 89, 205, 253, 254, 205, 77, 162, 38, 172, 76, 45, 235, 91, 225}
	got, ok := servicebus.LockToken(dotNet)
	if !ok || got != want {
		t.Fatalf("LockToken = %v, %v; want %v", got, ok, want)
	}
	for _, bad := range [][]byte{nil, make([]byte, 15), make([]byte, 17)} {
		if _, ok := servicebus.LockToken(bad); ok {
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
	fail    error // every request fails with it, when set
	// mixed is how a request of several tokens, one of them lost, is
	// answered: "" or "410" refuses it whole with 410, "400" refuses it
	// whole with 400, "partial" renews the others and answers with their
	// expirations only. A request of one lost token gets 410.
	mixed   string
	delay   time.Duration                  // each request takes this long
	during  func(tokens []amqp.UUID) error // called within each request; its error is the answer
	reqs    int
	tokens  int
	expired int // renewals asked for a lock already expired: a lock lost
	// left is, for each lock, the least time it had left when a renewal
	// of it was answered.
	left map[amqp.UUID]time.Duration
}

func newService(lockFor time.Duration) *service {
	return &service{lockFor: lockFor, until: map[amqp.UUID]time.Time{}, lost: map[amqp.UUID]bool{}, left: map[amqp.UUID]time.Duration{}}
}

// leastLeft returns the least time lock i had left when a renewal of it was
// answered, and whether one was.
func (s *service) leastLeft(i int) (time.Duration, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	d, ok := s.left[token(i)]
	return d, ok
}

func token(i int) amqp.UUID {
	tag := make([]byte, 16)
	copy(tag, fmt.Sprintf("%016d", i))
	u, _ := servicebus.LockToken(tag)
	return u
}

// message returns message i with a lock starting now.
func (s *service) message(i int) *amqp.Message {
	tag := make([]byte, 16)
	copy(tag, fmt.Sprintf("%016d", i))
	token, _ := servicebus.LockToken(tag)
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
	out := make([]time.Time, 0, len(tokens))
	var live []amqp.UUID
	for _, tok := range tokens {
		if s.lost[tok] || !s.until[tok].After(now) {
			if !s.lost[tok] {
				s.expired++
			}
			switch {
			case len(tokens) == 1 || s.mixed == "" || s.mixed == "410":
				return nil, fmt.Errorf("status 410: %w", servicebus.ErrLockLost)
			case s.mixed == "400":
				return nil, fmt.Errorf("status 400: %w", servicebus.ErrBadRequest)
			}
			continue // "partial": left out of the answer
		}
		live = append(live, tok)
		out = append(out, now.Add(s.lockFor))
	}
	for i, tok := range live {
		left := s.until[tok].Sub(now)
		if prev, ok := s.left[tok]; !ok || left < prev {
			s.left[tok] = left
		}
		s.until[tok] = out[i]
	}
	return out, nil
}

// hanging is a service some of whose requests are never answered: each
// request for which hang says so (n counts the requests from 1) returns
// only when its ctx ends, linger after. It counts the requests out at once.
type hanging struct {
	*service
	hang   func(n int) bool
	linger time.Duration

	mu     sync.Mutex
	n      int
	out    int // requests out now
	maxOut int // the most out at once
	hung   []time.Time
}

func (h *hanging) RenewLocks(ctx context.Context, tokens []amqp.UUID) ([]time.Time, error) {
	h.mu.Lock()
	h.n++
	hang := h.hang(h.n)
	h.out++
	h.maxOut = max(h.maxOut, h.out)
	h.mu.Unlock()
	defer func() {
		h.mu.Lock()
		h.out--
		h.mu.Unlock()
	}()
	if hang {
		<-ctx.Done()
		time.Sleep(h.linger) // the answer to a cancelled request takes a moment
		h.mu.Lock()
		h.hung = append(h.hung, time.Now())
		h.mu.Unlock()
		return nil, ctx.Err()
	}
	return h.service.RenewLocks(ctx, tokens)
}

func (h *hanging) counts() (out, maxOut int) {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.out, h.maxOut
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
	book  *servicebus.Leases
	lostM sync.Mutex
	lost  []int
	stop  func()
}

// newRig runs a pump holding n messages of svc, with a book renewing
// their locks (through cfg.Renewer if set, else svc).
func newRig(t *testing.T, svc *service, n int, cfg servicebus.LeasesConfig) *rig {
	msgs := make([]*amqp.Message, n)
	for i := range msgs {
		msgs[i] = svc.message(i)
	}
	return newRigWith(t, svc, fake.New(true, msgs...), cfg, pump.Config{Credit: 256})
}

// newRigWith is newRig with the source and the pump's configuration given.
func newRigWith(t *testing.T, svc *service, src *fake.Source, cfg servicebus.LeasesConfig, pc pump.Config) *rig {
	r := &rig{svc: svc, src: src}
	if cfg.Renewer == nil {
		cfg.Renewer = svc
	}
	cfg.OnLost = func(t driver.Ticket, _ *amqp.Message, _ error) {
		r.lostM.Lock()
		r.lost = append(r.lost, t.Message().Value.(int))
		r.lostM.Unlock()
		r.pump.LoseLease(t)
	}
	r.book = servicebus.NewLeases(cfg)
	pc.Leases = r.book
	r.pump = pump.New(pc)
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Go(func() { r.pump.Run(ctx, func(context.Context, error) (driver.Source, error) { return r.src, nil }) })
	wg.Go(func() { r.book.Run(ctx) })
	var once sync.Once
	r.stop = func() { once.Do(func() { cancel(); wg.Wait() }) }
	t.Cleanup(r.stop) // a test that fails early still ends its goroutines
	return r
}

// Locks of deliveries that wait are renewed in time, in batched requests:
// far fewer requests than locks renewed, and none lost.
func TestLocksOfWaitingDeliveriesAreRenewedInBatches(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		svc := newService(2 * time.Second)
		r := newRig(t, svc, 100, servicebus.LeasesConfig{})
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
		r := newRig(t, svc, 0, servicebus.LeasesConfig{})
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
		r := newRig(t, svc, 10, servicebus.LeasesConfig{})
		synctest.Wait()
		var tickets []driver.Ticket
		for range 10 {
			tickets = append(tickets, <-r.pump.Out())
		}
		handled := tickets[3]
		handled.Begin()
		hctx, cancel := context.WithCancelCause(context.Background())
		if !r.book.Bind(handled, cancel) {
			t.Fatal("Bind refused a held delivery")
		}
		tok3, _ := servicebus.LockToken(handled.Message().DeliveryTag)
		tok7, _ := servicebus.LockToken(tickets[7].Message().DeliveryTag)
		svc.mu.Lock()
		svc.lost[tok3], svc.lost[tok7] = true, true
		svc.mu.Unlock()
		time.Sleep(5 * time.Second)
		if context.Cause(hctx) != servicebus.ErrLockLost {
			t.Fatalf("the handler's ctx: %v", context.Cause(hctx))
		}
		if r.lostOnes() != "[3 7]" {
			t.Fatalf("lost %s, want [3 7]", r.lostOnes())
		}
		if tickets[7].State() != driver.Dropped {
			t.Fatalf("waiting delivery with a lost lock is %s", tickets[7].State())
		}
		for i, tk := range tickets {
			o := driver.Outcome{Kind: driver.Accept}
			if i == 7 {
				o.Kind = driver.Drop
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

// A handler that returns the moment its ctx is cancelled for a lost lock
// must find the pump told already, or its settlement goes out on a lock the
// service gave up.
func TestThePumpHearsOfALostLockBeforeTheHandler(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		svc := newService(2 * time.Second)
		r := newRig(t, svc, 1, servicebus.LeasesConfig{MaxRenewal: time.Nanosecond})
		tk := <-r.pump.Out()
		tk.Begin()
		var markedFirst atomic.Bool
		cancelled := make(chan struct{})
		cancel := func(cause error) {
			markedFirst.Store(tk.Entry().LeaseLost())
			if cause == servicebus.ErrLockLost {
				close(cancelled)
			}
		}
		if !r.book.Bind(tk, cancel) {
			t.Fatal("Bind refused a held delivery")
		}
		<-cancelled
		if !markedFirst.Load() {
			t.Fatal("the handler's ctx was cancelled before the pump marked its delivery's lock lost")
		}
		r.pump.Settle(tk, driver.Outcome{Kind: driver.Accept})
		synctest.Wait()
		ps := r.pump.Stats()
		r.stop()
		if ps.LockLostSkipped != 1 || ps.Accepted != 0 {
			t.Fatalf("pump %+v", ps)
		}
	})
}

// A lock settled while its renewal was on its way makes the service refuse
// the whole request; the others are asked again as one batch, not lock by
// lock.
func TestALockSettledDuringItsRenewalCostsOneMoreRequest(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		svc := newService(2 * time.Second)
		r := newRig(t, svc, 50, servicebus.LeasesConfig{})
		synctest.Wait()
		var tickets []driver.Ticket
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
			return fmt.Errorf("status 410: %w", servicebus.ErrLockLost)
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

// MaxRenewal counts from the handler's start (Bind): a delivery that waits
// longer than that for its handler keeps its lock; MaxRenewal after its
// handler began, the lock is left to expire, and then reported lost.
func TestRenewalStopsMaxRenewalAfterTheHandlerBegan(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		svc := newService(2 * time.Second)
		r := newRig(t, svc, 1, servicebus.LeasesConfig{MaxRenewal: 10 * time.Second})
		time.Sleep(20 * time.Second) // waiting in Out, twice MaxRenewal
		if r.lostOnes() != "[]" {
			t.Fatal("lost while it waited for a handler")
		}
		tk := <-r.pump.Out()
		tk.Begin()
		_, cancel := context.WithCancelCause(context.Background())
		defer cancel(nil)
		if !r.book.Bind(tk, cancel) {
			t.Fatal("Bind refused a held delivery")
		}
		time.Sleep(9 * time.Second)
		if r.lostOnes() != "[]" {
			t.Fatal("lost before MaxRenewal after its handler began")
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
		r := newRig(t, svc, 1, servicebus.LeasesConfig{Timeout: 100 * time.Millisecond})
		r.src.Push(&amqp.Message{DeliveryTag: []byte("short"), Value: 99})
		time.Sleep(5 * time.Second)
		st := r.book.Stats()
		r.stop()
		if r.lostOnes() != "[0]" || st.Failures < 2 || st.Unrenewable != 1 || st.Held != 1 {
			t.Fatalf("lost %s, stats %+v", r.lostOnes(), st)
		}
	})
}

// Stopping while a request is out is not a failure, and Run returns only
// once that request has.
func TestStopDuringARenewalIsNotAFailure(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		svc := newService(2 * time.Second)
		h := &hanging{service: svc, hang: func(n int) bool { return n >= 2 }, linger: 10 * time.Millisecond}
		r := newRig(t, svc, 1, servicebus.LeasesConfig{Renewer: h})
		time.Sleep(2100 * time.Millisecond) // renewed at 1 s; the request sent at 2 s is out (for ⅓ s)
		synctest.Wait()
		if out, _ := h.counts(); out != 1 {
			t.Fatalf("%d requests out when stopping, want 1", out)
		}
		r.stop()
		st := r.book.Stats()
		if out, _ := h.counts(); out != 0 {
			t.Fatalf("Run returned with %d requests out", out)
		}
		if st.Failures != 0 || st.Lost != 0 || st.Renewed != 1 || st.Requests != 2 || r.lostOnes() != "[]" {
			t.Fatalf("stats %+v, lost %s", st, r.lostOnes())
		}
	})
}

// Each lock is renewed once half the time it had left has passed, in one
// request for locks that arrived together: it has half its duration left
// when renewed, and renewing costs two requests per lock duration.
func TestLocksAreRenewedAtHalfTheirRemainingTime(t *testing.T) {
	for _, lockFor := range []time.Duration{2 * time.Second, 30 * time.Second, 60 * time.Second, 5 * time.Minute} {
		t.Run(lockFor.String(), func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				svc := newService(lockFor)
				r := newRig(t, svc, 5, servicebus.LeasesConfig{MaxRenewal: time.Hour})
				time.Sleep(3*lockFor + lockFor/4) // renewals at ½, 1, … 3 lock durations
				st := r.book.Stats()
				r.stop()
				for i := range 5 {
					left, ok := svc.leastLeft(i)
					if !ok || left < lockFor/2-lockFor/100 {
						t.Errorf("lock %d renewed with %v of %v left (renewed: %v)", i, left, lockFor, ok)
					}
				}
				if st.Lost != 0 || st.Failures != 0 || st.Requests != 6 || st.Renewed != 30 || st.RequestTokens != 30 {
					t.Fatalf("stats %+v", st)
				}
			})
		})
	}
}

// One request that is never answered loses no lock: it is bounded by a
// third of the time its locks have left, and they are asked again in time.
func TestOneUnansweredRequestLosesNoLock(t *testing.T) {
	for _, lockFor := range []time.Duration{4 * time.Second, 30 * time.Second, 60 * time.Second} {
		t.Run(lockFor.String(), func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				start := time.Now()
				svc := newService(lockFor)
				h := &hanging{service: svc, hang: func(n int) bool { return n == 1 }}
				r := newRig(t, svc, 20, servicebus.LeasesConfig{Renewer: h})
				time.Sleep(max(2*lockFor, 25*time.Second))
				st := r.book.Stats()
				r.stop()
				h.mu.Lock()
				hung := h.hung
				h.mu.Unlock()
				t.Logf("lock %v: the unanswered request ended at %v; book %+v", lockFor, hung, st)
				if r.lostOnes() != "[]" || st.Lost != 0 || svc.expired != 0 {
					t.Fatalf("lost %s after one unanswered request; stats %+v", r.lostOnes(), st)
				}
				// Sent at ½ the lock, ended with ⅔ of the other half left.
				if len(hung) != 1 || hung[0].Sub(start) > lockFor/2+lockFor/6 {
					t.Fatalf("the unanswered request ended at %v", hung)
				}
				// Every request carried all 20 locks, the retry included.
				if st.Failures != 1 || st.Requests < 3 || st.RequestTokens != 20*st.Requests {
					t.Fatalf("stats %+v", st)
				}
			})
		})
	}
}

// While one request hangs, locks that fall due go out in requests of their
// own, on time, rather than waiting for it.
func TestAHangingRequestHoldsUpNoOtherLock(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		const lockFor = 60 * time.Second
		svc := newService(lockFor)
		h := &hanging{service: svc, hang: func(n int) bool { return n == 1 }}
		r := newRig(t, svc, 1, servicebus.LeasesConfig{Renewer: h}) // 0: due at 30 s; its request hangs until 40 s
		for i := 1; i <= 4; i++ {
			time.Sleep(2 * time.Second)
			r.src.Push(svc.message(i)) // due at 32, 34, 36, 38 s
		}
		time.Sleep(lockFor)
		st := r.book.Stats()
		r.stop()
		for i := 1; i <= 4; i++ {
			if left, ok := svc.leastLeft(i); !ok || left < lockFor/2-time.Second {
				t.Errorf("lock %d renewed with %v of %v left (renewed: %v)", i, left, lockFor, ok)
			}
		}
		if left, ok := svc.leastLeft(0); !ok || left < lockFor/4 {
			t.Errorf("lock 0 renewed with %v of %v left after its request hung (renewed: %v)", left, lockFor, ok)
		}
		if _, maxOut := h.counts(); st.Lost != 0 || st.Failures != 1 || maxOut != 2 {
			t.Fatalf("stats %+v, %d requests out at most", st, maxOut)
		}
	})
}

// Requests out at once are bounded by MaxInFlight, and Run waits for every
// one of them before it returns.
func TestRequestsInFlightAreBoundedAndAwaited(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		svc := newService(2 * time.Second)
		h := &hanging{service: svc, hang: func(int) bool { return true }, linger: 10 * time.Millisecond}
		r := newRig(t, svc, 10, servicebus.LeasesConfig{Renewer: h, MaxBatch: 1, MaxInFlight: 3})
		time.Sleep(1100 * time.Millisecond) // all 10 due at 1 s; each request given ⅓ s
		synctest.Wait()
		if out, maxOut := h.counts(); out != 3 || maxOut != 3 {
			t.Fatalf("%d requests out, at most %d; want 3", out, maxOut)
		}
		time.Sleep(5 * time.Second)
		r.stop()
		if out, maxOut := h.counts(); out != 0 || maxOut != 3 {
			t.Fatalf("Run returned with %d requests out; at most %d were, want 3", out, maxOut)
		}
		if st := r.book.Stats(); st.Lost != 10 || st.Renewed != 0 || st.Failures == 0 || r.lostOnes() != "[0 1 2 3 4 5 6 7 8 9]" {
			t.Fatalf("stats %+v, lost %s", st, r.lostOnes())
		}
	})
}

// A delivery whose settlement is on its way is not reported lost by the
// book, whether its lock's time passes meanwhile or the service refuses its
// renewal: the settlement's answer decides.
func TestASettlingDeliveryIsNotReportedLost(t *testing.T) {
	t.Run("its lock's time passes", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			svc := newService(2 * time.Second)
			// 1 stays in a handler: its renewals wake the book.
			src := fake.New(true, svc.message(0), svc.message(1))
			src.SettleDelay = 2 * time.Second
			r := newRigWith(t, svc, src, servicebus.LeasesConfig{}, pump.Config{Credit: 4, Settlers: 1, SettleTimeout: 30 * time.Second})
			tk, other := <-r.pump.Out(), <-r.pump.Out()
			tk.Begin()
			other.Begin()
			time.Sleep(1500 * time.Millisecond) // renewed at 1 s: locked until 3 s
			r.pump.Settle(tk, driver.Outcome{Kind: driver.Accept})
			time.Sleep(5 * time.Second) // answered at 3.5 s
			ps, bs := r.pump.Stats(), r.book.Stats()
			r.stop()
			if ps.Accepted != 1 || src.Count(fake.Accepted) != 1 || bs.Lost != 0 || r.lostOnes() != "[]" || bs.Held != 1 {
				t.Fatalf("pump %+v\nbook %+v, lost %s", ps, bs, r.lostOnes())
			}
		})
	})
	t.Run("its renewal is refused", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			svc := newService(2 * time.Second)
			src := fake.New(true, svc.message(0))
			src.SettleDelay = 2 * time.Second
			r := newRigWith(t, svc, src, servicebus.LeasesConfig{}, pump.Config{Credit: 4, Settlers: 1, SettleTimeout: 30 * time.Second})
			tk := <-r.pump.Out()
			tk.Begin()
			svc.mu.Lock()
			svc.during = func([]amqp.UUID) error {
				// Settled while the renewal is out; the service takes
				// the settlement and refuses the renewal (and any that
				// follows before the settler has begun to send it).
				r.pump.Settle(tk, driver.Outcome{Kind: driver.Accept})
				return fmt.Errorf("status 410: %w", servicebus.ErrLockLost)
			}
			svc.mu.Unlock()
			time.Sleep(5 * time.Second)
			ps, bs := r.pump.Stats(), r.book.Stats()
			r.stop()
			if ps.Accepted != 1 || bs.Requests < 1 || bs.Lost != 0 || r.lostOnes() != "[]" || bs.Held != 0 {
				t.Fatalf("pump %+v\nbook %+v, lost %s", ps, bs, r.lostOnes())
			}
		})
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

// The book reports lost locks after it let go of its mutex, so a ticket
// it reports may name an entry that holds the next delivery by then (two
// locks expire in one round; while the book reports the first, the second's
// handler settles and its entry is reused). OnLost gets the message as it
// entered the book, and LoseLease reports that the ticket is stale, so that
// amqpsub never names a delivery whose lock is fine.
func TestOnLostNamesTheMessageThatLostItsLock(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		svc := newService(2 * time.Second)
		src := fake.New(true, svc.message(0), svc.message(1))
		var p *pump.Pump
		var mu sync.Mutex
		tickets := map[int]driver.Ticket{}
		var reported []string
		first := true
		cfg := servicebus.LeasesConfig{Renewer: svc, MaxRenewal: time.Nanosecond}
		cfg.OnLost = func(tk driver.Ticket, m *amqp.Message, _ error) {
			mu.Lock()
			defer mu.Unlock()
			if first {
				first = false
				// While the book reports this one, the other's handler
				// returns and the pump reuses its entry for message 100.
				for i, other := range tickets {
					if other != tk {
						p.Settle(other, driver.Outcome{Kind: driver.Accept})
						src.Push(svc.message(100))
						next := <-p.Out()
						tickets[100] = next
						_ = i
					}
				}
			}
			// What amqpsub's pipe.lockLost reports.
			if p.LoseLease(tk) {
				reported = append(reported, fmt.Sprint(m.Value))
			}
		}
		book := servicebus.NewLeases(cfg)
		p = pump.New(pump.Config{Credit: 256, Leases: book})
		ctx, cancel := context.WithCancel(context.Background())
		var wg sync.WaitGroup
		wg.Go(func() { _ = p.Run(ctx, func(context.Context, error) (driver.Source, error) { return src, nil }) })
		wg.Go(func() { book.Run(ctx) })
		for range 2 {
			tk := <-p.Out()
			tk.Begin()
			book.Bind(tk, func(error) {})
			mu.Lock()
			tickets[tk.Message().Value.(int)] = tk
			mu.Unlock()
		}
		time.Sleep(3 * time.Second) // both locks expire unrenewed (MaxRenewal)
		synctest.Wait()
		cancel()
		wg.Wait()
		mu.Lock()
		defer mu.Unlock()
		t.Logf("lock lost reported for messages %v; book stats %+v", reported, book.Stats())
		// Two locks lost; the second's entry was reused before the book
		// reported it, so only the first is reported.
		if len(reported) != 1 {
			t.Fatalf("lock losses reported for %v; want only the first of the two", reported)
		}
		for _, r := range reported {
			if r != "0" && r != "1" {
				t.Fatalf("a lock loss reported for message %s, delivered after the loss and holding a live lock: reported %v", r, reported)
			}
		}
	})
}

// However the service answers a batch that holds one lost lock — refused
// whole with 410 or 400, or renewed in part with fewer expirations than
// tokens — the book asks token by token before it declares any lock lost:
// only the lost one is reported, and the other 255 stay renewed.
func TestAMixedBatchLosesOnlyItsLostLock(t *testing.T) {
	for _, mode := range []string{"410", "400", "partial"} {
		t.Run(mode, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				svc := newService(4 * time.Second)
				svc.mixed = mode
				r := newRig(t, svc, 256, servicebus.LeasesConfig{})
				synctest.Wait()
				svc.mu.Lock()
				svc.lost[token(100)] = true
				svc.mu.Unlock()
				time.Sleep(20 * time.Second) // ten lock durations
				st := r.book.Stats()
				r.stop()
				if r.lostOnes() != "[100]" || st.Lost != 1 || svc.expired != 0 {
					t.Fatalf("lost %s (%d renewals too late), stats %+v", r.lostOnes(), svc.expired, st)
				}
				if st.Split != 1 || st.Held != 255 {
					t.Fatalf("stats %+v: want 1 split batch, 255 held", st)
				}
				t.Logf("%s: %d requests, %d tokens sent, %d renewed", mode, st.Requests, st.RequestTokens, st.Renewed)
			})
		})
	}
}

// A single token answered 400, or with no expiration, is a failed renewal,
// not a lost lock: it is tried again, and renewed once the service answers.
func TestASingleTokenRefusedWith400IsTriedAgain(t *testing.T) {
	for _, answer := range []error{
		fmt.Errorf("status 400: %w", servicebus.ErrBadRequest),
		nil, // 200 with no expirations
	} {
		synctest.Test(t, func(t *testing.T) {
			svc := newService(4 * time.Second)
			var mu sync.Mutex
			bad := 2 // the first two requests
			rn := renewerFunc(func(ctx context.Context, tokens []amqp.UUID) ([]time.Time, error) {
				mu.Lock()
				defer mu.Unlock()
				if bad > 0 {
					bad--
					return nil, answer
				}
				return svc.RenewLocks(ctx, tokens)
			})
			r := newRig(t, svc, 1, servicebus.LeasesConfig{Renewer: rn})
			time.Sleep(20 * time.Second)
			st := r.book.Stats()
			r.stop()
			if r.lostOnes() != "[]" || st.Failures != 2 || st.Renewed == 0 {
				t.Fatalf("answer %v: lost %s, stats %+v", answer, r.lostOnes(), st)
			}
		})
	}
}

type renewerFunc func(ctx context.Context, tokens []amqp.UUID) ([]time.Time, error)

func (f renewerFunc) RenewLocks(ctx context.Context, tokens []amqp.UUID) ([]time.Time, error) {
	return f(ctx, tokens)
}

// A server-busy answer holds every renewal back for ServerBusyWait (10 s,
// the .NET clients' ServerBusyBaseSleepTime), then renewal goes on: with
// 60 s locks, none is lost.
func TestServerBusyHoldsRenewalsBackTenSeconds(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		svc := newService(60 * time.Second)
		var mu sync.Mutex
		var at []time.Time
		busy := 1
		rn := renewerFunc(func(ctx context.Context, tokens []amqp.UUID) ([]time.Time, error) {
			mu.Lock()
			at = append(at, time.Now())
			b := busy > 0
			busy--
			mu.Unlock()
			if b {
				return nil, fmt.Errorf("status 503: %w", servicebus.ErrServerBusy)
			}
			return svc.RenewLocks(ctx, tokens)
		})
		r := newRig(t, svc, 10, servicebus.LeasesConfig{Renewer: rn})
		time.Sleep(2 * time.Minute)
		st := r.book.Stats()
		r.stop()
		mu.Lock()
		defer mu.Unlock()
		if len(at) < 2 {
			t.Fatalf("%d requests", len(at))
		}
		if gap := at[1].Sub(at[0]); gap < 10*time.Second {
			t.Fatalf("the request after server-busy went out %v later, want ≥ 10s (Microsoft's ServerBusyBaseSleepTime)", gap)
		}
		if r.lostOnes() != "[]" || st.ServerBusy != 1 || st.Renewed < 10 {
			t.Fatalf("lost %s, stats %+v", r.lostOnes(), st)
		}
	})
}

// A lock that would expire during the server-busy wait is reported lost
// when it expires, not later.
func TestALockExpiringDuringTheServerBusyWaitIsLostOnTime(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		svc := newService(4 * time.Second)
		svc.fail = fmt.Errorf("status 503: %w", servicebus.ErrServerBusy)
		start := time.Now()
		var lostAt time.Time
		r := newRig(t, svc, 1, servicebus.LeasesConfig{})
		for r.lostOnes() == "[]" && time.Since(start) < time.Minute {
			time.Sleep(100 * time.Millisecond)
		}
		lostAt = time.Now()
		st := r.book.Stats()
		r.stop()
		if r.lostOnes() != "[0]" || lostAt.Sub(start) > 4*time.Second+200*time.Millisecond || st.Requests != 1 {
			t.Fatalf("lost %s after %v, stats %+v", r.lostOnes(), lostAt.Sub(start), st)
		}
	})
}
