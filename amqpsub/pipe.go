package amqpsub

import (
	"math"
	"sync/atomic"
	"time"

	"github.com/amqpsub/amqpsub/internal/credit"
	"github.com/amqpsub/amqpsub/internal/lanes"
	"github.com/amqpsub/amqpsub/internal/pump"
	"github.com/amqpsub/amqpsub/internal/wait"
)

// pipe is one receive path: a pump, the lanes behind it, the links its
// attacher opens one after another, and what the broker's kind adds to
// them (kind: sbKind, with its lease book, on Service Bus).
//
// A subscriber has one; a Service Bus session consumer has one per session
// it holds at once, each with its share of the credit.
type pipe struct {
	s       *Subscriber
	index   int
	pump    *pump.Pump
	gauge   *lanes.Gauge
	kind    brokerKind
	att     *attacher
	current atomic.Pointer[link] // the link attached now; nil between links
	// linkUp is closed, and replaced, each time a link attaches (see
	// attachedLink): what waits for a link waits on it.
	linkUp atomic.Pointer[chan struct{}]
	// linkDown is closed when the link attached now is lost, and replaced
	// when the next attaches (see attachedLink and lostLink): a LocalRetry
	// waits on it, to end the retries of a delivery that became stale.
	linkDown atomic.Pointer[chan struct{}]
	// keeps: a lost link's deliveries stay held and settleable
	// (pump.Config.LeasesOutliveLinks), so none of them becomes stale.
	keeps bool
}

// creditFloor is the least an adaptive credit holds (pump.Config's
// AdaptiveFloor): a delivery per lane, and for a BatchHandler a batch per
// lane, so that every free lane starts at once; 0 with FixedCredit. What
// keeps a lane busy across the round trip is the credit's in-flight part.
func (c *config) creditFloor(batch bool) int {
	if c.fixedCredit {
		return 0
	}
	c.floorNeed = 1
	if batch {
		c.floorNeed = min(c.batchSize, c.credit)
	}
	return min(c.workers*c.floorNeed, 1<<20)
}

func (s *Subscriber) newPipe(index, credit int, session string) *pipe {
	p := &pipe{s: s, index: index, gauge: lanes.NewGauge(s.cfg.workers)}
	if mk := s.cfg.profile.kind; mk != nil {
		p.kind = mk(p, session)
	} else {
		p.kind = newPlainKind(p)
	}
	up, down := make(chan struct{}), make(chan struct{})
	p.linkUp.Store(&up)
	p.linkDown.Store(&down)
	p.att = &attacher{s: s, p: p}
	pc := pump.Config{
		Credit:  credit,
		Mode:    creditMode(s.cfg.profile.f.Windowed),
		Logger:  s.log,
		OnEvent: s.pumpEvent,
		// The pump bounds it by credit, a session's share.
		AdaptiveFloor: s.cfg.floor,
	}
	if s.cfg.floor > 0 {
		// What waits behind a stalled call, or behind an earlier delivery
		// of its own group, is held on top of the floor, so that the free
		// lanes still get credit. What a stalled call holds up, all of it:
		// a stall ends (the call returns, or its ctx ends), and riding it
		// out keeps the lanes busy and the groups in order. A group's
		// backlog behind a call of normal pace (a hot group) all of it
		// where the broker pins a group to its consumer (pinsGroups, and a
		// Service Bus session): nobody else can take it, and the broker's
		// dispatch stops at a group whose consumer has no credit.
		// Elsewhere a hot group's backlog only hoards what other replicas
		// could take, so at most the floor more: a delivery (or a batch)
		// per lane.
		g, most := p.gauge, math.MaxInt
		if !s.cfg.profile.f.PinsGroups && !s.cfg.sessions() {
			most = s.cfg.floor
		}
		pc.Parked = func() int {
			group, stalled := g.Parked(time.Now())
			return stalled + min(group, most)
		}
	}
	if s.rec != nil {
		pc.Meter = meter{s.rec}
	}
	if b := s.cfg.maxHeldBytes; b > 0 {
		// A session's share of the budget, as of the credit.
		pc.MaxHeldBytes = shareOf(b, credit, s.cfg.credit)
	}
	p.kind.configure(&pc)
	p.keeps = pc.LeasesOutliveLinks
	p.pump = pump.New(pc)
	return p
}

// attachedLink records l (nil under a test source) as the pipe's current
// link, wakes what waits for one (sbKind.management), and arms linkDown for it.
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
	if old := p.linkDown.Swap(&closed); !wait.Closed(*old) {
		close(*old)
	}
}

// shareOf returns part/whole of b, at least 1, without overflowing: a
// budget too large to scale is as good as unbounded.
func shareOf(b int64, part, whole int) int64 {
	if part >= whole || b > math.MaxInt64/int64(part) {
		return b
	}
	return max(1, b*int64(part)/int64(whole))
}

// creditMode is the pump's credit mode at start: windowed for a broker
// that sends past its credit.
func creditMode(windowed bool) credit.Mode {
	if windowed {
		return credit.Windowed
	}
	return credit.Continuous
}
