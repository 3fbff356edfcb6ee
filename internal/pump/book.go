package pump

import (
	"fmt"
	"sync/atomic"

	"github.com/Azure/go-amqp"
)

// State is where a held delivery is.
//
// An entry moves [Free] → [Buffered] when the pump receives a delivery into it;
// Buffered → [Handling] when a consumer gives it to a handler (Begin);
// Buffered or Handling → [Settling] when its settlement is handed to Settle;
// Settling → Free once the pump has applied it. The pump moves a Buffered
// entry to [Dropped] when the delivery can no longer be settled (its link was
// lost): it stops counting it as held at once, and the consumer that later
// finds it hands it to Settle, which moves it to [Reclaiming] until the
// pump frees the entry.
type State int32

const (
	// Free means the entry holds no delivery.
	Free State = iota
	// Buffered means received, waiting in the pump, Out or a lane.
	Buffered
	// Handling means given to a handler.
	Handling
	// Settling means the handler is done; its settlement waits for the pump.
	Settling
	// Dropped means no longer held (its link was lost); the entry waits for the
	// consumer that still has it to pass it to Settle.
	Dropped
	// Reclaiming means a Dropped entry was passed to Settle: still not
	// held, nor counted as settling; it waits for the pump to free it
	// (which a pump that has returned never does).
	Reclaiming
)

var stateNames = [...]string{"free", "buffered", "handling", "settling", "dropped", "reclaiming"}

func (s State) String() string {
	if int(s) < len(stateNames) {
		return stateNames[s]
	}
	return fmt.Sprintf("State(%d)", int32(s))
}

// Delivery is an entry of the pump's book: the place of one delivery held
// in the process. Entries are reused once settled; consumers hold a [Ticket],
// which names the entry and the delivery it held when the ticket was made.
type Delivery struct {
	msg atomic.Pointer[amqp.Message]
	// word is the generation (high 32 bits: how often the entry was taken),
	// the lost-lock flag (bit 8) and the State (low 8 bits), changed
	// together so that a ticket of an earlier generation cannot move the
	// entry.
	word atomic.Uint64
	// Set by the pump before the entry is handed out; read-only after.
	src  Source
	link uint64
	size atomic.Int64 // Size of msg; atomic: LoseLock reads it from another goroutine
	p    *Pump
	// sending is set by the settler that sends the delivery's settlement,
	// as it begins to (see Ticket.Sending), and cleared when the entry is
	// freed.
	sending atomic.Bool
	// after is the function a handler asked to hear the settlement with
	// (Ticket.OnSettled), tagged with the generation it is for.
	after atomic.Pointer[afterSettle]
}

type afterSettle struct {
	gen uint32
	f   func(Kind, error)
}

// notify calls, on the pump's goroutine, the function OnSettled gave for
// the entry's current delivery, once.
func (d *Delivery) notify(k Kind, err error) {
	if d.after.Load() == nil {
		return // the common case, without a locked instruction
	}
	a := d.after.Swap(nil)
	if a == nil {
		return
	}
	if gen, _ := unpack(d.word.Load()); gen == a.gen {
		a.f(k, err)
	}
}

// lockLost marks, in an entry's word, a delivery whose broker lock was lost
// while a handler had it: its settlement is not sent.
const lockLost = 1 << 8

func pack(gen uint32, s State) uint64 { return uint64(gen)<<32 | uint64(s&0xff) }

func unpack(w uint64) (gen uint32, s State) { return uint32(w >> 32), State(w & 0xff) }

// Message returns the AMQP message the entry holds.
func (d *Delivery) Message() *amqp.Message { return d.msg.Load() }

// State returns where the entry's delivery is.
func (d *Delivery) State() State { _, s := unpack(d.word.Load()); return s }

// LockLost reports whether the broker's lock of the entry's delivery was
// lost while a handler had it (LoseLock).
func (d *Delivery) LockLost() bool { return d.word.Load()&lockLost != 0 }

// cas moves the entry from state from to state to, if it is still at gen
// and not flagged.
func (d *Delivery) cas(gen uint32, from, to State) bool {
	return d.word.CompareAndSwap(pack(gen, from), pack(gen, to))
}

// Ticket is a consumer's claim on one held delivery, as Out hands it over.
// It stays tied to that delivery: once the delivery is settled and its entry
// holds another, the ticket's calls refuse to act on it.
type Ticket struct {
	d    *Delivery
	gen  uint32
	link uint64 // the generation of the link the delivery came on
}

// Message returns the AMQP message. Call it only before passing the ticket
// to Settle: the entry holds another message after that.
func (t Ticket) Message() *amqp.Message { return t.d.msg.Load() }

// State returns where the delivery is, or [Free] once it was settled.
func (t Ticket) State() State {
	gen, s := unpack(t.d.word.Load())
	if gen != t.gen {
		return Free
	}
	return s
}

// Sending reports whether the delivery's settlement is being sent now: it
// is [Settling], and a settler has begun to send it (Settlers). A Settling
// delivery that is not Sending waits for its turn (behind the earlier
// settlements of its group), its broker lock still to be kept.
func (t Ticket) Sending() bool { return t.State() == Settling && t.d.sending.Load() }

// Entry returns the book entry the ticket names.
func (t Ticket) Entry() *Delivery { return t.d }

// Stale reports whether the link the delivery came on was lost, so that
// it cannot be settled any more: the broker redelivers it. Under
// KeepAcrossLinks no delivery is ever stale.
// It reads nothing the pump rewrites for the entry's next delivery, so it
// may be called at any time from any goroutine.
func (t Ticket) Stale() bool {
	return t.link != t.d.p.link.Load() && !t.d.p.cfg.KeepAcrossLinks
}

// OnSettled asks the pump to call f once it has applied the delivery's
// settlement: with the outcome's kind, and nil when the broker took it,
// [ErrNotSent] when it was not sent, or the broker's or link's error. f runs
// on the pump's goroutine and must return at once. A later call replaces
// an earlier one's f.
//
// It reports false, and f is never called, when the delivery is already
// settling or settled. f is not called for a delivery that is dropped
// unsettled (its link lost before a handler took it), nor for one whose
// settlement comes after Run returned.
func (t Ticket) OnSettled(f func(k Kind, err error)) bool {
	if s := t.State(); s != Buffered && s != Handling {
		return false
	}
	mine := &afterSettle{gen: t.gen, f: f}
	var prev *afterSettle
	for {
		prev = t.d.after.Load()
		if prev != nil && later(prev.gen, t.gen) {
			return false // the entry holds a later delivery, whose function stays
		}
		if t.d.after.CompareAndSwap(prev, mine) {
			break
		}
	}
	// Settling began between the check and the store (a goroutine the
	// handler left behind): put back what was there, so that the handler's
	// own function is kept. If the slot changed meanwhile, the pump has
	// taken f and calls it in place of the one it replaced (the call came
	// in time, just), or a later call replaced it.
	if s := t.State(); s != Buffered && s != Handling && t.d.after.CompareAndSwap(mine, prev) {
		return false
	}
	return true
}

// later reports whether generation a comes after b, across the wrap of the
// counter: a is at most 2³¹ generations ahead.
func later(a, b uint32) bool { return a != b && a-b < 1<<31 }

// Begin marks the delivery as given to a handler and reports true, or
// reports false when it must not be handled: it is stale, or was dropped.
// Either way the caller passes the ticket to Settle once (with [Drop] when
// Begin reported false).
func (t Ticket) Begin() bool {
	if t.Stale() {
		return false
	}
	return t.d.cas(t.gen, Buffered, Handling)
}

// take puts msg into a free entry, making one when every entry is in use:
// past the credit (a broker that overshoots) or while dropped entries of a
// lost link still wait in a lane.
func (p *Pump) take(msg *amqp.Message, src Source, link uint64) Ticket {
	var d *Delivery
	if n := len(p.free); n > 0 {
		d = p.free[n-1]
		p.free[n-1] = nil
		p.free = p.free[:n-1]
	} else {
		d = &Delivery{p: p}
		p.bookMu.Lock()
		p.book = append(p.book, d)
		p.bookMu.Unlock()
	}
	d.src, d.link = src, link
	d.size.Store(Size(msg))
	d.msg.Store(msg)
	gen := uint32(d.word.Load()>>32) + 1
	d.word.Store(pack(gen, Buffered))
	return Ticket{d, gen, link}
}

// release returns an entry to the free list.
func (p *Pump) release(d *Delivery) {
	if p.cfg.Leases != nil {
		p.cfg.Leases.Remove(d)
	}
	d.msg.Store(nil)
	d.src = nil
	d.sending.Store(false)
	if d.after.Load() != nil {
		d.after.Store(nil)
	}
	d.word.Store(pack(uint32(d.word.Load()>>32), Free))
	p.free = append(p.free, d)
}

// dropStale stops counting as held every buffered delivery of a lost link:
// its settlement could not reach the broker, which redelivers it, so the
// next link gets all the credit its limit allows at once instead of as the
// lanes reach these deliveries. all says that no lock of the lost link
// can be renewed any more, those of deliveries in handlers included;
// otherwise (KeepAcrossLinks, DropBufferedOn) only the dropped ones leave
// the lease book.
func (p *Pump) dropStale(all bool) {
	cur := p.link.Load()
	n, bytes := 0, int64(0)
	for _, d := range p.book { // the pump is the book's only writer
		w := d.word.Load()
		if gen, st := unpack(w); d.link != cur && st == Buffered && d.word.CompareAndSwap(w, pack(gen, Dropped)) {
			n++
			bytes += d.size.Load()
		}
	}
	if n > 0 {
		p.stats.settled[Drop].Add(uint64(n))
		if p.cfg.Meter != nil {
			p.cfg.Meter.Dropped(n)
		}
		p.freed(n, bytes)
	}
	if p.cfg.Leases != nil {
		// No lock of a lost link can be renewed (the service ended them
		// with the link): the lease book forgets them all, those still in
		// handlers or settling too, rather than spend a refused request on
		// each.
		for _, d := range p.book {
			if st := d.State(); st == Dropped || st == Reclaiming || (all && d.link != cur && st != Free) {
				p.cfg.Leases.Remove(d)
			}
		}
	}
}

// LoseLock tells the pump that the broker's lock of t's delivery is lost
// (Service Bus). It may be called from any goroutine.
//
// A delivery no handler has taken yet is dropped (it stops counting as
// held at once, and the consumer that finds it passes it to Settle, which
// only frees it); a delivery in a handler is marked, so that its
// settlement is not sent and counted as skipped. A delivery already
// settling or settled is left alone.
//
// It reports whether it acted: false when the ticket's delivery was
// settling or settled, or its entry already holds another.
func (p *Pump) LoseLock(t Ticket) bool {
	for {
		w := t.d.word.Load()
		gen, s := unpack(w)
		if gen != t.gen || w&lockLost != 0 {
			return false
		}
		switch s {
		case Buffered:
			size := t.d.size.Load() // read before the entry can be reused
			if t.d.word.CompareAndSwap(w, pack(gen, Dropped)) {
				p.settle.push(settlement{d: t.d, gen: t.gen, size: size, o: Outcome{Kind: lostLock}})
				return true
			}
		case Handling:
			if t.d.word.CompareAndSwap(w, w|lockLost) {
				return true
			}
		default:
			return false
		}
	}
}

// Each calls fn for every delivery held in the process, until fn returns
// false. It may run from any goroutine; a delivery may change state or be
// settled while fn looks at it.
func (p *Pump) Each(fn func(d *Delivery) bool) {
	p.bookMu.RLock()
	defer p.bookMu.RUnlock()
	for _, d := range p.book {
		if s := d.State(); s != Free && s != Dropped && s != Reclaiming && !fn(d) {
			return
		}
	}
}
