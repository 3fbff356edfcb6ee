package amqpsub

import (
	"context"
	"fmt"
	"math"
	"sync/atomic"
	"time"

	"github.com/Azure/go-amqp"
	"go.uber.org/zap"

	"github.com/amqpsub/amqpsub/internal/credit"
	"github.com/amqpsub/amqpsub/internal/driver"
	"github.com/amqpsub/amqpsub/internal/lanes"
	"github.com/amqpsub/amqpsub/internal/loglimit"
	"github.com/amqpsub/amqpsub/internal/pump"
	"github.com/amqpsub/amqpsub/internal/wait"
)

// pipe is one receive path: a pump, the lanes behind it, the links its
// attacher opens one after another, and what the profile's driver adds to
// them (dp, its driver.Pipe).
//
// A subscriber has one, or one per slot (config.slots: a Service Bus
// session held at once), each with its share of the credit.
type pipe struct {
	s       *Subscriber
	index   int
	pump    *pump.Pump
	gauge   *lanes.Gauge
	dp      driver.Pipe
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

func (s *Subscriber) newPipe(index, credit int, key string) *pipe {
	p := &pipe{s: s, index: index, gauge: lanes.NewGauge(s.cfg.workers)}
	p.dp = s.cfg.profile.drv.NewPipe(pipeEnv{p: p, key: key, credit: credit})
	up, down := make(chan struct{}), make(chan struct{})
	p.linkUp.Store(&up)
	p.linkDown.Store(&down)
	p.att = &attacher{s: s, p: p}
	pc := pump.Config{
		Credit:  credit,
		Mode:    creditMode(s.cfg.profile.f.Windowed),
		NoDrain: s.cfg.profile.f.DrainRequeues,
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
		// where the broker pins a group to its consumer (PinsGroups, and a
		// pipe per slot, which holds one group): nobody else can take it, and the broker's
		// dispatch stops at a group whose consumer has no credit.
		// Elsewhere a hot group's backlog only hoards what other replicas
		// could take, so at most the floor more: a delivery (or a batch)
		// per lane.
		g, most := p.gauge, math.MaxInt
		if !s.cfg.profile.f.PinsGroups && len(s.cfg.slots) == 0 {
			most = s.cfg.floor
		}
		pc.Parked = func(now time.Time) int {
			group, stalled := g.Parked(now)
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
	e := p.dp.Engine()
	pc.Leases, pc.Settlers, pc.SettleTimeout = e.Leases, e.Settlers, e.SettleTimeout
	pc.LeasesOutliveLinks, pc.DropBufferedOn = e.LeasesOutliveLinks, e.DropBufferedOn
	p.keeps = pc.LeasesOutliveLinks
	p.pump = pump.New(pc)
	return p
}

// attachedLink records l (nil under a test source) as the pipe's current
// link, wakes what waits for one (pipeEnv.Current), and arms linkDown for it.
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

// pipeEnv is what a pipe's driver reads of the pipe and the subscriber,
// and what it asks of them (driver.PipeEnv).
type pipeEnv struct {
	p      *pipe
	key    string
	credit int
}

func (e pipeEnv) Config() driver.PipeConfig {
	s := e.p.s
	c := driver.PipeConfig{
		Queue: s.queue, Address: s.cfg.profile.drv.Address(s.queue),
		Index: e.p.index, Key: e.key, Credit: e.credit, ByKey: s.cfg.byKey,
		MaxDeliveryCount: int(s.cfg.maxDelivery),
		DialTimeout:      s.cfg.dialTimeout, CloseTimeout: s.cfg.closeTimeout,
	}
	if s.cfg.broker != nil {
		c.Options = s.cfg.broker.driver()
	}
	return c
}

func (e pipeEnv) Log() *zap.Logger            { return e.p.s.log }
func (e pipeEnv) Limited() *loglimit.Logger   { return e.p.s.limited }
func (e pipeEnv) Engine() driver.EngineEnv    { return e.p.pump }
func (e pipeEnv) HandlersOf(group string) int { return e.p.s.handlersOf(group) }

func (e pipeEnv) OnRenewed() func(int) {
	if r := e.p.s.rec; r != nil {
		return r.LocksRenewed
	}
	return nil
}

// Current loads linkUp before current: a link attached between the two
// loads closes the channel returned, so no wait misses it.
func (e pipeEnv) Current() (driver.Link, <-chan struct{}) {
	up := *e.p.linkUp.Load()
	if l := e.p.current.Load(); l != nil {
		return l, up
	}
	return nil, up
}

// LeaseLost drops t, or skips its settlement, and reports it only when
// that changed anything: a delivery already settling or settled hears of
// its lease from the settlement's answer.
func (e pipeEnv) LeaseLost(t driver.Ticket, m *amqp.Message, why error) {
	if e.p.pump.LoseLease(t) && m != nil {
		s := e.p.s
		d := &Delivery{msg: m, lane: -1}
		s.limited.Warn("message lock lost; the service delivers the message again", s.fields(d, why)...)
		s.events.send(s.event(d, EventLockLost, why))
	}
}

func (e pipeEnv) OpenSession(ctx context.Context) (driver.Link, time.Time, error) {
	s := e.p.s
	if _, ok := s.connector.(sourceConnector); ok {
		return nil, time.Time{}, driver.ErrNoBroker
	}
	c, by, err := s.connect(ctx, 0, false)
	if err != nil {
		return nil, by, err
	}
	l := &link{connection: c, dp: e.p.dp}
	cctx, cancel := context.WithDeadline(ctx, by)
	defer cancel()
	if l.sess, err = c.conn.NewSession(cctx, nil); err != nil {
		s.closeWithin(l, time.Now().Add(s.cfg.closeTimeout/4))
		return nil, by, fmt.Errorf("amqpsub: begin session: %w", err)
	}
	return l, by, nil
}

func (e pipeEnv) CloseLink(l driver.Link, by time.Time) {
	if l, ok := l.(*link); ok {
		e.p.s.closeWithin(l, by)
	}
}

// handlersOf counts the handlers of group-id group running in this
// process, in any pipe.
func (s *Subscriber) handlersOf(group string) int {
	n := 0
	for _, p := range s.pipes {
		p.pump.Each(func(d *driver.Delivery) bool {
			if m := d.Message(); m != nil && d.State() == driver.Handling && groupID(m) == group {
				n++
			}
			return true
		})
	}
	return n
}
