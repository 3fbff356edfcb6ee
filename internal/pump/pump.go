package pump

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/Azure/go-amqp"
	"go.uber.org/zap"

	"github.com/amqpsub/amqpsub/internal/credit"
	"github.com/amqpsub/amqpsub/internal/driver"
	"github.com/amqpsub/amqpsub/internal/wait"
)

// AttachFunc returns a source to receive from. Run calls it at start, with
// lost nil, and again after the source it gave failed, with lost the error
// that ended it. It should block until it has a source or ctx ends (backing
// off between attempts as it sees fit); an error it returns ends Run. The
// source must be attached with manual credit (go-amqp ReceiverOptions.Credit
// = -1). Cancelling ctx means the pump is stopping.
type AttachFunc func(ctx context.Context, lost error) (driver.Source, error)

// Config configures a [Pump].
type Config struct {
	// Credit is the most deliveries the process holds at once. Required, ≥ 1.
	Credit int
	// Mode is the credit mode at start (see package credit). A broker seen
	// sending past its credit switches the pump to [credit.Windowed].
	Mode credit.Mode
	// Logger receives the pump's logs. nil means no logs. Two lines are
	// above debug, once per link at most: "link lost" and the overshoot
	// (warn); what happens once per delivery is logged at debug.
	Logger *zap.Logger
	// OnEvent, when set, is called on the pump's goroutine for each [Event].
	// It must return at once (hand the event on, never block): the pump
	// applies no settlement while it runs.
	OnEvent func(Event)
	// Settlers, when > 0, sends settlements from that many goroutines, for
	// brokers that answer each one (receiver settle mode second): go-amqp then waits a round trip per settlement, which on
	// the pump's goroutine would cap the rate at one per round trip. A
	// delivery stays held until its answer came or SettleTimeout passed.
	//
	// Each settler sends its settlements one after another, in the order
	// it was given them: those of one key (SettleInOrder) all go to the
	// same one, the others in turn to each. 0 settles on the pump's
	// goroutine, in order, for brokers that do not answer (receiver settle
	// mode first).
	Settlers int
	// LeasesOutliveLinks says that a delivery's lease (the broker's hold
	// on it) outlives the link it came on, and that its [driver.Source] can
	// still settle it once that link is gone: a broker that keeps the
	// lease until it expires and takes a settlement by another path than
	// the link (the source falls back to it). Requires Settlers > 0.
	//
	// A lost link then leaves its deliveries held: those buffered still go
	// to handlers, their leases stay in the book, and every settlement is
	// sent through the source the delivery came from. false (the default)
	// drops what a lost link held, and skips the settlements of its
	// deliveries ([Stats.Stale]): the broker redelivers them.
	LeasesOutliveLinks bool
	// DropBufferedOn, with LeasesOutliveLinks, says whether a source that
	// ended with err (its Receive's or IssueCredit's error) took the
	// leases of its deliveries with it, as far as the consumer can tell
	// (a lost connection, on a broker that documents its leases as ended
	// with it): what no handler has taken yet is then dropped, as without
	// LeasesOutliveLinks, and never goes to a handler (the broker delivers
	// it again), while what handlers have stays held and is settled
	// through its source. nil (the default) never drops:
	// what the receive loop had received when the source ended goes to the
	// consumers like the rest. It is called on the pump's goroutine,
	// maybe more than once for one loss, and must not block.
	DropBufferedOn func(err error) bool
	// NoDrain says never to drain the link's credit: the broker requeues
	// what the link holds unsettled on a drain. Stop and Hold then only
	// stop granting credit, and what the broker still sends on the credit
	// it has is released as it comes (Stop) or handled (Hold).
	NoDrain bool
	// SettleTimeout bounds each settlement sent by a settler; 0 means 30 s.
	SettleTimeout time.Duration
	// Leases, when set, hears of every delivery entering and leaving the
	// book, to keep its lease (renew it, say). nil costs nothing.
	Leases driver.Leases
	// MaxHeldBytes, when > 0, bounds the bytes of the deliveries held
	// (their [Size]) besides their number: see credit's byte budget.
	MaxHeldBytes int64
	// Meter, when set, hears of every delivery received and every
	// settlement applied. nil costs a nil check per call.
	Meter Meter
	// AdaptiveFloor, when > 0, makes the credit adaptive (credit's Adapt):
	// it follows the drain rate and the round trip, between AdaptiveFloor
	// (what the consumer's lanes start at once) and Credit. 0 holds Credit.
	AdaptiveFloor int
	// Parked, with AdaptiveFloor, returns how many held deliveries the
	// credit holds on top of the adaptive limit (credit's Park): those that
	// wait behind an earlier delivery of their own group, as much of them
	// as the broker needs held, as of now (when the pump's loop last
	// woke). Called on the pump's goroutine before each grant; it must be
	// cheap and must not block. nil counts none.
	Parked func(now time.Time) int
}

// Meter hears of what the pump does, for metrics. Its methods run on the
// pump's goroutine and must return at once without blocking: the pump
// applies no settlement while they run.
type Meter interface {
	// Received is called for each delivery received.
	Received()
	// Settled is called for each settlement applied: err is nil when the
	// broker took it, [driver.ErrNotSent] when it was not sent (the
	// delivery's link or lease was lost), else what the broker or link
	// answered.
	Settled(k driver.Kind, err error)
	// Dropped is called for deliveries freed without a settlement, before
	// a handler took them: their link, or their lease, was lost (n at once
	// when a lost link's buffered deliveries are dropped together).
	Dropped(n int)
}

// Pump is the receiving end of one subscription. Create it with [New], start it
// with Run.
type Pump struct {
	cfg    Config
	log    *zap.Logger
	out    chan driver.Ticket
	settle *burst[settlement]

	stopOnce     sync.Once
	stop         chan struct{}
	releasedOnce sync.Once
	released     chan struct{} // closed once Stop has taken effect
	quietOnce    sync.Once
	quiet        chan struct{} // closed once only handlers hold deliveries after Stop
	holdOnce     sync.Once
	hold         chan struct{} // closed by Hold
	emptiedOnce  sync.Once
	emptied      chan struct{} // closed once nothing is held after Hold
	done         chan struct{}
	running      atomic.Bool

	links *driver.Links // generation of the current link; 0 before the first

	// flushBy is when, once Run's ctx has ended, the settlers stop sending
	// what was decided (Unix ns; 0: at once). See FlushBy.
	flushBy atomic.Int64

	// Owned by the Run goroutine.
	acct     *credit.Account
	free     []*driver.Delivery
	backlog  []driver.Ticket // received, waiting for room in out
	shards   []*shard        // one per settler (Settlers > 0)
	anyq     chan settlement // unordered settlements, for whichever settler is free
	next     int             // the settler the next unordered settlement goes to
	inFlight int             // settlements with a settler
	ended    bool            // Run is returning: nothing more is sent

	bookMu sync.RWMutex
	book   []*driver.Delivery // every entry ever made; written by the Run goroutine only

	stats counters
}

// New returns a [Pump]. It panics on an invalid [Config], which callers
// validate first.
func New(cfg Config) *Pump {
	log := cfg.Logger
	if log == nil {
		log = zap.NewNop()
	}
	p := &Pump{
		cfg:      cfg,
		log:      log,
		out:      make(chan driver.Ticket, cfg.Credit),
		links:    driver.NewLinks(cfg.LeasesOutliveLinks),
		settle:   newBurst[settlement](min(2*cfg.Credit, 1024)),
		stop:     make(chan struct{}),
		released: make(chan struct{}),
		quiet:    make(chan struct{}),
		hold:     make(chan struct{}),
		emptied:  make(chan struct{}),
		done:     make(chan struct{}),
		acct:     credit.New(cfg.Credit, cfg.Mode),
	}
	p.stats.windowed.Store(cfg.Mode == credit.Windowed)
	if cfg.MaxHeldBytes > 0 {
		p.acct.SetByteBudget(cfg.MaxHeldBytes)
	}
	if cfg.AdaptiveFloor > 0 {
		p.acct.Adapt(cfg.AdaptiveFloor, time.Now)
	}
	p.stats.creditNow.Store(int64(p.acct.Limit()))
	if cfg.LeasesOutliveLinks && cfg.Settlers <= 0 {
		panic("pump: LeasesOutliveLinks needs Settlers")
	}
	for range max(0, cfg.Settlers) {
		p.shards = append(p.shards, &shard{q: newBurst[settlement](64)})
	}
	if cfg.Settlers > 0 {
		p.anyq = make(chan settlement, cfg.Credit)
	}
	p.book = make([]*driver.Delivery, cfg.Credit)
	p.free = make([]*driver.Delivery, cfg.Credit)
	for i := range p.book {
		d := driver.NewDelivery(p.links)
		p.book[i] = d
		p.free[i] = d
	}
	return p
}

// Out returns the channel of received deliveries, as deep as the credit.
// Each ticket taken from it must be passed to Settle once. Out is closed
// when Run returns.
func (p *Pump) Out() <-chan driver.Ticket { return p.out }

// Stopping returns a channel closed when Stop is called. Consumers release
// deliveries they have not yet given to a handler once it is closed.
func (p *Pump) Stopping() <-chan struct{} { return p.stop }

// Released returns a channel closed once the pump has acted on Stop: every
// delivery waiting in the pump and in Out is released, and so is every
// delivery that still arrives. It is closed when Run returns, too.
func (p *Pump) Released() <-chan struct{} { return p.released }

// Quiet returns a channel closed once, after Stop, the only deliveries
// still held are in handlers: every other one was released (by the pump,
// or by the consumers that had taken it from Out and passed it to Settle)
// and the release applied, or with Settlers handed to a settler or queued
// for one.
//
// It is closed when a stop finds the pump without a link (while it
// reattaches: nothing can be released then, what is held is stale) and
// when Run returns, too. A consumer that cuts its handlers short at a stop
// waits for it first, so that what no handler had goes back before any
// handler is cancelled.
func (p *Pump) Quiet() <-chan struct{} { return p.quiet }

func (p *Pump) markQuiet() { p.quietOnce.Do(func() { close(p.quiet) }) }

// checkQuiet closes Quiet when no delivery is buffered or queued for
// settlement: only handlers and settlers have any. Called on the Run
// goroutine while stopping; it scans the book until Quiet is closed.
func (p *Pump) checkQuiet() {
	if wait.Closed(p.quiet) || len(p.backlog) > 0 || p.settle.pending() {
		return
	}
	settling := 0
	for _, d := range p.book {
		switch d.State() {
		case driver.Buffered:
			return
		case driver.Settling:
			settling++
		}
	}
	// What is settling is with a settler (queued on one or being sent: a
	// peer that does not answer would make waiting for those take
	// SettleTimeout per settlement of a key; they are sent at the end of
	// Run, see FlushBy), or about to reach the queue (Settle has moved it,
	// not yet pushed it).
	if settling > p.inFlight {
		return
	}
	p.markQuiet()
}

// Done returns a channel closed when Run has returned.
func (p *Pump) Done() <-chan struct{} { return p.done }

// Credit returns the configured credit.
func (p *Pump) Credit() int { return p.cfg.Credit }

// Held returns the number of deliveries held now; it may be called from any
// goroutine.
func (p *Pump) Held() int { return int(p.stats.held.Load()) }

// Stop starts a graceful stop: the pump grants no more credit, releases
// every delivery not yet taken from Out and every delivery that still
// arrives, applies the settlements of deliveries in handlers, and Run
// returns once nothing is held. Stop does not wait; it is safe to call more
// than once and from any goroutine. To stop at once, cancel Run's ctx.
func (p *Pump) Stop() { p.stopOnce.Do(func() { close(p.stop) }) }

// Holding returns a channel closed by [Hold]: consumers that gather
// deliveries (an open batch) hand them on at once from then on, since
// nothing more will come.
func (p *Pump) Holding() <-chan struct{} { return p.hold }

// Hold starts the first part of a stop on a broker that counts every
// return of a delivery as an attempt (a queue that counts a release
// toward its delivery limit): the pump grants no more credit and
// takes back what the broker still has (a drain), but goes on handing what
// it holds, and what was already on its way, to Out, so that the consumers
// can finish it rather than release it. [Emptied] is closed once nothing
// is held. [Stop] may follow at any time, and releases what is left. Hold
// does not wait; it is safe to call more than once and from any goroutine.
func (p *Pump) Hold() { p.holdOnce.Do(func() { close(p.hold) }) }

// Emptied returns a channel closed once, after [Hold], no delivery is held:
// everything received was settled. It is closed when Run returns, too.
func (p *Pump) Emptied() <-chan struct{} { return p.emptied }

func (p *Pump) markEmptied() { p.emptiedOnce.Do(func() { close(p.emptied) }) }

func (p *Pump) markReleased() { p.releasedOnce.Do(func() { close(p.released) }) }

// FlushBy sets how long, once Run's ctx has ended, the settlers go on
// sending the settlements they were given (Settlers > 0): until t. Run
// waits for them until then, and reports each one not sent by then as not
// sent ([Stats.Unsent], [driver.ErrNotSent]). Without it, or with t past, what the
// settlers still hold when ctx ends is not sent. Call it before cancelling
// ctx; it may be called from any goroutine.
func (p *Pump) FlushBy(t time.Time) { p.flushBy.Store(t.UnixNano()) }

// ErrDrainAnswered is the cause of the end of a Receive's ctx when a
// Hold's drain was answered: the receive loop takes what is prefetched and
// goes on; a source must not take it as the end of the link.
var ErrDrainAnswered = errors.New("pump: drain answered")

// ErrStopped is returned by Run after Stop once every held delivery was
// settled.
var ErrStopped = errors.New("pump: stopped")

// Run receives from the sources attach gives until Stop has taken effect,
// ctx ends, or attach fails. It returns [ErrStopped] after a graceful stop,
// ctx.Err() when ctx ended first (deliveries still held then stay unsettled
// on the link, and the broker redelivers them once the link closes), or the
// error of attach. Out is closed when Run returns. Run may be called once.
func (p *Pump) Run(ctx context.Context, attach AttachFunc) error {
	if !p.running.CompareAndSwap(false, true) {
		return errors.New("pump: Run called twice")
	}
	defer close(p.done)
	defer p.markEmptied()
	defer p.markQuiet()
	defer p.markReleased()
	defer close(p.out)
	if len(p.shards) > 0 {
		// The settlers outlive ctx until FlushBy's time, so that what was
		// decided before a stop is sent.
		sctx, cancelSettlers := context.WithCancel(context.WithoutCancel(ctx))
		quit := make(chan struct{})
		// Each settler reports on returned as it returns (room for all).
		returned := make(chan struct{}, len(p.shards))
		var settlers sync.WaitGroup
		for _, sh := range p.shards {
			settlers.Go(func() {
				defer func() { returned <- struct{}{} }()
				p.settler(sctx, sh, quit)
			})
		}
		defer func() {
			p.ended = true
			close(quit)
			if ctx.Err() != nil {
				waitReturned(returned, len(p.shards), time.Unix(0, p.flushBy.Load()))
			}
			cancelSettlers()
			settlers.Wait()
			// The settlers' reports, and what was decided meanwhile
			// (counted unsent): on this goroutine, like every other.
			p.applyQueued(context.Background())
		}()
	}
	var lost error
	for {
		src, err := p.attach(ctx, attach, lost)
		if err != nil {
			return err
		}
		err = p.serve(ctx, src)
		if errors.Is(err, ErrStopped) {
			return ErrStopped
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
		if errors.Is(err, driver.ErrSourceDone) {
			p.log.Debug("source done; attaching the next", zap.Error(err))
		} else {
			p.log.Warn("link lost", zap.Error(err), zap.Int("held", p.acct.Held()))
			p.stats.linksLost.Add(1)
			p.event(Event{Kind: LinkLost, Err: err})
		}
		lost = err
		p.links.Next()
		switch {
		case !p.cfg.LeasesOutliveLinks:
			// Deliveries of the lost link are stale from here on.
			p.dropBacklog()
			p.dropStale(true)
		case p.dropsBuffered(err):
			// Kept for what handlers have, but nothing buffered goes to a
			// handler any more.
			p.dropBacklog()
			p.dropStale(false)
		}
	}
}

// dropsBuffered reports whether, under LeasesOutliveLinks, a source that
// ended with err leaves its buffered deliveries unsettleable
// (Config.DropBufferedOn).
func (p *Pump) dropsBuffered(err error) bool {
	return p.cfg.DropBufferedOn != nil && p.cfg.DropBufferedOn(err)
}

// waitReturned waits for n reports on returned, until by at the latest.
func waitReturned(returned <-chan struct{}, n int, by time.Time) {
	d := time.Until(by)
	if d <= 0 {
		return
	}
	t := time.NewTimer(d)
	defer t.Stop()
	for range n {
		select {
		case <-returned:
		case <-t.C:
			return
		}
	}
}

// serve runs one link until it fails (its error), Stop took effect
// (ErrStopped) or ctx ended.
func (p *Pump) serve(ctx context.Context, src driver.Source) (err error) {
	// The account takes the time of the loop's last wake as now (At):
	// after the loop, what settles reads the clock again.
	defer p.acct.At(time.Time{})
	gen := p.links.Current()
	rctx, cancelReceive := context.WithCancel(ctx)
	in := newBurst[*amqp.Message](min(p.cfg.Credit, 1024))
	var wg sync.WaitGroup
	dctx, answered := context.WithCancelCause(rctx)
	drainAnswered := func() { answered(ErrDrainAnswered) }
	defer drainAnswered()
	wg.Go(func() { receiveLoop(rctx, dctx, src, in) })
	defer func() {
		cancelReceive()
		wg.Wait()
		// Whatever the receive loop still handed over was never seen by a
		// consumer. Once the link is lost under LeasesOutliveLinks (a
		// refused IssueCredit ends serve with deliveries in hand), their
		// leases outlive the link like those of the rest of what it
		// brought: they are held and go to the consumers, after
		// everything the link brought before them, unless the source took
		// those leases with it (DropBufferedOn: dropped, the broker delivers
		// them again). Otherwise they are given back on the link.
		msgs, _ := in.take()
		keep := p.cfg.LeasesOutliveLinks && err != nil && !errors.Is(err, ErrStopped) && ctx.Err() == nil
		drop := keep && p.dropsBuffered(err)
		if pf, ok := src.(prefetcher); ok && keep {
			// And what came on the link's credit that no Receive took
			// (go-amqp's prefetch): a link given up while still attached
			// (a refused IssueCredit) keeps it there, where nothing would
			// ever settle or renew it.
			for m := pf.Prefetched(); m != nil; m = pf.Prefetched() {
				msgs = append(msgs, m)
			}
		}
		for _, m := range msgs {
			switch {
			case m == nil:
			case drop:
				p.dropUnheld()
			case keep:
				p.received(p.take(m, src, gen), wait.Closed(p.stop))
			default:
				p.releaseUnheld(ctx, src, m)
			}
		}
	}()

	// With an adaptive credit, the lanes' parked count moves on their own
	// goroutines: a tick re-reads it while anything is held (or the limit
	// is above its floor, to let it decay), so that a slow group that took
	// the whole floor does not leave the free lanes without credit until
	// its handler settles; and while the flow frame owed after the last
	// settlement waits for the link to fall quiet (credit's FlowOwed).
	var tick *time.Ticker
	if p.cfg.AdaptiveFloor > 0 {
		tick = time.NewTicker(adaptTick)
		defer tick.Stop()
	}
	stop := p.stop
	stopping := wait.Closed(stop)
	if stopping {
		stop = nil
		p.drainThenRelease(ctx, rctx, src, &wg)
	}
	// A link attached while holding was never given credit: nothing to
	// take back, nothing on its way. Otherwise Emptied waits for the
	// drain's answer (or drainWait, for a broker that does not answer),
	// after which nothing more arrives, so that what was on its way is
	// handed on too rather than released.
	hold := p.hold
	holding := wait.Closed(hold)
	holdSettled := holding
	if holding {
		hold = nil
	}
	var drainTimer <-chan time.Time
	for {
		if stopping {
			p.checkQuiet()
		}
		if holdSettled && p.acct.Held() == 0 {
			p.markEmptied()
		}
		if !stopping && !holding {
			if p.cfg.Parked != nil {
				p.acct.Park(p.cfg.Parked(p.acct.Now()))
			}
			if n := p.acct.Grant(); n > 0 {
				if err := src.IssueCredit(n); err != nil {
					return fmt.Errorf("pump: issue credit: %w", err)
				}
				p.stats.granted.Add(uint64(n))
			}
			p.noteCredit()
		} else if stopping && p.acct.Held() == 0 {
			return ErrStopped
		}
		var head driver.Ticket
		var out chan<- driver.Ticket
		if len(p.backlog) > 0 {
			head, out = p.backlog[0], p.out
		}
		var ticks <-chan time.Time
		if tick != nil && !stopping && !holding && (p.acct.Held() > 0 || p.acct.Limit() > p.cfg.AdaptiveFloor || p.acct.FlowOwed()) {
			ticks = tick.C
		}
		select {
		case <-ticks:
			p.acct.At(time.Now()) // the one clock read of this turn
			// Only for the grant at the top of the loop.
		case <-in.wake:
			p.acct.At(time.Now()) // the one clock read of this turn
			msgs, err := in.take()
			for _, m := range msgs {
				if m == nil { // the drain's answer: nothing more comes
					drainTimer, holdSettled = nil, true
					continue
				}
				p.received(p.take(m, src, gen), stopping)
			}
			in.recycle(msgs)
			if err != nil {
				return err
			}
		case out <- head:
			p.acct.At(time.Now()) // the one clock read of this turn
			p.backlog[0] = driver.Ticket{}
			p.backlog = p.backlog[1:]
			if len(p.backlog) == 0 {
				p.backlog = p.backlog[:0:0]
			}
		case <-p.settle.wake:
			p.acct.At(time.Now()) // the one clock read of this turn
			// Everything queued goes at once, before the next grant, so
			// credit goes back in chunks rather than a flow frame per
			// settlement.
			p.applyQueued(ctx)
		case <-hold:
			p.acct.At(time.Now()) // the one clock read of this turn
			hold, holding = nil, true
			if p.canDrain(src) {
				drainTimer = time.After(holdDrainWait)
				wg.Go(func() {
					drainCredit(rctx, src)
					drainAnswered()
				})
			} else {
				holdSettled = true
			}
		case <-drainTimer:
			p.acct.At(time.Now()) // the one clock read of this turn
			drainTimer, holdSettled = nil, true
		case <-stop:
			p.acct.At(time.Now()) // the one clock read of this turn
			stop, stopping = nil, true
			p.drainThenRelease(ctx, rctx, src, &wg)
		case <-ctx.Done():
			p.acct.At(time.Now()) // the one clock read of this turn
			return ctx.Err()
		}
	}
}

// adaptTick is how often an adaptive credit is recomputed while deliveries
// are held, besides after each event of the link.
const adaptTick = 10 * time.Millisecond

// drainWait bounds how long a stop waits for the broker to answer its
// drain before it releases the buffered deliveries anyway.
//
// The answer itself is not what protects the releases: go-amqp sends the
// drain as a flow with no credit, which the broker applies before the
// releases that follow it on the link. The releases must only not overtake
// that flow, which go-amqp's receiver writes as soon as it next runs,
// microseconds later. A broker may never answer such a drain (there is no
// credit left to drain), so every stop on it waits the whole drainWait: 20 ms keeps an idle stop short, and still leaves the
// receiver ample time to write the flow. Should a release overtake it
// anyway, the broker sends that delivery once more to the stopping link,
// which releases it again.
const drainWait = 20 * time.Millisecond

// holdDrainWait bounds how long Hold waits for the drain's answer before
// Emptied may close: only brokers that answer drains are held, and their
// answer, through a replicated queue's log, may take longer than a
// stop's drainWait; the caller bounds the whole hold anyway.
const holdDrainWait = time.Second

// drainThenRelease, on Stop, drains the link's credit and releases the
// buffered deliveries once the broker has answered the drain (or drainWait
// has passed): released on a link that still has credit, they would come
// straight back to it. The drain goes on, on wg, if it takes longer; rctx
// ends it with serve.
func (p *Pump) drainThenRelease(ctx, rctx context.Context, src driver.Source, wg *sync.WaitGroup) {
	if p.canDrain(src) {
		drained := make(chan struct{})
		wg.Go(func() {
			defer close(drained)
			drainCredit(rctx, src)
		})
		t := time.NewTimer(drainWait)
		select {
		case <-drained:
		case <-t.C:
		case <-ctx.Done():
		}
		t.Stop()
	}
	p.releaseBuffered(ctx)
}

// prefetcher is a source that holds deliveries no Receive has taken yet
// (*amqp.Receiver: Prefetched returns the next, or nil).
type prefetcher interface {
	Prefetched() *amqp.Message
}

// drainer is a source that can take its credit back (*amqp.Receiver).
type drainer interface {
	DrainCredit(ctx context.Context, opts *amqp.DrainCreditOptions) error
}

// canDrain reports whether src can drain and NoDrain allows it.
func (p *Pump) canDrain(src driver.Source) bool {
	_, ok := src.(drainer)
	return ok && !p.cfg.NoDrain
}

// drainCredit takes back, on Stop, the credit the broker still has, so
// that it does not send the deliveries the stop releases straight back to
// the same link, to be released again, until the credit is spent. go-amqp
// sends the drain as a flow with no credit, so even a broker that ignores
// drain stops sending. It returns when the broker answers, or when ctx
// ends (serve returning); the answer matters to nobody.
func drainCredit(ctx context.Context, src driver.Source) {
	if d, ok := src.(drainer); ok {
		_ = d.DrainCredit(ctx, nil)
	}
}

// releaseBuffered releases, on Stop, every delivery no consumer has taken:
// the backlog and Out.
func (p *Pump) releaseBuffered(ctx context.Context) {
	for _, t := range p.backlog {
		p.Settle(t, driver.Outcome{Kind: driver.Release})
	}
	clear(p.backlog)
	p.backlog = p.backlog[:0]
	for more := true; more; {
		select {
		case t := <-p.out:
			p.Settle(t, driver.Outcome{Kind: driver.Release})
		default:
			more = false
		}
	}
	p.applyQueued(ctx)
	p.markReleased()
}

// received counts a new delivery and puts it in Out, or in the backlog
// while Out is full; while stopping it releases it at once.
func (p *Pump) received(t driver.Ticket, stopping bool) {
	if p.acct.Received() {
		s := p.acct.Snapshot()
		p.log.Warn("broker sent past the credit it was given; granting in windows from now on",
			zap.Int("credit", s.Limit), zap.Int64("outstanding", s.Outstanding))
		p.stats.windowed.Store(true)
		p.event(Event{Kind: Overshoot})
	}
	p.acct.ReceivedBytes(t.Entry().Size())
	p.stats.received.Add(1)
	if p.cfg.Meter != nil {
		p.cfg.Meter.Received()
	}
	p.stats.overshoot.Store(p.acct.Overshoot())
	p.noteHeld()
	if p.cfg.Leases != nil {
		p.cfg.Leases.Add(t)
	}
	if stopping {
		p.Settle(t, driver.Outcome{Kind: driver.Release})
		return
	}
	if len(p.backlog) == 0 {
		select {
		case p.out <- t:
			return
		default:
		}
	}
	p.backlog = append(p.backlog, t)
}

// noteHeld publishes the held count (and bytes) for Stats.
func (p *Pump) noteHeld() {
	held := int64(p.acct.Held())
	p.stats.held.Store(held)
	if held > p.stats.maxHeld.Load() {
		p.stats.maxHeld.Store(held)
	}
	bytes, most := p.acct.BytesHeld()
	p.stats.bytesHeld.Store(bytes)
	p.stats.maxBytesHeld.Store(most)
}

// noteCredit publishes the credit now and the round trip, for Stats.
func (p *Pump) noteCredit() {
	if p.cfg.AdaptiveFloor <= 0 && p.cfg.MaxHeldBytes <= 0 {
		return // the credit never moves
	}
	if n := int64(p.acct.Limit()); n != p.stats.creditNow.Load() {
		p.stats.creditNow.Store(n)
	}
	if p.cfg.AdaptiveFloor > 0 {
		p.stats.roundTrip.Store(int64(p.acct.RoundTrip()))
	}
}

// freed records that held deliveries of n bytes in all left the process.
func (p *Pump) freed(count int, n int64) {
	p.acct.Settled(count)
	p.acct.SettledBytes(n)
	p.noteHeld()
}

// Size is the size amqpsub counts for a message: the bytes of its body
// (its data sections, or a binary or string value). The rest of a message
// is small beside a body of any size.
func Size(m *amqp.Message) int64 {
	if m == nil {
		return 0
	}
	var n int64
	for _, d := range m.Data {
		n += int64(len(d))
	}
	switch v := m.Value.(type) {
	case []byte:
		n += int64(len(v))
	case string:
		n += int64(len(v))
	}
	return n
}

func (p *Pump) event(e Event) {
	if p.cfg.OnEvent != nil {
		p.cfg.OnEvent(e)
	}
}

// take puts msg into a free entry, making one when every entry is in use:
// past the credit (a broker that overshoots) or while dropped entries of a
// lost link still wait in a lane.
func (p *Pump) take(msg *amqp.Message, src driver.Source, link uint64) driver.Ticket {
	var d *driver.Delivery
	if n := len(p.free); n > 0 {
		d = p.free[n-1]
		p.free[n-1] = nil
		p.free = p.free[:n-1]
	} else {
		d = driver.NewDelivery(p.links)
		p.bookMu.Lock()
		p.book = append(p.book, d)
		p.bookMu.Unlock()
	}
	return d.Fill(msg, src, link, Size(msg))
}

// release returns an entry to the free list.
func (p *Pump) release(d *driver.Delivery) {
	if p.cfg.Leases != nil {
		p.cfg.Leases.Remove(d)
	}
	d.Clear()
	p.free = append(p.free, d)
}

// dropStale stops counting as held every buffered delivery of a lost link:
// its settlement could not reach the broker, which redelivers it, so the
// next link gets all the credit its limit allows at once instead of as the
// lanes reach these deliveries. all says that no lease of the lost link
// can be kept any more, those of deliveries in handlers included;
// otherwise (LeasesOutliveLinks, DropBufferedOn) only the dropped ones
// leave the Leases.
func (p *Pump) dropStale(all bool) {
	cur := p.links.Current()
	n, bytes := 0, int64(0)
	for _, d := range p.book { // the pump is the book's only writer
		if d.DropStale(cur) {
			n++
			bytes += d.Size()
		}
	}
	if n > 0 {
		p.stats.settled[driver.Drop].Add(uint64(n))
		if p.cfg.Meter != nil {
			p.cfg.Meter.Dropped(n)
		}
		p.freed(n, bytes)
	}
	if p.cfg.Leases != nil {
		// No lease of a lost link can be kept (the broker ended them with
		// the link): the Leases forget them all, those still in handlers
		// or settling too, rather than spend a refused renewal on each.
		for _, d := range p.book {
			if st := d.State(); st == driver.Dropped || st == driver.Reclaiming || (all && d.Link() != cur && st != driver.Free) {
				p.cfg.Leases.Remove(d)
			}
		}
	}
}

// LoseLease tells the pump that the lease of t's delivery is lost (the
// broker no longer holds it for this consumer, and redelivers it). It may
// be called from any goroutine.
//
// A delivery no handler has taken yet is dropped (it stops counting as
// held at once, and the consumer that finds it passes it to Settle, which
// only frees it); a delivery in a handler is marked, so that its
// settlement is not sent and counted as skipped. A delivery already
// settling or settled is left alone.
//
// It reports whether it acted: false when the ticket's delivery was
// settling or settled, or its entry already holds another.
func (p *Pump) LoseLease(t driver.Ticket) bool {
	switch from, size := t.LoseLease(); from {
	case driver.Buffered:
		p.settle.push(settlement{t: t, size: size, op: opLeaseLost})
		return true
	case driver.Handling:
		return true
	}
	return false
}

// Each calls fn for every delivery held in the process, until fn returns
// false. It may run from any goroutine; a delivery may change state or be
// settled while fn looks at it.
func (p *Pump) Each(fn func(d *driver.Delivery) bool) {
	p.bookMu.RLock()
	defer p.bookMu.RUnlock()
	for _, d := range p.book {
		if s := d.State(); s != driver.Free && s != driver.Dropped && s != driver.Reclaiming && !fn(d) {
			return
		}
	}
}
