package driver

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"

	"github.com/Azure/go-amqp"
)

// State is where a held delivery is.
//
// An entry moves [Free] → [Buffered] when the engine receives a delivery
// into it; Buffered → [Handling] when a consumer gives it to a handler
// (Begin); Buffered or Handling → [Settling] when its settlement is handed
// to the engine; Settling → Free once the engine has applied it. The
// engine moves a Buffered entry to [Dropped] when the delivery can no
// longer be settled (its link, or its lease, was lost): it
// stops counting it as held at once, and the consumer that later finds it
// hands it back to the engine, which moves it to [Reclaiming] until it
// frees the entry.
type State int32

const (
	// Free means the entry holds no delivery.
	Free State = iota
	// Buffered means received, waiting in the engine or a lane.
	Buffered
	// Handling means given to a handler.
	Handling
	// Settling means the handler is done; its settlement waits for the
	// engine.
	Settling
	// Dropped means no longer held (its link was lost); the entry waits for
	// the consumer that still has it to hand it back.
	Dropped
	// Reclaiming means a Dropped entry was handed back: still not held, nor
	// counted as settling; it waits for the engine to free it (which an
	// engine that has stopped never does).
	Reclaiming
)

var stateNames = [...]string{"free", "buffered", "handling", "settling", "dropped", "reclaiming"}

func (s State) String() string {
	if int(s) < len(stateNames) {
		return stateNames[s]
	}
	return fmt.Sprintf("State(%d)", int32(s))
}

// Links counts the links the engine attached, so that a [Ticket] can tell
// whether the link its delivery came on is still the current one. The
// engine makes one and points every [Delivery] of its book at it. For the
// engine.
type Links struct {
	cur atomic.Uint64
	// keep says that a delivery's lease outlives its link:
	// no delivery is ever stale.
	keep bool
}

// NewLinks returns the count of an engine that has attached no link yet
// (generation 0). keep says that leases outlive their link (see
// [Ticket.Stale]).
func NewLinks(keep bool) *Links { return &Links{keep: keep} }

// Current returns the generation of the current link; 0 before the first.
func (l *Links) Current() uint64 { return l.cur.Load() }

// Next counts one more link (attached or lost) and returns its generation.
func (l *Links) Next() uint64 { return l.cur.Add(1) }

// Stale reports whether a delivery of link generation link can no longer
// be settled: its link is not the current one, and leases do not outlive
// their link.
func (l *Links) Stale(link uint64) bool { return link != l.cur.Load() && !l.keep }

// Delivery is an entry of the engine's book of held deliveries: the place
// of one delivery held in the process. Entries are reused once settled;
// consumers hold a [Ticket], which names the entry and the delivery it
// held when the ticket was made.
type Delivery struct {
	msg atomic.Pointer[amqp.Message]
	// word is the generation (high 32 bits: how often the entry was
	// taken), the lease-lost flag (bit 8) and the State (low 8 bits),
	// changed together so that a ticket of an earlier generation cannot
	// move the entry.
	word atomic.Uint64
	// Set by Fill before the entry is handed out; read-only after.
	src  Source
	link uint64
	size atomic.Int64 // Size of msg; atomic: LoseLease reads it from another goroutine
	gens *Links
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

// leaseLost marks, in an entry's word, a delivery whose lease was
// lost while a handler had it: its settlement is not sent.
const leaseLost = 1 << 8

func pack(gen uint32, s State) uint64 { return uint64(gen)<<32 | uint64(s&0xff) }

func unpack(w uint64) (gen uint32, s State) { return uint32(w >> 32), State(w & 0xff) }

// NewDelivery returns a free entry of the book of the engine whose links
// l counts. For the engine.
func NewDelivery(l *Links) *Delivery { return &Delivery{gens: l} }

// Message returns the AMQP message the entry holds.
func (d *Delivery) Message() *amqp.Message { return d.msg.Load() }

// State returns where the entry's delivery is.
func (d *Delivery) State() State { _, s := unpack(d.word.Load()); return s }

// LeaseLost reports whether the lease of the entry's delivery was
// lost while a handler had it ([Ticket.LoseLease]): its settlement is not
// sent.
func (d *Delivery) LeaseLost() bool { return d.word.Load()&leaseLost != 0 }

// Source returns the source the entry's delivery came from. For the
// engine.
func (d *Delivery) Source() Source { return d.src }

// Link returns the generation of the link the entry's delivery came on.
// For the engine.
func (d *Delivery) Link() uint64 { return d.link }

// Size returns the size the engine counted for the entry's message. For
// the engine.
func (d *Delivery) Size() int64 { return d.size.Load() }

// Fill puts msg, received from src on link generation link and of the
// given size, into the free entry d, and returns its ticket. For the
// engine, on its goroutine.
func (d *Delivery) Fill(msg *amqp.Message, src Source, link uint64, size int64) Ticket {
	d.src, d.link = src, link
	d.size.Store(size)
	d.msg.Store(msg)
	gen := uint32(d.word.Load()>>32) + 1
	d.word.Store(pack(gen, Buffered))
	return Ticket{d, gen, link}
}

// Clear frees the entry: it holds no delivery until the next Fill. For the
// engine, on its goroutine.
func (d *Delivery) Clear() {
	d.msg.Store(nil)
	d.src = nil
	d.sending.Store(false)
	if d.after.Load() != nil {
		d.after.Store(nil)
	}
	d.word.Store(pack(uint32(d.word.Load()>>32), Free))
}

// DropStale moves the entry to [Dropped] if it is [Buffered] with a
// delivery of a link other than cur, and reports whether it did. For the
// engine, on its goroutine.
func (d *Delivery) DropStale(cur uint64) bool {
	w := d.word.Load()
	gen, st := unpack(w)
	return d.link != cur && st == Buffered && d.word.CompareAndSwap(w, pack(gen, Dropped))
}

// Notify calls, once, the function OnSettled gave for the entry's current
// delivery. For the engine, on its goroutine.
func (d *Delivery) Notify(k Kind, err error) {
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

// Sending marks the entry's settlement as being sent now
// ([Ticket.Sending]), and returns ctx carrying the mark, for [Resting] to
// clear while the source waits to send it again. For the engine's
// settlers.
func (d *Delivery) Sending(ctx context.Context) context.Context {
	d.sending.Store(true)
	return context.WithValue(ctx, restingKey{}, &d.sending)
}

// Ticket is a consumer's claim on one held delivery, as the engine hands it
// over. It stays tied to that delivery: once the delivery is settled and
// its entry holds another, the ticket's calls refuse to act on it.
type Ticket struct {
	d    *Delivery
	gen  uint32
	link uint64 // the generation of the link the delivery came on
}

// Message returns the AMQP message. Call it only before the ticket is
// settled: the entry holds another message after that.
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
// is [Settling], and a settler has begun to send it. A Settling delivery
// that is not Sending waits for its turn (behind the earlier settlements
// of its group), its lease still to be kept.
func (t Ticket) Sending() bool { return t.State() == Settling && t.d.sending.Load() }

// Entry returns the book entry the ticket names.
func (t Ticket) Entry() *Delivery { return t.d }

// Reused reports whether the ticket's entry holds a later delivery than
// the ticket's. For the engine.
func (t Ticket) Reused() bool { gen, _ := unpack(t.d.word.Load()); return gen != t.gen }

// Stale reports whether the link the delivery came on was lost, so that
// it cannot be settled any more: the broker redelivers it. Where leases
// outlive their link no delivery is ever stale.
// It reads nothing the engine rewrites for the entry's next delivery, so
// it may be called at any time from any goroutine.
func (t Ticket) Stale() bool { return t.d.gens.Stale(t.link) }

// OnSettled asks the engine to call f once it has applied the delivery's
// settlement: with the outcome's kind, and nil when the broker took it,
// [ErrNotSent] when it was not sent, or the broker's or link's error. f
// runs on the engine's goroutine and must return at once. A later call
// replaces an earlier one's f.
//
// It reports false, and f is never called, when the delivery is already
// settling or settled. f is not called for a delivery that is dropped
// unsettled (its link lost before a handler took it), nor for one whose
// settlement comes after the engine stopped.
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
	// own function is kept. If the slot changed meanwhile, the engine has
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
// Either way the caller settles the ticket once (with [Drop] when Begin
// reported false).
func (t Ticket) Begin() bool {
	if t.Stale() {
		return false
	}
	return t.d.word.CompareAndSwap(pack(t.gen, Buffered), pack(t.gen, Handling))
}

// HandBack moves the delivery on as its settlement is handed to the engine,
// and returns the state it was in: from [Buffered] or [Handling] to
// [Settling], from [Dropped] to [Reclaiming]; from any other state (it was
// settled already) it does nothing. For the engine.
func (t Ticket) HandBack() (from State) {
	for {
		w := t.d.word.Load()
		gen, s := unpack(w)
		if gen != t.gen {
			return Free
		}
		var next State
		switch s {
		case Buffered, Handling:
			next = Settling
		case Dropped:
			next = Reclaiming
		default:
			return s
		}
		if t.d.word.CompareAndSwap(w, w&^0xff|uint64(next)) {
			return s
		}
	}
}

// LoseLease records that the delivery's lease is lost, and
// returns the state it found the delivery in: a [Buffered] one (no handler
// took it yet) is now [Dropped], and size is its size, read before the
// entry can be reused; a [Handling] one is marked ([Delivery.LeaseLost]),
// so that its settlement is not sent. A delivery in any other state, or
// already marked, is left alone (from is then neither). It may be called
// from any goroutine. For the engine.
func (t Ticket) LoseLease() (from State, size int64) {
	for {
		w := t.d.word.Load()
		gen, s := unpack(w)
		if gen != t.gen || w&leaseLost != 0 {
			return Free, 0
		}
		switch s {
		case Buffered:
			size := t.d.size.Load()
			if t.d.word.CompareAndSwap(w, pack(gen, Dropped)) {
				return Buffered, size
			}
		case Handling:
			if t.d.word.CompareAndSwap(w, w|leaseLost) {
				return Handling, 0
			}
		default:
			return s, 0
		}
	}
}

// Kind is what a settlement tells the broker.
type Kind uint8

const (
	// Accept settles the delivery as accepted.
	Accept Kind = iota
	// Release returns the delivery to the queue as released, not as a
	// failed attempt; a broker may still count it toward a delivery limit.
	Release
	// Modify returns the delivery to the queue as modified (see [Outcome]).
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
	// Error is sent with [Reject]; nil sends none.
	Error *amqp.Error
	// DeliveryFailed, UndeliverableHere and Annotations go with [Modify];
	// the broker merges Annotations into the message's annotations (nil:
	// none).
	DeliveryFailed    bool
	UndeliverableHere bool
	Annotations       amqp.Annotations
}

// ErrNotSent is what the engine's meter and a [Ticket]'s OnSettled
// function hear of a settlement that was not sent: the delivery's link was
// lost, or its lease ([Delivery.LeaseLost]), while a handler
// had it, or the engine stopped before it could be sent. The broker
// delivers it again.
var ErrNotSent = errors.New("driver: settlement not sent: the delivery's link or lease was lost; the broker delivers it again")

// SentAs returns what a [Source]'s settlement call returns when it sent
// the broker outcome k in place of the one asked for, err being the
// broker's answer (nil: taken). The engine then counts the settlement, and
// reports it to its meter and the delivery's OnSettled function, as k.
// Only Accept, Release, Modify and Reject are outcomes; another k is
// ignored.
func SentAs(k Kind, err error) error { return &sentAs{kind: k, err: err} }

type sentAs struct {
	kind Kind
	err  error
}

func (e *sentAs) Error() string {
	if e.err == nil {
		return "driver: settled as " + e.kind.String()
	}
	return "driver: settling as " + e.kind.String() + ": " + e.err.Error()
}

func (e *sentAs) Unwrap() error { return e.err }

// SentOutcome reads a [Source]'s answer to a settlement of kind k: the
// outcome that went out (k, unless the answer is one of [SentAs]) and the
// broker's answer. For the engine.
func SentOutcome(k Kind, err error) (Kind, error) {
	if err == nil {
		return k, nil // before sa, which escapes: no allocation per settlement
	}
	var sa *sentAs
	if errors.As(err, &sa) {
		if sa.kind <= Reject {
			k = sa.kind
		}
		return k, sa.err
	}
	return k, err
}

type restingKey struct{}

// Resting tells the engine that the settlement a [Source] is sending in
// ctx (the context of its Accept, Release, Reject or Modify call) is not
// out until resume is called: its first answer said to try again later,
// and the Source waits before sending it again. Meanwhile the delivery's
// [Ticket.Sending] is false, so that its [Leases] renew its lease while
// it waits. Outside a settlement the engine's settlers send, it does
// nothing. resume must be called before the Source sends again, and once.
func Resting(ctx context.Context) (resume func()) {
	sending, ok := ctx.Value(restingKey{}).(*atomic.Bool)
	if !ok {
		return func() {}
	}
	sending.Store(false)
	return func() { sending.Store(true) }
}
