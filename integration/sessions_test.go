package integration

import (
	"context"
	"errors"
	"fmt"
	"math"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/amqpsub/amqpsub/amqpsub"
	"github.com/amqpsub/amqpsub/internal/credit"
)

// Service Bus sessions.

// 20 sessions of 100 messages, 4 held at once, WorkersByKey inside: every
// session in order, every message accepted once; a session that goes idle
// is released, and a session that gets messages later is accepted.
func TestServiceBusSessions(t *testing.T) {
	p := serviceBusPeer(t)
	q := p.entity(t, map[string]any{"lock_duration_ms": 3000, "requires_session": true})
	const sessions, per = 20, 100
	p.send(t, q, sessions*per, "-sessions", fmt.Sprint(sessions))
	var mu sync.Mutex
	last := map[string]int64{}
	violations, handled := 0, 0
	seenSlots := map[string]bool{}
	s, err := amqpsub.New(sbConnector(t, p), q, amqpsub.HandlerFunc(func(ctx context.Context, d *amqpsub.Delivery) error {
		seq, _ := d.ApplicationProperties()["seq"].(int64)
		mu.Lock()
		defer mu.Unlock()
		sid := d.SessionID()
		if sid == "" || sid != d.GroupID() {
			violations++
		}
		if seq != last[sid]+1 {
			violations++
		}
		last[sid] = seq
		seenSlots[sid] = true
		handled++
		return nil
	}), amqpsub.Sessions(4), amqpsub.WorkersByKey(2), amqpsub.SessionIdleTimeout(time.Second),
		amqpsub.DialTimeout(4*time.Second), amqpsub.Logger(logger(t)))
	if err != nil {
		t.Fatal(err)
	}
	stop, wait := runSub(t, s)
	waitFor(t, 2*time.Minute, "2,000 completed", func() bool { return p.info(t, q).Stats["completed"] == sessions*per })
	// Every session has been drained and let go; a late one is accepted.
	p.send(t, q, 5, "-session-ids", "late", "-start", "5000")
	waitFor(t, time.Minute, "the late session", func() bool { return p.info(t, q).Stats["completed"] == sessions*per+5 })
	stop()
	if err := wait(); err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	defer mu.Unlock()
	st := s.Stats()
	t.Logf("handled %d over %d sessions, %d violations; stats %v", handled, len(last), violations, st)
	if violations != 0 || handled != sessions*per+5 || len(last) != sessions+1 || last["late"] != 5 {
		t.Fatalf("handled %d, %d sessions, %d order violations", handled, len(last), violations)
	}
	if st.MaxHeld > 256 || st.Settled.Accepted != sessions*per+5 {
		t.Fatalf("stats %v", st)
	}
}

// The session rows of the shape matrix: every lane mode inside a Service
// Bus session consumer, against the peer (amqpsubtest plays no sessions).
//
// Each row consumes a session-enabled queue of more sessions than the
// consumer holds at once, so that its pipes move from session to session,
// and asserts, on Stats sampled every 10 ms, the adaptive credit's bound
// for the whole session consumer and what it allows to be held
// (sessionBound, checkBounds); that every message is completed once (the
// peer's counters and the handlers' record); and each session's order
// under WorkersByKey, with or without BalanceKeys, LocalRetry included,
// which retries in the lane. Workers runs a session's messages side by
// side (see Sessions), so its rows assert no order.
//
// Inside a session every message carries the session id as its group-id,
// so WorkersByKey keys every message of a session alike: one lane of a
// session's pipe works, and each delivery behind it is parked, held on top
// of the floor since the session pins its messages to this consumer.
func TestServiceBusSessionsMatrix(t *testing.T) {
	p := serviceBusPeer(t)
	type lanesMode struct {
		name    string
		opts    []amqpsub.Option
		ordered bool
	}
	modes := []lanesMode{
		{"Workers", []amqpsub.Option{amqpsub.Workers(sessionMatrixLanes)}, false},
		{"WorkersByKey", []amqpsub.Option{amqpsub.WorkersByKey(sessionMatrixLanes)}, true},
		{"BalanceKeys", []amqpsub.Option{amqpsub.WorkersByKey(sessionMatrixLanes), amqpsub.BalanceKeys()}, true},
	}
	for _, m := range modes {
		for _, batch := range []bool{false, true} {
			for _, retry := range []bool{false, true} {
				r := sessionRow{lanes: m.opts, ordered: m.ordered, batch: batch, localRetry: retry}
				name := m.name
				if batch {
					name += "/batch"
				} else {
					name += "/single"
				}
				if retry {
					name += "/LocalRetry"
				}
				t.Run(name, func(t *testing.T) { r.run(t, p) })
			}
		}
	}
}

// The table's shape: sessions of messages over a consumer that holds
// fewer at once, so that its pipes move from session to session.
const (
	sessionMatrixHeld     = 3  // Sessions(n)
	sessionMatrixSessions = 5  // sessions of messages on the queue
	sessionMatrixPer      = 24 // messages a session
	sessionMatrixLanes    = 2  // Workers(k) / WorkersByKey(k), per session
	sessionMatrixCredit   = 48 // Credit: a share of 16 a session
	sessionMatrixBatch    = 4  // Batch(size, …)
)

type sessionRow struct {
	lanes      []amqpsub.Option
	ordered    bool // the lane mode keeps a group's order
	batch      bool
	localRetry bool
}

// sessionSample is one reading of Stats.
type sessionSample struct {
	at time.Time
	st amqpsub.Stats
}

// sessionRecord is what the handlers saw.
type sessionRecord struct {
	mu        sync.Mutex
	done      map[string]int // body → successful handlings
	attempts  map[string]int // body → handler calls
	last      map[string]int // session → seq of its last success
	outOfSeq  []string
	wrongID   []string
	succeeded int
}

func (r *sessionRow) run(t *testing.T, p *sbPeer) {
	q := p.fxEntity(t, map[string]any{"lock_duration_ms": 30000, "requires_session": true, "max_delivery_count": 10})
	ids := make([]string, sessionMatrixSessions)
	for i := range ids {
		ids[i] = fmt.Sprintf("s%d", i)
	}
	const total = sessionMatrixSessions * sessionMatrixPer
	p.call(t, "POST", "/messages", map[string]any{"entity": q, "count": total, "message_id_prefix": "m", "sessions": ids}, nil)

	rec := &sessionRecord{done: map[string]int{}, attempts: map[string]int{}, last: map[string]int{}}
	for _, id := range ids {
		rec.last[id] = -1
	}
	opts := append([]amqpsub.Option{
		amqpsub.Sessions(sessionMatrixHeld),
		amqpsub.Credit(sessionMatrixCredit),
		amqpsub.SessionIdleTimeout(300 * time.Millisecond),
		amqpsub.DialTimeout(4 * time.Second),
		amqpsub.Logger(logger(t)),
	}, r.lanes...)
	if r.localRetry {
		opts = append(opts, amqpsub.LocalRetry(amqpsub.RetryPolicy{Attempts: 3, Initial: 5 * time.Millisecond, Max: 5 * time.Millisecond}))
	}
	var s *amqpsub.Subscriber
	var err error
	if r.batch {
		opts = append(opts, amqpsub.Batch(sessionMatrixBatch, 5*time.Millisecond))
		s, err = amqpsub.NewBatch(sbConnector(t, p), q, amqpsub.BatchHandlerFunc(func(_ context.Context, b []*amqpsub.Delivery) []error {
			time.Sleep(3 * time.Millisecond)
			return rec.batch(r, b)
		}), opts...)
	} else {
		s, err = amqpsub.New(sbConnector(t, p), q, amqpsub.HandlerFunc(func(_ context.Context, d *amqpsub.Delivery) error {
			time.Sleep(2 * time.Millisecond)
			return rec.one(r, d, false)
		}), opts...)
	}
	if err != nil {
		t.Fatal(err)
	}

	// Sampled from before Run, so that the first sample counts no
	// settlement.
	var samples []sessionSample
	sampled := make(chan struct{})
	stopSampling := make(chan struct{})
	var once sync.Once
	endSampling := func() {
		once.Do(func() { close(stopSampling) })
		<-sampled
	}
	t.Cleanup(endSampling)
	go func() {
		defer close(sampled)
		tick := time.NewTicker(10 * time.Millisecond)
		defer tick.Stop()
		for {
			samples = append(samples, sessionSample{at: time.Now(), st: s.Stats()})
			select {
			case <-tick.C:
			case <-stopSampling:
				samples = append(samples, sessionSample{at: time.Now(), st: s.Stats()})
				return
			}
		}
	}()
	began := time.Now()
	stop, wait := runSub(t, s)
	// Accepted counts the settlements the peer answered: once it is
	// total, the peer has completed them (read once, at the end, so that
	// the control API does not load the peer meanwhile).
	waitFor(t, 45*time.Second, fmt.Sprintf("%d accepted", total), func() bool {
		return s.Stats().Settled.Accepted >= total && rec.count() >= total
	})
	took := time.Since(began)
	endSampling()
	stop()
	if err := wait(); err != nil && !errors.Is(err, context.Canceled) {
		t.Fatalf("Run: %v", err)
	}

	st := s.Stats()
	e := p.info(t, q)
	rec.mu.Lock()
	defer rec.mu.Unlock()
	t.Logf("%d messages in %v; peer %+v; stats %v", total, took.Round(time.Millisecond), e.Stats, st)

	// Nothing lost, nothing twice: the peer completed each message once
	// and delivered none again; the handlers succeeded on each once.
	if e.Stats["completed"] != total || e.Stats["delivered"] != total || e.Available != 0 || e.Locked != 0 || e.DeadLetter != 0 {
		t.Errorf("peer: completed %d, delivered %d, available %d, locked %d, dead-lettered %d; want %d, %d, 0, 0, 0",
			e.Stats["completed"], e.Stats["delivered"], e.Available, e.Locked, e.DeadLetter, total, total)
	}
	if len(rec.done) != total {
		t.Errorf("handlers succeeded on %d distinct messages, want %d", len(rec.done), total)
	}
	for id, n := range rec.done {
		if n != 1 {
			t.Errorf("message %s succeeded %d times", id, n)
		}
	}
	if st.Settled.Accepted != total || st.Results.Accept != total || st.Results.Retry != 0 || st.Results.Release != 0 ||
		st.Stale != 0 || st.Dropped != 0 || st.SettleErrors != 0 || st.Unsent != 0 || st.Locks.Lost != 0 {
		t.Errorf("stats %v: want %d accepted and nothing else", st, total)
	}
	if len(rec.wrongID) > 0 {
		t.Errorf("deliveries whose body, SessionID or GroupID do not name their session: %v", rec.wrongID)
	}
	if r.ordered && len(rec.outOfSeq) > 0 {
		t.Errorf("%d out of their session's order: %v", len(rec.outOfSeq), rec.outOfSeq[:min(10, len(rec.outOfSeq))])
	}
	if st.Links < sessionMatrixSessions {
		t.Errorf("%d links for %d sessions: the pipes did not move from session to session", st.Links, sessionMatrixSessions)
	}
	if r.localRetry && st.Results.LocalRetries == 0 {
		t.Errorf("no local retry, want some: %v", st)
	}

	r.checkBounds(t, samples)
}

// failsFirst: under LocalRetry, every fifth message of a session fails
// its first attempt.
func failsFirst(seq int) bool { return seq%5 == 2 }

// one records a handler call of d; failGroup says that an earlier
// delivery of its session failed in the same batch.
func (rec *sessionRecord) one(r *sessionRow, d *amqpsub.Delivery, failGroup bool) error {
	raw, _ := d.Body()
	body := string(raw)
	sid, k, _ := strings.Cut(body, "/") // the peer's body: <session>/<place in it>
	seq, err := strconv.Atoi(k)
	rec.mu.Lock()
	defer rec.mu.Unlock()
	id := body
	rec.attempts[id]++
	if err != nil || d.SessionID() != sid || d.GroupID() != sid {
		rec.wrongID = append(rec.wrongID, fmt.Sprintf("%s: session %q, group %q", body, d.SessionID(), d.GroupID()))
	}
	if r.localRetry && (failGroup || failsFirst(seq) && rec.attempts[id] == 1) {
		return amqpsub.Retry(errors.New("the first attempt fails"))
	}
	rec.done[id]++
	rec.succeeded++
	if seq != rec.last[sid]+1 {
		rec.outOfSeq = append(rec.outOfSeq, fmt.Sprintf("%s after %d", body, rec.last[sid]))
	}
	rec.last[sid] = seq
	return nil
}

// batch records a batch; a delivery that fails fails the later ones of
// its session in the batch too, as LocalRetry's doc asks of a batch
// handler, so that the session keeps its order.
func (rec *sessionRecord) batch(r *sessionRow, b []*amqpsub.Delivery) []error {
	var res []error
	failed := map[string]bool{}
	for i, d := range b {
		err := rec.one(r, d, failed[d.SessionID()])
		if err != nil {
			if res == nil {
				res = make([]error, len(b))
			}
			res[i] = err
			failed[d.SessionID()] = true
		}
	}
	return res
}

func (rec *sessionRecord) count() int {
	rec.mu.Lock()
	defer rec.mu.Unlock()
	return rec.succeeded
}

// sessionLag is how old the figures a sample's Credit was computed from
// may be: the pump recomputes it after each event of its link and, while
// anything is held or it is above its floor, every 10 ms (on a loaded
// machine, under -race, a little later), and the samples are 10 ms apart.
const sessionLag = 50 * time.Millisecond

// sessionBound is the adaptive credit's bound for the whole session
// consumer, from amqpsub's build, newPipe and Stats and credit's targetAt:
//
//   - Sessions(n) makes n pipes (one for each session held at once, also
//     while it holds none), each with a pump whose ceiling is its share,
//     c = max(1, ⌊Credit/n⌋); CreditLimit is their sum, n·c.
//   - Each pipe has lanes of its own (Workers(k) per session), so its
//     floor is k·need (need = 1, or the batch size, at most Credit), at
//     most its ceiling: f = min(k·need, c). The floor is not shared.
//   - Each pipe's allowance is its own lanes' parked count, in full on a
//     session consumer; Stats.Parked is their sum.
//   - Each pipe's limit is min(c, f + parked + ⌈4·rate·max(rtt, 2 ms)⌉),
//     with its own rate and round trip. Stats.RoundTrip is the longest of
//     the pipes', and the rates add up to the rate of all settlements, so
//     Σ ⌈4·rateᵢ·max(rttᵢ, 2 ms)⌉ ≤ ⌈4·Σrateᵢ·max(RoundTrip, 2 ms)⌉ + n − 1.
//
// So Stats.Credit ≤ min(n·c, n·f + parked + ⌈4·rate·max(RoundTrip, 2 ms)⌉ + n − 1),
// with the figures as the pumps saw them when they last computed it, up to
// sessionLag before the sample. The samples bound them from above:
//
//   - rate: the pumps' decaying count of settlements (credit.DrainWindow),
//     each interval's settlements counted as if they came at its end, as of
//     sessionLag before the sample;
//   - round trip: the longest sampled within sessionLag;
//   - parked: 0 under Workers (unordered workers park nothing). Under
//     WorkersByKey, with or without BalanceKeys, every message of a session
//     has the session id as its group-id, so all but one of what a pipe's
//     lanes hold waits behind an earlier delivery of its group: the parked
//     count is about what the lanes hold, and moves with every delivery
//     that enters or leaves them, between samples too (BalanceKeys parks
//     a group's pooled deliveries at once when a lane takes the group).
//     A pipe's parked count is at most what its lanes hold: Buffered and
//     Handling, and the deliveries of a lane's call that settled but have
//     not left the lane yet (a batch at most, in the one lane a session's
//     single group keeps busy; for as long as LocalRetry retries the
//     batch's failed deliveries, its accepted ones stay counted though
//     settled, and freed once the service answered). What the lanes hold rises between two
//     samples only by what arrives. So: the most, over the intervals
//     ending within sessionLag, of Buffered + Handling at the interval's
//     start plus what was received in it, and n·need (and at least the
//     most Parked sampled).
type sessionBound struct {
	n, share, need, floor int
}

func (r *sessionRow) shape() sessionBound {
	n := sessionMatrixHeld
	share := max(1, sessionMatrixCredit/n)
	need := 1
	if r.batch {
		need = min(sessionMatrixBatch, sessionMatrixCredit)
	}
	return sessionBound{n: n, share: share, need: need, floor: min(sessionMatrixLanes*need, share)}
}

// settledAll counts every delivery that left the pumps (each is a
// settlement the drain rate counts).
func settledAll(st amqpsub.Stats) uint64 {
	return st.Settled.Accepted + st.Settled.Released + st.Settled.Modified + st.Settled.Rejected +
		st.SettleErrors + st.Stale + st.Dropped + st.Unsent + st.Locks.Dropped + st.Locks.Skipped
}

// checkBounds asserts on every sample:
//
//   - Credit within sessionBound;
//   - Held within CreditLimit, since the peer sends only against credit;
//   - Held within the highest bound of the row so far, and one credit a
//     pipe: a pipe holds at most what the limit of its last grant allowed,
//     and one credit past it (the flow frame owed after its last
//     settlement). The pipes' highest limits may come at different times,
//     so this is the whole subscriber's reading of that rule, not a
//     consequence of it.
//
// Held is not asserted within the bound of the moment and a grant (a
// pipe's chunk, max(1, c/8)): a lowered limit takes nothing back, and
// on Service Bus a session's settlements go out one at a time (ordered by
// group-id, each waits for the service's answer to the one before), so
// when handlers outrun the answers the held deliveries queue as Settling,
// where they are neither parked nor yet counted in the drain rate, and
// the limit falls towards the floor while they wait. How far Held went
// past that is logged.
func (r *sessionRow) checkBounds(t *testing.T, samples []sessionSample) {
	t.Helper()
	b := r.shape()
	limit := b.n * b.share
	tau := credit.DrainWindow.Seconds()
	keyed := r.ordered // WorkersByKey, with or without BalanceKeys
	maxCredit, maxBound, maxHeld, maxParked, violations := 0, 0, 0, 0, 0
	highest := 0 // the highest bound of the row so far
	chunk := max(1, b.share/8)
	// Held past the bound of the moment and a grant a pipe: how often, by
	// how much at most, and when.
	overs, over, overAt, overSt := 0, 0, 0, amqpsub.Stats{}
	// Parked past Held: a batch that LocalRetry retries stays counted in
	// its lane, parked deliveries and all, until the call returns, though
	// its accepted deliveries were settled (and, once the service
	// answered, freed) at once. The bound allows a batch a pipe of that
	// (see sessionBound); how far it went is logged.
	parkedOver, parkedOverSt := 0, amqpsub.Stats{}
	fail := func(k int, format string, args ...any) {
		t.Helper()
		violations++
		for m := max(0, k-6); m <= k; m++ {
			x := samples[m].st
			t.Logf("  #%d +%v: credit %d, parked %d, held %d (buffered %d, handling %d, settling %d), received %d, settled %d, round trip %v",
				m, samples[m].at.Sub(samples[0].at).Round(time.Millisecond), x.Credit, x.Parked, x.Held, x.Buffered, x.Handling, x.Settling,
				x.Received, settledAll(x), x.RoundTrip)
		}
		t.Errorf("sample %d (+%v): "+format, append([]any{k, samples[k].at.Sub(samples[0].at).Round(time.Millisecond)}, args...)...)
		if violations >= 10 {
			t.Fatal("too many violations")
		}
	}
	for k, s := range samples {
		st := s.st
		if st.CreditLimit != limit {
			t.Fatalf("sample %d: CreditLimit %d, want %d (n=%d × share %d)", k, st.CreditLimit, limit, b.n, b.share)
		}
		if !keyed && st.Parked != 0 {
			fail(k, "parked %d under Workers", st.Parked)
		}
		ref := s.at.Add(-sessionLag)
		drained, rtt, parked, lanes := 0.0, credit.MinRoundTrip, st.Parked, st.Buffered+st.Handling
		for m := 1; m <= k; m++ {
			d := float64(settledAll(samples[m].st) - settledAll(samples[m-1].st))
			if age := ref.Sub(samples[m].at).Seconds(); age > 0 {
				d *= math.Exp(-age / tau)
			}
			drained += d
		}
		for m := k; m >= 0 && !samples[m].at.Before(ref); m-- {
			x := samples[m].st
			rtt = max(rtt, x.RoundTrip)
			parked = max(parked, x.Parked)
			if m > 0 {
				y := samples[m-1].st
				lanes = max(lanes, y.Buffered+y.Handling+int(x.Received-y.Received))
			}
		}
		if keyed {
			parked = max(parked, lanes+b.n*b.need)
		} else {
			parked = 0
		}
		inFlight := int(math.Ceil(credit.Headroom * drained / tau * rtt.Seconds()))
		bound := min(limit, b.n*b.floor+parked+inFlight+b.n-1)
		highest = max(highest, bound)
		maxCredit, maxBound = max(maxCredit, st.Credit), max(maxBound, bound)
		maxHeld, maxParked = max(maxHeld, st.Held), max(maxParked, st.Parked)
		if d := st.Parked - st.Held; d > parkedOver {
			parkedOver, parkedOverSt = d, st
		}
		if st.Credit > bound {
			fail(k, "credit %d > bound %d = min(%d, %d·%d + parked %d + ⌈4 × %.0f/s × %v⌉ + %d); %v",
				st.Credit, bound, limit, b.n, b.floor, parked, drained/tau, rtt, b.n-1, st)
		}
		if st.Held > limit || st.Held > highest+b.n {
			fail(k, "held %d > min(CreditLimit %d, highest bound so far %d + %d); %v", st.Held, limit, highest, b.n, st)
		}
		if d := st.Held - (bound + b.n*chunk); d > 0 {
			overs++
			if d > over {
				over, overAt, overSt = d, k, st
			}
		}
	}
	if st := samples[len(samples)-1].st; st.MaxHeld > limit {
		t.Errorf("max held %d > CreditLimit %d", st.MaxHeld, limit)
	}
	t.Logf("%d samples: credit at most %d (bound at most %d, limit %d, floor %d·%d), held at most %d, parked at most %d",
		len(samples), maxCredit, maxBound, limit, b.n, b.floor, maxHeld, maxParked)
	if parkedOver > 0 {
		t.Logf("parked past held by up to %d: %v", parkedOver, parkedOverSt)
	}
	if overs > 0 {
		t.Logf("held past the bound of the moment + %d·%d in %d samples, by up to %d (sample %d, +%v: %v)",
			b.n, chunk, overs, over, overAt, samples[overAt].at.Sub(samples[0].at).Round(time.Millisecond), overSt)
	}
}
