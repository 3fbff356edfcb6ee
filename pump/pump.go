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

	"github.com/amqpsub/amqpsub/credit"
)

// Source is the set of receiver calls the pump makes. *amqp.Receiver
// implements it; tests and benchmarks use a fake.
type Source interface {
	Receive(ctx context.Context, opts *amqp.ReceiveOptions) (*amqp.Message, error)
	IssueCredit(credit uint32) error
	DrainCredit(ctx context.Context, opts *amqp.DrainCreditOptions) error
	AcceptMessage(ctx context.Context, msg *amqp.Message) error
	ReleaseMessage(ctx context.Context, msg *amqp.Message) error
	RejectMessage(ctx context.Context, msg *amqp.Message, e *amqp.Error) error
	ModifyMessage(ctx context.Context, msg *amqp.Message, opts *amqp.ModifyMessageOptions) error
}

// AttachFunc returns a source to receive from. Run calls it at start, with
// lost nil, and again after the source it gave failed, with lost the error
// that ended it. It should block until it has a source or ctx ends (backing
// off between attempts as it sees fit); an error it returns ends Run. The
// source must be attached with manual credit (go-amqp ReceiverOptions.Credit
// = -1). Cancelling ctx means the pump is stopping.
type AttachFunc func(ctx context.Context, lost error) (Source, error)

// Kind is what a settlement tells the broker.
type Kind uint8

const (
	// Accept settles the delivery as accepted.
	Accept Kind = iota
	// Release returns the delivery to the queue, not counted as a failure.
	Release
	// Modify returns the delivery to the queue as modified (see Outcome).
	Modify
	// Reject settles the delivery as rejected: dead-lettered by most brokers.
	Reject
	// Drop frees the delivery's place without telling the broker, for
	// deliveries of a lost link, which the broker redelivers anyway.
	Drop
)

var kindNames = [...]string{"accept", "release", "modify", "reject", "drop"}

func (k Kind) String() string {
	if int(k) < len(kindNames) {
		return kindNames[k]
	}
	return fmt.Sprintf("Kind(%d)", k)
}

// Outcome is a settlement.
type Outcome struct {
	Kind Kind
	// Error is sent with Reject; nil sends none.
	Error *amqp.Error
	// DeliveryFailed and UndeliverableHere go with Modify.
	DeliveryFailed    bool
	UndeliverableHere bool
}

// Config configures a Pump. The zero value of each field is documented.
type Config struct {
	// Credit is the most deliveries the process holds at once. Required, ≥ 1.
	Credit int
	// Chunk is the least credit granted in one flow frame. 0 picks
	// max(1, Credit/8).
	Chunk int
	// Mode is the credit mode at start (see package credit). A broker seen
	// sending past its credit switches the pump to credit.Windowed.
	Mode credit.Mode
	// DrainTimeout, when > 0, makes the pump drain the link's credit when it
	// stops, waiting at most this long, so that the deliveries it releases go
	// to other consumers rather than back to it. 0 skips the drain: Artemis
	// 2.40 never answers a drain the way go-amqp waits for. Without a drain,
	// a delivery that comes back is released again at once, and since no
	// credit is granted while stopping, this ends when the credit is used up.
	DrainTimeout time.Duration
	// Logger receives the pump's logs. nil means no logs.
	Logger *zap.Logger
}

// State is where a held delivery is.
type State int32

const (
	// Free: the entry holds no delivery.
	Free State = iota
	// Buffered: received, waiting in the pump, Out or a lane.
	Buffered
	// Handling: given to a handler.
	Handling
	// Settling: the handler is done; its settlement waits for the pump.
	Settling
)

var stateNames = [...]string{"free", "buffered", "handling", "settling"}

func (s State) String() string {
	if int(s) < len(stateNames) {
		return stateNames[s]
	}
	return fmt.Sprintf("State(%d)", int32(s))
}

// Delivery is an entry of the pump's book: one delivery held in the
// process. Entries are reused once settled, so a Delivery must not be used
// after it was passed to Settle.
type Delivery struct {
	msg   atomic.Pointer[amqp.Message]
	state atomic.Int32
	src   Source
	link  uint64
	p     *Pump
}

// Message returns the AMQP message.
func (d *Delivery) Message() *amqp.Message { return d.msg.Load() }

// State returns where the delivery is.
func (d *Delivery) State() State { return State(d.state.Load()) }

// SetState records where the delivery is. Consumers set Handling when a
// handler takes it; Settle sets Settling.
func (d *Delivery) SetState(s State) { d.state.Store(int32(s)) }

// Stale reports whether the link the delivery came on was lost. A stale
// delivery cannot be settled; the broker redelivers it, so consumers should
// Settle it with Drop instead of handling it.
func (d *Delivery) Stale() bool { return d.link != d.p.link.Load() }

type settlement struct {
	d *Delivery
	o Outcome
}

// Pump is the receiving end of one subscription. Create it with New, start it
// with Run.
type Pump struct {
	cfg    Config
	log    *zap.Logger
	out    chan *Delivery
	settle settleQueue

	stopOnce sync.Once
	stop     chan struct{}
	done     chan struct{}

	link atomic.Uint64 // generation of the current link; 0 before the first

	// Owned by the Run goroutine.
	acct    *credit.Account
	free    []*Delivery
	backlog []*Delivery // received, waiting for room in out
	running atomic.Bool

	bookMu sync.RWMutex
	book   []*Delivery // every entry ever made; grows only past the credit

	stats counters
}

// New returns a Pump. It panics on an invalid Config, which callers validate
// first.
func New(cfg Config) *Pump {
	log := cfg.Logger
	if log == nil {
		log = zap.NewNop()
	}
	p := &Pump{
		cfg:    cfg,
		log:    log,
		out:    make(chan *Delivery, cfg.Credit),
		settle: newSettleQueue(2 * cfg.Credit),
		stop:   make(chan struct{}),
		done:   make(chan struct{}),
		acct:   credit.New(cfg.Credit, cfg.Chunk, cfg.Mode),
	}
	p.stats.windowed.Store(cfg.Mode == credit.Windowed)
	p.book = make([]*Delivery, cfg.Credit)
	p.free = make([]*Delivery, cfg.Credit)
	for i := range p.book {
		d := &Delivery{p: p}
		p.book[i] = d
		p.free[i] = d
	}
	return p
}

// Out returns the channel of received deliveries, as deep as the credit.
// Each delivery taken from it must be passed to Settle exactly once. Out is
// closed when Run returns.
func (p *Pump) Out() <-chan *Delivery { return p.out }

// Stopping returns a channel closed when Stop is called. Consumers release
// deliveries they have not yet given to a handler once it is closed.
func (p *Pump) Stopping() <-chan struct{} { return p.stop }

// Done returns a channel closed when Run has returned.
func (p *Pump) Done() <-chan struct{} { return p.done }

// Settle hands the pump a delivery's settlement. It never blocks and does
// not wait for the broker: the pump applies queued settlements in a burst
// whenever it wakes, also while a delivery waits for room in Out.
// Settlements that arrive after Run has returned are dropped, and the
// broker redelivers those deliveries once the link is closed.
func (p *Pump) Settle(d *Delivery, o Outcome) {
	d.state.Store(int32(Settling))
	p.settle.push(settlement{d, o})
}

// Stop starts a graceful stop: the pump grants no more credit, drains the
// credit the broker still has (if Config.DrainTimeout says so), releases every delivery not yet taken from
// Out and every delivery that still arrives, applies the settlements of
// deliveries in handlers, and Run returns once nothing is held. Stop does not
// wait; it is safe to call more than once and from any goroutine.
func (p *Pump) Stop() { p.stopOnce.Do(func() { close(p.stop) }) }

// ErrStopped is returned by Run after Stop once every held delivery was
// settled.
var ErrStopped = errors.New("pump: stopped")

// Run receives from the sources attach gives until Stop has taken effect,
// ctx ends, or attach fails. It returns ErrStopped after a graceful stop,
// ctx.Err() when ctx ended first (deliveries still held then stay unsettled
// on the link, and the broker redelivers them once the link closes), or the
// error of attach. Out is closed when Run returns. Run may be called once.
func (p *Pump) Run(ctx context.Context, attach AttachFunc) error {
	if !p.running.CompareAndSwap(false, true) {
		return errors.New("pump: Run called twice")
	}
	defer close(p.done)
	defer close(p.out)
	var lost error
	for {
		src, err := p.attach(ctx, attach, lost)
		if err != nil {
			return err
		}
		err = p.serve(ctx, src)
		if err == nil || errors.Is(err, ErrStopped) {
			return ErrStopped
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
		p.log.Warn("link lost", zap.Error(err), zap.Int("held", p.acct.Held()))
		p.stats.linksLost.Add(1)
		lost = err
		// Deliveries of the lost link are stale from here on.
		p.link.Add(1)
		p.dropBacklog()
	}
}

// attach asks for a source while still applying settlements (which, for
// deliveries of a lost link, only free their entries). After Stop it waits
// for nothing held and returns ErrStopped.
func (p *Pump) attach(ctx context.Context, attach AttachFunc, lost error) (Source, error) {
	actx, cancel := context.WithCancel(ctx)
	defer cancel()
	type result struct {
		src Source
		err error
	}
	res := make(chan result, 1)
	var wg sync.WaitGroup
	wg.Go(func() {
		src, err := attach(actx, lost)
		res <- result{src, err}
	})
	defer wg.Wait()
	stop := p.stop
	for {
		select {
		case r := <-res:
			if r.err != nil {
				if isStopping(p.stop) {
					return nil, p.waitIdle(ctx)
				}
				return nil, r.err
			}
			p.link.Add(1)
			p.acct.Attach()
			p.stats.links.Add(1)
			return r.src, nil
		case <-p.settle.wake:
			p.applyQueued(ctx)
		case <-stop:
			stop = nil
			cancel()
		case <-ctx.Done():
			cancel()
			return nil, ctx.Err()
		}
	}
}

// waitIdle applies settlements until nothing is held.
func (p *Pump) waitIdle(ctx context.Context) error {
	p.dropBacklog()
	for p.acct.Held() > 0 {
		select {
		case d := <-p.out:
			p.apply(ctx, settlement{d, Outcome{Kind: Drop}})
		case <-p.settle.wake:
			p.applyQueued(ctx)
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	return ErrStopped
}

// serve runs one link until it fails (its error), Stop took effect
// (ErrStopped) or ctx ended.
func (p *Pump) serve(ctx context.Context, src Source) error {
	gen := p.link.Load()
	rctx, cancelReceive := context.WithCancel(ctx)
	in := newInbox(p.cfg.Credit)
	var wg sync.WaitGroup
	wg.Go(func() { receiveLoop(rctx, src, in) })
	defer func() {
		cancelReceive()
		wg.Wait()
		// Whatever the receive loop still handed over was never seen by a
		// consumer: give it back.
		msgs, _ := in.take()
		for _, m := range msgs {
			p.releaseUnheld(ctx, src, m)
		}
	}()

	stop := p.stop
	stopping := isStopping(stop)
	if stopping {
		stop = nil
		wg.Go(func() { p.drain(ctx, src) })
	}
	for {
		if !stopping {
			if n := p.acct.Grant(); n > 0 {
				if err := src.IssueCredit(n); err != nil {
					return fmt.Errorf("pump: issue credit: %w", err)
				}
				p.stats.granted.Add(uint64(n))
			}
		} else if p.acct.Held() == 0 {
			return ErrStopped
		}
		var head *Delivery
		var out chan<- *Delivery
		if len(p.backlog) > 0 {
			head, out = p.backlog[0], p.out
		}
		select {
		case <-in.wake:
			msgs, err := in.take()
			for _, m := range msgs {
				p.received(ctx, p.take(m, src, gen), stopping)
			}
			in.recycle(msgs)
			if err != nil {
				return err
			}
		case out <- head:
			p.backlog[0] = nil
			p.backlog = p.backlog[1:]
			if len(p.backlog) == 0 {
				p.backlog = p.backlog[:0:0]
			}
		case <-p.settle.wake:
			// Everything queued goes at once, before the next grant, so
			// credit goes back in chunks rather than a flow frame per
			// settlement.
			p.applyQueued(ctx)
		case <-stop:
			stop, stopping = nil, true
			wg.Go(func() { p.drain(ctx, src) })
			for _, d := range p.backlog {
				p.apply(ctx, settlement{d, Outcome{Kind: Release}})
			}
			clear(p.backlog)
			p.backlog = p.backlog[:0]
			for more := true; more; {
				select {
				case d := <-p.out:
					p.apply(ctx, settlement{d, Outcome{Kind: Release}})
				default:
					more = false
				}
			}
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

// received counts a new delivery and puts it in Out, or in the backlog
// while Out is full; while stopping it releases it at once.
func (p *Pump) received(ctx context.Context, d *Delivery, stopping bool) {
	if p.acct.Received() {
		s := p.acct.Snapshot()
		p.log.Warn("broker sent past the credit it was given; granting in windows from now on",
			zap.Int("credit", s.Limit), zap.Int64("outstanding", s.Outstanding))
		p.stats.windowed.Store(true)
	}
	p.stats.received.Add(1)
	p.noteHeld()
	if stopping {
		p.apply(ctx, settlement{d, Outcome{Kind: Release}})
		return
	}
	if len(p.backlog) == 0 {
		select {
		case p.out <- d:
			return
		default:
		}
	}
	p.backlog = append(p.backlog, d)
}

// receiveLoop hands every delivery of src to the inbox until src fails or
// ctx ends. It is the only goroutine that blocks on the link.
func receiveLoop(ctx context.Context, src Source, in *inbox) {
	for {
		msg, err := src.Receive(ctx, nil)
		if err != nil {
			if ctx.Err() == nil {
				in.fail(fmt.Errorf("pump: receive: %w", err))
			}
			return
		}
		in.push(msg)
	}
}

// drain takes back the credit the broker still has, so that deliveries
// released at stop go to other consumers rather than back to this one.
func (p *Pump) drain(ctx context.Context, src Source) {
	if p.cfg.DrainTimeout <= 0 {
		return
	}
	dctx, cancel := context.WithTimeout(ctx, p.cfg.DrainTimeout)
	defer cancel()
	if err := src.DrainCredit(dctx, nil); err != nil {
		p.log.Debug("drain at stop failed", zap.Error(err))
	}
}

func (p *Pump) take(msg *amqp.Message, src Source, gen uint64) *Delivery {
	var d *Delivery
	if n := len(p.free); n > 0 {
		d = p.free[n-1]
		p.free[n-1] = nil
		p.free = p.free[:n-1]
	} else {
		// Past the credit: only a broker that overshoots gets here.
		d = &Delivery{p: p}
		p.bookMu.Lock()
		p.book = append(p.book, d)
		p.bookMu.Unlock()
	}
	d.src, d.link = src, gen
	d.msg.Store(msg)
	d.state.Store(int32(Buffered))
	return d
}

// applyQueued applies every queued settlement.
func (p *Pump) applyQueued(ctx context.Context) {
	batch := p.settle.take()
	for _, s := range batch {
		p.apply(ctx, s)
	}
	p.settle.recycle(batch)
}

// apply sends a settlement to the broker and frees the delivery's entry.
func (p *Pump) apply(ctx context.Context, s settlement) {
	d := s.d
	msg := d.msg.Load()
	if s.o.Kind != Drop {
		if d.link != p.link.Load() {
			p.log.Debug("settlement of a delivery from a lost link skipped; the broker redelivers it",
				zap.Stringer("outcome", s.o.Kind))
			p.stats.stale.Add(1)
		} else if err := settleOn(ctx, d.src, msg, s.o); err != nil {
			p.log.Debug("settlement failed; the broker redelivers the delivery",
				zap.Stringer("outcome", s.o.Kind), zap.Error(err))
			p.stats.settleErrors.Add(1)
		}
	}
	p.stats.settled[s.o.Kind].Add(1)
	d.msg.Store(nil)
	d.src = nil
	d.state.Store(int32(Free))
	p.free = append(p.free, d)
	p.acct.Settled(1)
	p.noteHeld()
}

func settleOn(ctx context.Context, src Source, msg *amqp.Message, o Outcome) error {
	switch o.Kind {
	case Accept:
		return src.AcceptMessage(ctx, msg)
	case Release:
		return src.ReleaseMessage(ctx, msg)
	case Modify:
		return src.ModifyMessage(ctx, msg, &amqp.ModifyMessageOptions{
			DeliveryFailed:    o.DeliveryFailed,
			UndeliverableHere: o.UndeliverableHere,
		})
	case Reject:
		return src.RejectMessage(ctx, msg, o.Error)
	}
	return fmt.Errorf("pump: unknown outcome %d", o.Kind)
}

// releaseUnheld gives back a message the pump never entered in its book.
func (p *Pump) releaseUnheld(ctx context.Context, src Source, msg *amqp.Message) {
	if err := src.ReleaseMessage(ctx, msg); err != nil {
		p.log.Debug("release at link end failed; the broker redelivers the delivery", zap.Error(err))
	}
}

// dropBacklog frees the entries of deliveries still waiting in the pump
// after their link was lost or while stopping without a link.
func (p *Pump) dropBacklog() {
	for _, d := range p.backlog {
		p.apply(context.Background(), settlement{d, Outcome{Kind: Drop}})
	}
	clear(p.backlog)
	p.backlog = p.backlog[:0]
}

// noteHeld publishes the held count for Stats; the rest of the account's
// counters are read from it when they change, which is rare.
func (p *Pump) noteHeld() {
	held := int64(p.acct.Held())
	p.stats.held.Store(held)
	if held > p.stats.maxHeld.Load() {
		p.stats.maxHeld.Store(held)
		p.stats.overshoot.Store(p.acct.Snapshot().Overshoot)
	}
}

func isStopping(stop <-chan struct{}) bool {
	select {
	case <-stop:
		return true
	default:
		return false
	}
}

// Each calls fn for every delivery held in the process, until fn returns
// false. It may run from any goroutine; a delivery may change state or be
// settled while fn looks at it.
func (p *Pump) Each(fn func(d *Delivery) bool) {
	p.bookMu.RLock()
	defer p.bookMu.RUnlock()
	for _, d := range p.book {
		if d.State() != Free && !fn(d) {
			return
		}
	}
}
