package servicebus

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/Azure/go-amqp"
	"go.uber.org/zap"

	"github.com/amqpsub/amqpsub/internal/driver"
	"github.com/amqpsub/amqpsub/internal/loglimit"
)

// Renewer renews message locks (com.microsoft:renew-lock on the entity's
// $management node). expiries[i] is the new expiry of tokens[i]. An error
// that wraps [ErrLockLost] says that (at least one of) the locks is lost; one
// that wraps [ErrBadRequest] that the service refused the request (status
// 400); one that wraps [ErrIncomplete] that it answered with fewer (or more)
// expirations than tokens; one that wraps [ErrServerBusy] that it is
// throttling. A request whose ctx ends returns ctx's error.
type Renewer interface {
	RenewLocks(ctx context.Context, tokens []amqp.UUID) (expiries []time.Time, err error)
}

// ErrLockLost is wrapped by the errors of a [Renewer] when the service says a
// lock is lost (status 410), and is the cause of a handler's context
// cancelled for that reason.
var ErrLockLost = errors.New("amqpsub: the message lock was lost")

// ErrBadRequest is wrapped by the errors of a [Renewer] when the service
// refuses a request as a whole (status 400). For a request of several
// tokens the book then asks for each on its own; for one token it is a
// failed renewal, tried again until the lock expires.
var ErrBadRequest = errors.New("amqpsub: the service refused the request")

// ErrIncomplete is wrapped by the errors of a [Renewer] when the service
// answered a request with a number of expirations other than its tokens',
// so which locks it renewed is unknown. For a request of several tokens
// the book then asks for each on its own; for one token it is a failed
// renewal, tried again until the lock expires.
var ErrIncomplete = errors.New("amqpsub: the answer's expirations do not match the request's tokens")

// ErrServerBusy is wrapped by the errors of a [Renewer] when the service is
// throttling (com.microsoft:server-busy, status 503): the book then sends
// no renewal for [ServerBusyWait].
var ErrServerBusy = errors.New("amqpsub: the service is busy (throttling)")

// ServerBusyWait is how long the book sends no renewal after a
// server-busy answer: the ServerBusyBaseSleepTime of Microsoft's .NET
// clients (Azure.Messaging.ServiceBus ServiceBusRetryPolicy). A lock that
// expires meanwhile is lost.
const ServerBusyWait = 10 * time.Second

// LeasesConfig configures a [Leases].
type LeasesConfig struct {
	// Renewer renews locks. nil renews none: the book then only binds
	// handlers' contexts to their deliveries (LoseAll), as for the messages
	// of a Service Bus session, which the session's lock covers.
	Renewer Renewer
	// MaxRenewal is how long after its handler began (Bind) a delivery's
	// lock is still renewed; after that it expires. While it waits for a
	// handler it is renewed without a bound: the credit bounds how many
	// wait, and a wait behind a busy group must not cost the lock. 0 means
	// 5 minutes (the .NET processor's MaxAutoLockRenewalDuration, which
	// also counts from the handler's start).
	MaxRenewal time.Duration
	// Timeout bounds each renewal request. A request is also bounded by a
	// third of the time left on the earliest lock in it, so that one that
	// is never answered leaves time to ask again. 0 means 10 s.
	Timeout time.Duration
	// MaxBatch is the most lock tokens in one request. 0 means 256.
	MaxBatch int
	// MaxInFlight is the most renewal requests out at once: while one waits
	// for its answer, locks falling due go out in others. 0 means 4.
	MaxInFlight int
	// OnLost is told, once, of each delivery whose lock was lost, and why
	// (an error wrapping [ErrLockLost]), before a handler's context bound to
	// it is cancelled. It runs on Run's goroutine (or LoseAll's caller's)
	// and must not block. Required.
	// m is the delivery's message, as it was when the delivery entered the
	// book (the ticket's entry may hold another by now).
	OnLost func(t driver.Ticket, m *amqp.Message, why error)
	// Logger receives the book's logs; nil means none.
	Logger *zap.Logger
	// OnRenewed, when set, is told of each request that renewed locks: n
	// locks were renewed by it. It runs on a renewing goroutine and must
	// not block.
	OnRenewed func(n int)
}

// LeasesStats are a [Leases]'s counters.
type LeasesStats struct {
	Held          int    // deliveries in the book now, renewable or not
	Requests      uint64 // renewal requests sent
	Renewed       uint64 // locks renewed
	Lost          uint64 // locks lost: refused by the service, or expired unrenewed
	Failures      uint64 // requests that failed other than with a lost lock
	Unrenewable   uint64 // deliveries without a lock token or expiry (never renewed)
	PastMaxRenew  uint64 // locks left to expire after MaxRenewal
	RequestTokens uint64 // tokens sent in all requests (Renewed + lost + failed)
	Split         uint64 // requests of several tokens answered 410, 400 or without all expirations, then asked token by token
	ServerBusy    uint64 // requests answered server-busy
}

// Leases is the lease book. Create it with [NewLeases]; run Run.
type Leases struct {
	cfg     LeasesConfig
	log     *zap.Logger
	limited *loglimit.Logger // lines that can fire once per delivery or request
	wake    chan struct{}

	mu      sync.Mutex
	entries map[*driver.Delivery]*entry
	stats   LeasesStats
	// busyUntil: no request goes out before it (a server-busy answer).
	busyUntil time.Time
}

type entry struct {
	t        driver.Ticket
	msg      *amqp.Message // t's message, which t may no longer reach
	token    amqp.UUID
	until    time.Time // when the lock expires
	began    time.Time // when its handler began (Bind); zero while it waits
	due      time.Time // when to renew it next
	cancel   context.CancelCauseFunc
	renewing bool // in a request now
}

// NewLeases returns a [Leases]. It panics on a [LeasesConfig] without OnLost, which
// callers validate first.
func NewLeases(cfg LeasesConfig) *Leases {
	if cfg.OnLost == nil {
		panic("servicebus: LeasesConfig needs OnLost")
	}
	if cfg.MaxRenewal <= 0 {
		cfg.MaxRenewal = 5 * time.Minute
	}
	if cfg.Timeout <= 0 {
		cfg.Timeout = 10 * time.Second
	}
	if cfg.MaxBatch <= 0 {
		cfg.MaxBatch = 256
	}
	if cfg.MaxInFlight <= 0 {
		cfg.MaxInFlight = 4
	}
	log := cfg.Logger
	if log == nil {
		log = zap.NewNop()
	}
	return &Leases{cfg: cfg, log: log, limited: loglimit.New(log, loglimit.Every), wake: make(chan struct{}, 1),
		entries: map[*driver.Delivery]*entry{}}
}

// LockToken returns the lock token of a Service Bus delivery: its 16-byte
// delivery tag, which the service writes in .NET's Guid layout (the first
// three fields little-endian), as the RFC 4122 UUID that $management
// takes.
func LockToken(tag []byte) (amqp.UUID, bool) {
	var u amqp.UUID
	if len(tag) != 16 {
		return u, false
	}
	u[0], u[1], u[2], u[3] = tag[3], tag[2], tag[1], tag[0]
	u[4], u[5] = tag[5], tag[4]
	u[6], u[7] = tag[7], tag[6]
	copy(u[8:], tag[8:])
	return u, true
}

// LockedUntil returns a delivery's lock expiry, from its message
// annotation x-opt-locked-until.
func LockedUntil(m *amqp.Message) (time.Time, bool) {
	v, ok := m.Annotations["x-opt-locked-until"]
	if !ok {
		v, ok = m.Annotations[amqp.Symbol("x-opt-locked-until")]
	}
	t, isTime := v.(time.Time)
	return t, ok && isTime
}

// dueAt is when a lock that expires at until, seen at now, is renewed:
// once half its remaining time has passed, so that the other half leaves
// room for a request that goes unanswered and the one that follows it.
func dueAt(now, until time.Time) time.Time {
	remaining := until.Sub(now)
	if remaining <= 0 {
		return now
	}
	return now.Add(remaining / 2)
}

// requestTimeout bounds a request, sent at now, whose earliest lock expires
// at until: a third of what is left of that lock, at most Timeout.
func (b *Leases) requestTimeout(now, until time.Time) time.Duration {
	return max(time.Millisecond, min(b.cfg.Timeout, until.Sub(now)/3))
}

// Add enters the delivery t in the book ([driver.Leases]). A delivery without
// a usable lock token or expiry is kept (so Bind and Remove work) but never
// renewed, counted ([LeasesStats.Unrenewable]) and logged, limited.
func (b *Leases) Add(t driver.Ticket) {
	now := time.Now()
	m := t.Message()
	e := &entry{t: t, msg: m}
	token, okToken := LockToken(m.DeliveryTag)
	until, okUntil := LockedUntil(m)
	b.mu.Lock()
	defer b.mu.Unlock()
	b.entries[t.Entry()] = e
	if b.cfg.Renewer == nil {
		return
	}
	if !okToken || !okUntil {
		b.stats.Unrenewable++
		b.limited.Warn("delivery without a usable lock (a 16-byte delivery tag and x-opt-locked-until); its lock is not renewed",
			zap.Int("tag_bytes", len(m.DeliveryTag)), zap.Bool("has_locked_until", okUntil))
		return
	}
	e.token, e.until, e.due = token, until, dueAt(now, until)
	b.signal()
}

// Remove takes the delivery out of the book ([driver.Leases]): settled,
// dropped or released.
func (b *Leases) Remove(d *driver.Delivery) {
	b.mu.Lock()
	delete(b.entries, d)
	b.mu.Unlock()
}

// LostAnswer reports whether err, the service's answer to a settlement,
// says that the delivery's lock was lost ([CondLockLost]); for
// [driver.Leases].
func (b *Leases) LostAnswer(err error) bool { return IsCond(err, CondLockLost) }

// Bind ties a handler's context to t: it is cancelled, with [ErrLockLost] as
// its cause, if t's lock is lost. MaxRenewal counts from the first Bind of
// t. It reports false if t is not in the book (any more).
func (b *Leases) Bind(t driver.Ticket, cancel context.CancelCauseFunc) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	e, ok := b.entries[t.Entry()]
	if !ok || e.t != t {
		return false
	}
	if e.began.IsZero() {
		e.began = time.Now()
	}
	e.cancel = cancel
	return true
}

func (b *Leases) signal() {
	select {
	case b.wake <- struct{}{}:
	default:
	}
}

// Stats returns the book's counters; it may be called from any goroutine.
func (b *Leases) Stats() LeasesStats {
	b.mu.Lock()
	defer b.mu.Unlock()
	s := b.stats
	s.Held = len(b.entries)
	return s
}

// Run renews locks until ctx ends. It sends each request on a goroutine of
// its own, at most MaxInFlight at once, and returns once every request has
// returned: ctx's end cancels them (a [Renewer] must honour its ctx). A
// renewal cut short by ctx is not a failure; a lock the service refused
// meanwhile is still reported to OnLost, before Run returns.
func (b *Leases) Run(ctx context.Context) {
	// Each request goroutine sends one report on finished as its last act,
	// and at most MaxInFlight are out, so none ever blocks on it.
	finished := make(chan []*entry, b.cfg.MaxInFlight)
	var requests sync.WaitGroup
	inFlight := 0
	// The counts of lines limited since their last at their level are
	// said as the book ends (a stop), not lost.
	defer b.limited.Flush()
	defer func() {
		requests.Wait()
		for ; inFlight > 0; inFlight-- {
			b.loseRefused(<-finished)
		}
	}()
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	for ctx.Err() == nil {
		renew, lost, next := b.round(time.Now(), (b.cfg.MaxInFlight-inFlight)*b.cfg.MaxBatch)
		for _, e := range lost {
			b.lose(e, errExpired)
		}
		for i := 0; i < len(renew); i += b.cfg.MaxBatch {
			batch := renew[i:min(len(renew), i+b.cfg.MaxBatch)]
			if ctx.Err() != nil {
				for _, e := range batch {
					b.done(e)
				}
				continue
			}
			inFlight++
			requests.Go(func() { finished <- b.renew(ctx, batch) })
		}
		if len(renew) > 0 || len(lost) > 0 {
			continue // look again at once, for when to look next
		}
		timer.Reset(time.Until(next))
		select {
		case <-ctx.Done():
			return
		case <-b.wake:
			timer.Stop()
		case refused := <-finished:
			inFlight--
			timer.Stop()
			b.loseRefused(refused)
		case <-timer.C:
		}
	}
}

// round picks the locks to renew now (every one due within a window of
// the earliest, so that they share a request; at most room, those that
// expire first), the ones past their expiry, and when to look next.
//
// Deliveries whose settlement is being sent (driver.Ticket.Sending) are left
// alone: renewing one would only be refused as lost, and whether it is lost
// is for the settlement's answer to say. One whose settlement waits for its
// turn (behind the earlier ones of its group) is still renewed, but not
// reported lost when it expires: its settlement's answer says that too.
func (b *Leases) round(now time.Time, room int) (renew, lost []*entry, next time.Time) {
	b.mu.Lock()
	defer b.mu.Unlock()
	next = now.Add(time.Hour)
	var earliest *entry
	for d, e := range b.entries {
		if e.until.IsZero() || e.renewing || e.t.Sending() {
			continue
		}
		if !e.until.After(now) {
			if e.t.State() != driver.Settling { // else its settlement's answer says
				lost = append(lost, e)
				delete(b.entries, d)
			}
			continue
		}
		if earliest == nil || e.due.Before(earliest.due) {
			earliest = e
		}
	}
	if earliest == nil {
		return nil, lost, next
	}
	if now.Before(b.busyUntil) {
		// Throttled: nothing goes out until the wait is over, but locks
		// that expire meanwhile are reported when they do.
		next = b.busyUntil
		for _, e := range b.entries {
			if !e.until.IsZero() && !e.renewing && !e.t.Sending() && e.until.After(now) {
				next = minTime(next, e.until)
			}
		}
		return nil, lost, next
	}
	if earliest.due.After(now) {
		return nil, lost, earliest.due
	}
	window := min(time.Second, earliest.until.Sub(earliest.due)/2)
	horizon := now.Add(window)
	for _, e := range b.entries {
		if e.until.IsZero() || e.renewing || e.t.Sending() || !e.until.After(now) {
			continue
		}
		if e.due.After(horizon) {
			next = minTime(next, minTime(e.due, e.until))
			continue
		}
		if !e.began.IsZero() && now.Sub(e.began) >= b.cfg.MaxRenewal {
			// Left to expire: look at it again when it has.
			if e.due != e.until {
				b.stats.PastMaxRenew++
				e.due = e.until
			}
			next = minTime(next, e.until)
			continue
		}
		renew = append(renew, e)
	}
	// Those that expire first go first, and share requests with the locks
	// that expire close to them (a request's timeout follows its earliest).
	slices.SortFunc(renew, func(x, y *entry) int { return x.until.Compare(y.until) })
	if len(renew) > room {
		// Due, but every request is out: a finished one wakes Run.
		for _, e := range renew[room:] {
			next = minTime(next, e.until)
		}
		renew = renew[:room]
	}
	for _, e := range renew {
		e.renewing = true
	}
	return renew, lost, next
}

// renew sends one request for es, on a request goroutine; when the service
// says a lock is lost and the request held several, it asks again to find
// which. It returns the entries whose locks the service refused, taken out
// of the book, for Run to report.
func (b *Leases) renew(ctx context.Context, es []*entry) (refused []*entry) {
	tokens := make([]amqp.UUID, len(es))
	b.mu.Lock()
	earliest := es[0].until
	for i, e := range es {
		tokens[i] = e.token
		earliest = minTime(earliest, e.until)
	}
	b.mu.Unlock()
	timeout := b.requestTimeout(time.Now(), earliest)
	rctx, cancel := context.WithTimeout(ctx, timeout)
	expiries, err := b.cfg.Renewer.RenewLocks(rctx, tokens)
	cancel()
	b.mu.Lock()
	b.stats.Requests++
	b.stats.RequestTokens += uint64(len(tokens))
	b.mu.Unlock()
	if err == nil && len(expiries) != len(es) {
		err = fmt.Errorf("%w: %d expirations for %d locks", ErrIncomplete, len(expiries), len(es))
	}
	switch {
	case err == nil:
		now := time.Now()
		b.mu.Lock()
		for i, e := range es {
			e.renewing = false
			e.until, e.due = expiries[i], dueAt(now, expiries[i])
		}
		b.stats.Renewed += uint64(len(es))
		b.mu.Unlock()
		if b.cfg.OnRenewed != nil {
			b.cfg.OnRenewed(len(es))
		}
		return nil
	case len(es) > 1 && (errors.Is(err, ErrLockLost) || errors.Is(err, ErrBadRequest) || errors.Is(err, ErrIncomplete)):
		// A batch holding one lost lock: the service may refuse it
		// whole (410, or 400) or renew only some (fewer expirations,
		// and which ones is not said). No official client sends more
		// than one token a request, so no source says which: either way,
		// no lock is declared lost on a batch's answer. A lock settled
		// meanwhile is the likeliest cause: ask again for those still
		// held and not settling, as one batch, and then token by token.
		b.mu.Lock()
		b.stats.Split++
		b.mu.Unlock()
		var still []*entry
		for _, e := range es {
			if b.held(e) && e.t.State() != driver.Settling {
				still = append(still, e)
			} else {
				b.done(e)
			}
		}
		if len(still) < len(es) && len(still) > 0 && ctx.Err() == nil {
			return b.renew(ctx, still)
		}
		for _, e := range still {
			if ctx.Err() != nil {
				b.done(e)
				continue
			}
			refused = append(refused, b.renew(ctx, []*entry{e})...)
		}
		return refused
	case errors.Is(err, ErrLockLost):
		e := es[0]
		b.mu.Lock()
		defer b.mu.Unlock()
		e.renewing = false
		if b.entries[e.t.Entry()] != e || e.t.State() == driver.Settling {
			// Settled, or its settlement's answer will say.
			return nil
		}
		delete(b.entries, e.t.Entry())
		return []*entry{e}
	default:
		if ctx.Err() != nil {
			for _, e := range es {
				b.done(e)
			}
			return nil // stopping: not a failure
		}
		now := time.Now()
		busy := errors.Is(err, ErrServerBusy)
		// Limited: while the service fails, every lock due is in a request
		// that fails, again within a second.
		// A server-busy error says so itself; the wait is ServerBusyWait.
		b.limited.Warn("renewing message locks failed; trying again until they expire",
			zap.Int("locks", len(es)), zap.Duration("timeout", timeout), zap.Error(err))
		b.mu.Lock()
		b.stats.Failures++
		if busy {
			b.stats.ServerBusy++
			if until := now.Add(ServerBusyWait); until.After(b.busyUntil) {
				b.busyUntil = until
			}
		}
		for _, e := range es {
			e.renewing = false
			// Try again soon, within what is left of the lock (round
			// reports it lost once it has expired), and after a
			// server-busy wait.
			e.due = now.Add(min(time.Second, max(100*time.Millisecond, e.until.Sub(now)/4)))
			if busy {
				e.due = b.busyUntil
			}
		}
		b.mu.Unlock()
		b.signal() // the busy wait holds up every other lock too
		return nil
	}
}

// loseRefused reports the locks the service refused to renew.
func (b *Leases) loseRefused(es []*entry) {
	for _, e := range es {
		b.lose(e, errRefused)
	}
}

// held reports whether e is still in the book.
func (b *Leases) held(e *entry) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.entries[e.t.Entry()] == e
}

// done ends a renewal without a result.
func (b *Leases) done(e *entry) {
	b.mu.Lock()
	e.renewing = false
	b.mu.Unlock()
}

// LoseAll reports every delivery in the book lost, and empties it: for the
// deliveries of a Service Bus session whose session lock was lost. OnLost
// is told why: an error wrapping [ErrLockLost] that says why.
func (b *Leases) LoseAll(why string) {
	err := fmt.Errorf("%w: %s", ErrLockLost, why)
	b.mu.Lock()
	es := make([]*entry, 0, len(b.entries))
	for d, e := range b.entries {
		es = append(es, e)
		delete(b.entries, d)
	}
	b.mu.Unlock()
	for _, e := range es {
		b.lose(e, err)
	}
}

// Why locks are lost, as OnLost is told.
var (
	errExpired = fmt.Errorf("%w: it expired unrenewed", ErrLockLost)
	errRefused = fmt.Errorf("%w: the service refused to renew it", ErrLockLost)
)

// lose reports a lost lock: to OnLost, and to the handler's context.
func (b *Leases) lose(e *entry, why error) {
	b.mu.Lock()
	b.stats.Lost++
	cancel := e.cancel
	b.mu.Unlock()
	b.log.Debug("lock lost", zap.Stringer("lock_token", uuidString(e.token)), zap.Time("locked_until", e.until),
		zap.Error(why))
	// OnLost first: the pump then skips the settlement of a handler that
	// returns as soon as its context is cancelled. The other way round, its
	// result could go out on a lock the service has given up.
	b.cfg.OnLost(e.t, e.msg, why)
	if cancel != nil {
		cancel(ErrLockLost)
	}
}

type uuidString amqp.UUID

func (u uuidString) String() string { return amqp.UUID(u).String() }
