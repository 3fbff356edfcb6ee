package amqpsub

import (
	"context"
	"errors"
	"math"
	"sync/atomic"
	"time"

	"github.com/Azure/go-amqp"
	"github.com/cespare/xxhash/v2"
	"go.uber.org/zap"

	"github.com/amqpsub/amqpsub/lanes"
	"github.com/amqpsub/amqpsub/lease"
	"github.com/amqpsub/amqpsub/pump"
)

// pipe is one receive path: a pump (with its lease book under peek-lock),
// the lanes behind it, and the links its attacher opens one after another.
// A subscriber has one; a Service Bus session consumer has one per session
// it holds at once, each with its share of the credit.
type pipe struct {
	s       *Subscriber
	index   int
	pump    *pump.Pump
	gauge   *lanes.Gauge
	book    *lease.Book // nil but for peek-lock profiles
	att     *attacher
	current atomic.Pointer[link] // the link attached now; nil between links
	// sourceRenewer renews locks in place of a link's $management node
	// when the pipe receives from a test source that can (package
	// amqpsubtest's Service Bus queue); nil on a broker's link.
	sourceRenewer atomic.Pointer[lease.Renewer]
	// session is the session id this pipe asks for ("" for the next
	// available one); used by session consumers only.
	session string
	// linkUp is closed, and replaced, each time a link attaches (see
	// attachedLink): what waits for a link waits on it.
	linkUp atomic.Pointer[chan struct{}]
	// linkDown is closed when the link attached now is lost, and replaced
	// when the next attaches (see attachedLink and lostLink): a LocalRetry
	// waits on it, to end the retries of a delivery that became stale.
	linkDown atomic.Pointer[chan struct{}]
	// fallback settles, by lock token, the deliveries of a lost link (a
	// Service Bus queue or subscription without sessions); nil elsewhere.
	fallback *dispositions
	// ordered: the pump sends settlements concurrently (Settlers), so
	// settle orders those of a group.
	ordered bool
}

func (s *Subscriber) newPipe(index, credit int, session string) *pipe {
	p := &pipe{s: s, index: index, session: session, gauge: lanes.NewGauge(s.cfg.workers)}
	up, down := make(chan struct{}), make(chan struct{})
	p.linkUp.Store(&up)
	p.linkDown.Store(&down)
	p.att = &attacher{s: s, p: p}
	pc := pump.Config{
		Credit:  credit,
		Mode:    s.cfg.profile.creditMode,
		Logger:  s.log,
		OnEvent: s.pumpEvent,
	}
	if s.rec != nil {
		pc.Meter = meter{s.rec}
	}
	if b := s.cfg.maxHeldBytes; b > 0 {
		// A session's share of the budget, as of the credit.
		pc.MaxHeldBytes = shareOf(b, credit, s.cfg.credit)
	}
	if s.cfg.profile.peekLock {
		bc := lease.Config{
			MaxRenewal: s.cfg.maxLockRenewal,
			OnLost:     p.lockLost,
			Logger:     s.log,
		}
		if s.rec != nil {
			bc.OnRenewed = s.rec.LocksRenewed
		}
		if !s.cfg.sessions() {
			// A session's messages are covered by the session's lock,
			// which the session link renews.
			bc.Renewer = renewer{p}
		}
		p.book = lease.New(bc)
		pc.Leases = p.book
		// Enough settlements in flight that a round trip of a few
		// milliseconds does not cap the rate (32 at 5 ms: 6,400/s).
		pc.Settlers = max(1, min(credit, 64))
		pc.SettleTimeout = s.cfg.settleTimeout
		if !s.cfg.sessions() {
			// A message's lock outlives its link (see sbReceiver): what a
			// lost link held is kept, and settled by lock token.
			pc.KeepAcrossLinks = true
			p.fallback = newDispositions(p)
		}
	}
	p.ordered = pc.Settlers > 0
	p.pump = pump.New(pc)
	return p
}

// settle hands t's settlement to the pump. Where settlements are sent
// concurrently (Settlers: Service Bus), those of one group go out in the
// order they were decided, each once the one before was answered, so that
// a lost link cannot leave a group's earlier message to come back after a
// later one was settled; keyless deliveries under WorkersByKey are ordered
// by lane, the others not at all.
// lane is the delivery's lane, -1 when it is not known (a release at a
// stop).
func (p *pipe) settle(t pump.Ticket, o pump.Outcome, lane int) {
	if !p.ordered {
		p.pump.Settle(t, o)
		return
	}
	switch g := groupID(t.Message()); {
	case g != "":
		p.pump.SettleInOrder(t, o, xxhash.Sum64String(g))
	case p.s.cfg.byKey && lane >= 0:
		p.pump.SettleInOrder(t, o, uint64(lane))
	default:
		p.pump.Settle(t, o)
	}
}

// attachedLink records l (nil under a test source) as the pipe's current
// link, wakes what waits for one (management), and arms linkDown for it.
func (p *pipe) attachedLink(l *link) {
	down := make(chan struct{})
	p.linkDown.Store(&down)
	p.current.Store(l)
	up := make(chan struct{})
	close(*p.linkUp.Swap(&up))
}

// lostLink closes linkDown: the link attached last, if any, is gone.
func (p *pipe) lostLink() {
	closed := make(chan struct{})
	close(closed)
	if old := p.linkDown.Swap(&closed); !isClosed(*old) {
		close(*old)
	}
}

// lockLost is told by the lease book of a lost lock, and why (wrapping
// ErrLockLost): the delivery is dropped if no handler has it, its
// settlement skipped if one has (the book has cancelled the handler's
// context).
func (p *pipe) lockLost(t pump.Ticket, m *amqp.Message, why error) {
	// Reported only when it changed anything: a delivery already settling
	// or settled hears of its lock from the settlement's answer.
	if p.pump.LoseLock(t) && m != nil {
		d := &Delivery{msg: m, lane: -1}
		p.s.limited.Warn("message lock lost; the service delivers the message again", p.s.fields(d, why)...)
		p.s.events.send(p.s.event(d, EventLockLost, why))
	}
}

var errNoLink = errors.New("amqpsub: no link to renew locks on")

// renewer renews the locks of a pipe's current link (lease.Renewer).
type renewer struct{ p *pipe }

// RenewLocks renews tokens on the current link's $management node, within
// ctx. When that node's link pair is gone for good (it could not be
// attached again), no lock of the link can be renewed any more: the receive
// link is closed too, so that the pump attaches both anew, and the service
// delivers again what the link held.
//
// A test source attached in place of a link renews its own locks, if it
// can: the attacher sets sourceRenewer then. A broker's link never reaches
// that branch.
func (r renewer) RenewLocks(ctx context.Context, tokens []amqp.UUID) ([]time.Time, error) {
	l := r.p.current.Load()
	if l == nil || l.mgmt == nil {
		if sr := r.p.sourceRenewer.Load(); sr != nil {
			return (*sr).RenewLocks(ctx, tokens)
		}
		return nil, errNoLink
	}
	exp, err := l.mgmt.RenewLocks(ctx, tokens)
	if errors.Is(err, errNodeGone) && r.p.current.Load() == l && l.mgmt.abandonLink(ctx, l.rcv) {
		r.p.s.log.Warn("the $management link is gone and could not be attached again; closing the receive link to attach both anew",
			zap.Error(err))
	}
	return exp, err
}

// shareOf returns part/whole of b, at least 1, without overflowing: a
// budget too large to scale is as good as unbounded.
func shareOf(b int64, part, whole int) int64 {
	if part >= whole || b > math.MaxInt64/int64(part) {
		return b
	}
	return max(1, b*int64(part)/int64(whole))
}
