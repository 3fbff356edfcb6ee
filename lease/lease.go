// Package lease keeps the broker locks of every delivery a process holds
// on Azure Service Bus, and renews them before they expire.
//
// In peek-lock mode Service Bus locks each message it delivers for the
// queue's lock duration (30 s to 5 min), from the moment it sends it. A
// consumer that holds a credit's worth of deliveries — waiting in the
// pump's channel, in a lane, or in a handler — loses the locks of those
// that wait longest, and the service delivers them again to someone else.
// The Book knows every delivery the pump holds (the pump feeds it through
// pump.Leases) with its lock token and expiry, and one goroutine (Run)
// renews the locks: each before half its remaining time has passed (the
// .NET rule: remaining − min(remaining/2, 10 s)), every lock due in the
// same round in one request, up to MaxRenewal after the delivery arrived.
// A lock that is lost (the service says so, or it expired unrenewed) is
// reported to OnLost once; a handler's context bound to the delivery is
// cancelled.
package lease

import (
	"context"
	"errors"
	"sync"
	"time"

	"github.com/Azure/go-amqp"
	"go.uber.org/zap"

	"github.com/amqpsub/amqpsub/pump"
)

// Renewer renews message locks (com.microsoft:renew-lock on the entity's
// $management node). expiries[i] is the new expiry of tokens[i]. An error
// that wraps ErrLockLost says that (at least one of) the locks is lost; a
// request whose ctx ends returns ctx's error.
type Renewer interface {
	RenewLocks(ctx context.Context, tokens []amqp.UUID) (expiries []time.Time, err error)
}

// ErrLockLost is wrapped by the errors of a Renewer when the service says a
// lock is lost (status 410), and is the cause of a handler's context
// cancelled for that reason.
var ErrLockLost = errors.New("lease: the message lock was lost")

// Config configures a Book.
type Config struct {
	// Renewer renews locks. nil renews none: the book then only binds
	// handlers' contexts to their deliveries (LoseAll), as for the messages
	// of a Service Bus session, which the session's lock covers.
	Renewer Renewer
	// MaxRenewal is how long after a delivery arrived its lock is still
	// renewed; after that it expires. 0 means 5 minutes (the .NET
	// processor's MaxAutoLockRenewalDuration).
	MaxRenewal time.Duration
	// Timeout bounds each renewal request. 0 means 10 s.
	Timeout time.Duration
	// MaxBatch is the most lock tokens in one request. 0 means 256.
	MaxBatch int
	// OnLost is told, once, of each delivery whose lock was lost. It runs
	// on Run's goroutine and must not block. Required.
	OnLost func(t pump.Ticket)
	// Logger receives the book's logs; nil means none.
	Logger *zap.Logger
}

// Stats are a Book's counters.
type Stats struct {
	Held          int    // deliveries in the book now, renewable or not
	Requests      uint64 // renewal requests sent
	Renewed       uint64 // locks renewed
	Lost          uint64 // locks lost: refused by the service, or expired unrenewed
	Failures      uint64 // requests that failed other than with a lost lock
	Unrenewable   uint64 // deliveries without a lock token or expiry (never renewed)
	PastMaxRenew  uint64 // locks left to expire after MaxRenewal
	RequestTokens uint64 // tokens sent in all requests (Renewed + lost + failed)
}

// Book is the lease book. Create it with New; run Run.
type Book struct {
	cfg  Config
	log  *zap.Logger
	wake chan struct{}

	mu      sync.Mutex
	entries map[*pump.Delivery]*entry
	stats   Stats
}

type entry struct {
	t        pump.Ticket
	token    amqp.UUID
	until    time.Time // when the lock expires
	arrived  time.Time
	due      time.Time // when to renew it next
	cancel   context.CancelCauseFunc
	renewing bool // in a request now
}

// New returns a Book. It panics on a Config without OnLost, which callers
// validate first.
func New(cfg Config) *Book {
	if cfg.OnLost == nil {
		panic("lease: Config needs OnLost")
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
	log := cfg.Logger
	if log == nil {
		log = zap.NewNop()
	}
	return &Book{cfg: cfg, log: log, wake: make(chan struct{}, 1), entries: map[*pump.Delivery]*entry{}}
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

// dueAt is when a lock that expires at until, seen at now, is renewed.
func dueAt(now, until time.Time) time.Time {
	remaining := until.Sub(now)
	if remaining <= 0 {
		return now
	}
	return until.Add(-min(remaining/2, 10*time.Second))
}

// Add enters the delivery t in the book (pump.Leases). A delivery without
// a usable lock token or expiry is kept (so Bind and Remove work) but never
// renewed, and logged.
func (b *Book) Add(t pump.Ticket) {
	now := time.Now()
	m := t.Message()
	e := &entry{t: t, arrived: now}
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
		b.log.Warn("delivery without a usable lock (a 16-byte delivery tag and x-opt-locked-until); its lock is not renewed",
			zap.Int("tag_bytes", len(m.DeliveryTag)), zap.Bool("locked_until", okUntil))
		return
	}
	e.token, e.until, e.due = token, until, dueAt(now, until)
	b.signal()
}

// Remove takes the delivery out of the book (pump.Leases): settled,
// dropped or released.
func (b *Book) Remove(d *pump.Delivery) {
	b.mu.Lock()
	delete(b.entries, d)
	b.mu.Unlock()
}

// Bind ties a handler's context to t: it is cancelled, with ErrLockLost as
// its cause, if t's lock is lost. It reports false if t is not in the book
// (any more).
func (b *Book) Bind(t pump.Ticket, cancel context.CancelCauseFunc) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	e, ok := b.entries[t.Entry()]
	if !ok || e.t != t {
		return false
	}
	e.cancel = cancel
	return true
}

func (b *Book) signal() {
	select {
	case b.wake <- struct{}{}:
	default:
	}
}

// Stats returns the book's counters; it may be called from any goroutine.
func (b *Book) Stats() Stats {
	b.mu.Lock()
	defer b.mu.Unlock()
	s := b.stats
	s.Held = len(b.entries)
	return s
}

// Run renews locks until ctx ends. A renewal cut short by ctx is not a
// failure.
func (b *Book) Run(ctx context.Context) {
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	for ctx.Err() == nil {
		renew, lost, next := b.round(time.Now())
		for _, e := range lost {
			b.lose(e, "the lock expired unrenewed")
		}
		for i := 0; i < len(renew); i += b.cfg.MaxBatch {
			batch := renew[i:min(len(renew), i+b.cfg.MaxBatch)]
			if ctx.Err() != nil {
				for _, e := range batch {
					b.done(e)
				}
				continue
			}
			b.renew(ctx, batch)
		}
		if len(renew) > 0 || len(lost) > 0 {
			continue // look again at once: time has passed, expiries moved
		}
		timer.Reset(time.Until(next))
		select {
		case <-ctx.Done():
			return
		case <-b.wake:
			timer.Stop()
		case <-timer.C:
		}
	}
}

// round picks the locks to renew now (every one due within a window of
// the earliest, so that they share a request), the ones past their
// expiry, and when to look next.
func (b *Book) round(now time.Time) (renew, lost []*entry, next time.Time) {
	b.mu.Lock()
	defer b.mu.Unlock()
	next = now.Add(time.Hour)
	var earliest *entry
	for d, e := range b.entries {
		if e.until.IsZero() || e.renewing {
			continue
		}
		if !e.until.After(now) {
			lost = append(lost, e)
			delete(b.entries, d)
			continue
		}
		if earliest == nil || e.due.Before(earliest.due) {
			earliest = e
		}
	}
	if earliest == nil {
		return nil, lost, next
	}
	if earliest.due.After(now) {
		return nil, lost, earliest.due
	}
	window := min(time.Second, earliest.until.Sub(earliest.due)/2)
	horizon := now.Add(window)
	for _, e := range b.entries {
		if e.until.IsZero() || e.renewing || !e.until.After(now) {
			continue
		}
		if e.t.State() == pump.Settling {
			// Its settlement is on its way: renewing it would only be
			// refused as lost, and cost the whole batch.
			continue
		}
		if e.due.After(horizon) {
			next = minTime(next, minTime(e.due, e.until))
			continue
		}
		if now.Sub(e.arrived) >= b.cfg.MaxRenewal {
			// Left to expire: look at it again when it has.
			if e.due != e.until {
				b.stats.PastMaxRenew++
				e.due = e.until
			}
			next = minTime(next, e.until)
			continue
		}
		e.renewing = true
		renew = append(renew, e)
	}
	return renew, lost, next
}

func minTime(a, b time.Time) time.Time {
	if b.Before(a) {
		return b
	}
	return a
}

// renew sends one request for es; when the service says a lock is lost and
// the request held several, each is asked again alone, to find which.
func (b *Book) renew(ctx context.Context, es []*entry) {
	tokens := make([]amqp.UUID, len(es))
	for i, e := range es {
		tokens[i] = e.token
	}
	rctx, cancel := context.WithTimeout(ctx, b.cfg.Timeout)
	expiries, err := b.cfg.Renewer.RenewLocks(rctx, tokens)
	cancel()
	b.mu.Lock()
	b.stats.Requests++
	b.stats.RequestTokens += uint64(len(tokens))
	b.mu.Unlock()
	switch {
	case err == nil && len(expiries) == len(es):
		now := time.Now()
		b.mu.Lock()
		for i, e := range es {
			e.renewing = false
			e.until, e.due = expiries[i], dueAt(now, expiries[i])
		}
		b.stats.Renewed += uint64(len(es))
		b.mu.Unlock()
	case errors.Is(err, ErrLockLost) && len(es) > 1:
		// A lock settled meanwhile makes the service refuse the whole
		// request: ask again for those still held and not settling, as one
		// batch, before asking lock by lock.
		var still []*entry
		for _, e := range es {
			if b.held(e) && e.t.State() != pump.Settling {
				still = append(still, e)
			} else {
				b.done(e)
			}
		}
		if len(still) < len(es) && len(still) > 0 && ctx.Err() == nil {
			b.renew(ctx, still)
			return
		}
		for _, e := range still {
			if ctx.Err() != nil {
				b.done(e)
				continue
			}
			b.renew(ctx, []*entry{e})
		}
	case errors.Is(err, ErrLockLost):
		e := es[0]
		b.mu.Lock()
		held := b.entries[e.t.Entry()] == e
		if held {
			delete(b.entries, e.t.Entry())
		}
		b.mu.Unlock()
		if held {
			b.lose(e, "the service refused to renew it")
		}
	default:
		if ctx.Err() != nil {
			for _, e := range es {
				b.done(e)
			}
			return // stopping: not a failure
		}
		if err == nil {
			err = errors.New("lease: the answer's expirations do not match the request")
		}
		b.log.Warn("renewing message locks failed; trying again until they expire", zap.Int("locks", len(es)), zap.Error(err))
		now := time.Now()
		b.mu.Lock()
		b.stats.Failures++
		for _, e := range es {
			e.renewing = false
			// Try again soon, within what is left of the lock (round
			// reports it lost once it has expired).
			e.due = now.Add(min(time.Second, max(100*time.Millisecond, e.until.Sub(now)/4)))
		}
		b.mu.Unlock()
	}
}

// held reports whether e is still in the book.
func (b *Book) held(e *entry) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.entries[e.t.Entry()] == e
}

// done ends a renewal without a result.
func (b *Book) done(e *entry) {
	b.mu.Lock()
	e.renewing = false
	b.mu.Unlock()
}

// LoseAll reports every delivery in the book lost, and empties it: for the
// deliveries of a Service Bus session whose session lock was lost.
func (b *Book) LoseAll(why string) {
	b.mu.Lock()
	es := make([]*entry, 0, len(b.entries))
	for d, e := range b.entries {
		es = append(es, e)
		delete(b.entries, d)
	}
	b.mu.Unlock()
	for _, e := range es {
		b.lose(e, why)
	}
}

// lose reports a lost lock: to OnLost, and to the handler's context.
func (b *Book) lose(e *entry, why string) {
	b.mu.Lock()
	b.stats.Lost++
	cancel := e.cancel
	b.mu.Unlock()
	b.log.Warn("message lock lost: "+why, zap.Stringer("lock_token", uuidString(e.token)), zap.Time("locked_until", e.until))
	if cancel != nil {
		cancel(ErrLockLost)
	}
	b.cfg.OnLost(e.t)
}

type uuidString amqp.UUID

func (u uuidString) String() string { return amqp.UUID(u).String() }
