package wire

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"time"
)

// DefaultMaxQueued is the MaxQueued used when Options.MaxQueued is 0.
const DefaultMaxQueued = 1 << 20

// ErrInvalidOption is wrapped by the error Options.Validate returns.
var ErrInvalidOption = errors.New("wire: invalid option")

// ErrAborted is returned by Write, by Close and by Err once Abort was
// called. It wraps net.ErrClosed.
var ErrAborted = fmt.Errorf("wire: connection aborted: %w", net.ErrClosed)

// Options configures a Conn. The zero value is a sensible production
// configuration.
type Options struct {
	// MaxQueued bounds the bytes accepted by Write and not yet written to
	// the connection, those of the flush in progress included. A Write that
	// would exceed it waits for room, up to the write deadline; a single
	// Write larger than MaxQueued is accepted once nothing is unwritten.
	// 0 picks DefaultMaxQueued; negative is invalid. Default: 1 MiB.
	MaxQueued int
	// NoMerge writes every disposition as go-amqp wrote it. By default
	// (false) a settled accepted disposition is merged into one still
	// queued whose delivery-ids it continues: one frame for a range of
	// deliveries (see the package doc, Merging).
	NoMerge bool
}

// Validate reports an invalid Options with an error wrapping
// ErrInvalidOption. New panics on the same condition, so callers that take
// options from users validate them first.
func (o Options) Validate() error {
	if o.MaxQueued < 0 {
		return fmt.Errorf("%w: MaxQueued %d is negative", ErrInvalidOption, o.MaxQueued)
	}
	return nil
}

// Stats counts what a Conn did, for benchmarks and tests.
type Stats struct {
	Writes  uint64 // Write calls that queued bytes
	Flushes uint64 // Write calls the flusher made on the connection under it
	Bytes   uint64 // bytes written to the connection under it
	Merged  uint64 // accepted dispositions written as part of another's frame, not as their own
}

// Conn is a net.Conn whose Write queues bytes for one flusher goroutine,
// which writes everything queued meanwhile in one Write on the connection
// under it. Read passes through, recording the peer's sasl-outcome on the
// way. All methods are safe for concurrent use. Make one with New.
type Conn struct {
	c     net.Conn      // what go-amqp reads and writes through us
	raw   net.Conn      // the socket Abort closes; c itself when c is not layered
	max   int           // Options.MaxQueued, resolved
	merge bool          // !Options.NoMerge
	done  chan struct{} // closed when the flusher returns

	mu        sync.Mutex
	wake      sync.Cond     // the flusher waits on it for bytes, Close or Abort
	idle      bool          // the flusher is waiting on wake
	queued    []byte        // bytes accepted and not yet handed to a syscall
	spare     []byte        // the other buffer, empty, when no syscall is using it
	unwritten int           // len(queued) plus the bytes of the syscall in progress
	wdl       time.Time     // write deadline in force
	applied   time.Time     // write deadline last set on c
	flushing  bool          // a syscall is in progress
	room      chan struct{} // closed and cleared when Writes waiting for room should look again
	closing   bool          // Close was called: Write refuses, the flusher drains and ends
	err       error         // first write error, or ErrAborted; Write returns it from then on
	stats     Stats
	// accs are the accepted dispositions in queued, written as
	// appendAccepted writes them, that later ones may extend: those queued
	// since the last flush and since the last frame that is neither a flow
	// nor a disposition, at most len(accs) of them, the newest last.
	accs  [16]accRange
	naccs int

	closeOnce sync.Once
	closeErr  error
	abortOnce sync.Once
	abortErr  error
	rawOnce   sync.Once
	rawErr    error
	cOnce     sync.Once
	cErr      error

	sniffing atomic.Bool   // sniff is still in use; read without the lock by Read
	sniffMu  sync.Mutex    // guards sniff
	sniff    *sniffer      // nil once sniffing stopped
	outcome  atomic.Uint32 // outcomeSeen|code once a sasl-outcome was read

	waitHook func() // tests: called each time a Write is about to wait for room
}

// New wraps c, the connection go-amqp will read and write (a *tls.Conn over
// TCP, or the TCP conn itself). raw is the socket under it that Abort
// closes; nil means c. New starts the flusher goroutine, which Close or
// Abort ends. New panics if opts is invalid (see Options.Validate).
func New(c net.Conn, raw net.Conn, opts Options) *Conn {
	if err := opts.Validate(); err != nil {
		panic(err)
	}
	if raw == nil {
		raw = c
	}
	w := &Conn{
		c:     c,
		raw:   raw,
		max:   opts.MaxQueued,
		merge: !opts.NoMerge,
		done:  make(chan struct{}),
		sniff: new(sniffer),
	}
	if w.max == 0 {
		w.max = DefaultMaxQueued
	}
	w.wake.L = &w.mu
	w.sniffing.Store(true)
	go w.flusher()
	return w
}

// Write copies p into the queue and returns len(p), waking the flusher. It
// waits only when MaxQueued bytes are already unwritten, and then no later
// than the write deadline, failing with an error that satisfies
// errors.Is(err, os.ErrDeadlineExceeded) and net.Error's Timeout. A deadline
// already past fails at once, as on a socket. After a write on the
// connection failed Write returns that error; after Close, net.ErrClosed;
// after Abort, ErrAborted.
func (c *Conn) Write(p []byte) (int, error) {
	// An accepted disposition is queued as appendAccepted writes it, which
	// may be longer than go-amqp's encoding: room is made for that.
	need := len(p)
	a, isAcc := accepted{}, false
	if c.merge {
		if a, isAcc = parseAccepted(p); isAcc {
			need = mergedSize
		}
	}
	c.mu.Lock()
	for {
		if c.err != nil {
			err := c.err
			c.mu.Unlock()
			return 0, err
		}
		if c.closing {
			c.mu.Unlock()
			return 0, net.ErrClosed
		}
		dl := c.wdl
		if !dl.IsZero() && !time.Now().Before(dl) {
			c.mu.Unlock()
			return 0, c.timeout()
		}
		if len(p) == 0 {
			c.mu.Unlock()
			return 0, nil
		}
		if c.unwritten == 0 || c.unwritten+need <= c.max {
			break
		}
		if c.room == nil {
			c.room = make(chan struct{})
		}
		room := c.room
		c.mu.Unlock()
		if c.waitHook != nil {
			c.waitHook()
		}
		waitRoom(room, dl)
		c.mu.Lock()
	}
	c.stats.Writes++
	if isAcc {
		c.queueAccepted(a)
		c.mu.Unlock()
		return len(p), nil
	}
	if c.merge {
		if !crossable(p) {
			c.naccs = 0
		}
	}
	c.queued = append(c.queued, p...)
	c.unwritten += len(p)
	if c.idle {
		c.wake.Signal()
	}
	c.mu.Unlock()
	return len(p), nil
}

// queueAccepted queues a settled accepted disposition: merged into one
// queued since the last flush whose range it continues on the same
// channel, with no frame between them but flows and dispositions, else
// queued as its own frame that later ones may extend. Under mu.
//
// Merging moves an acceptance ahead of the flows and dispositions of other
// deliveries queued since the one it joins. Settling sooner is harmless:
// a flow's credit counts transfers, not settlements, and no delivery is
// settled twice. Any other frame (a detach, an end, a transfer) is never
// crossed.
func (c *Conn) queueAccepted(a accepted) {
	for i := range c.naccs {
		r := &c.accs[i]
		if m, ok := r.a.extend(a); ok {
			r.a = m
			appendAccepted(c.queued[r.off:r.off], m) // in place: same size
			c.stats.Merged++
			c.joinRanges(i)
			return
		}
	}
	if c.naccs == len(c.accs) {
		copy(c.accs[:], c.accs[1:])
		c.naccs--
	}
	c.accs[c.naccs] = accRange{off: len(c.queued), a: a}
	c.naccs++
	c.queued = appendAccepted(c.queued, a)
	c.unwritten += mergedSize
	if c.idle {
		c.wake.Signal()
	}
}

// joinRanges merges accs[i], just extended, with the tracked range it now
// touches, if any: the one queued first takes both ranges and the other's
// frame is cut out of the queue. Under mu.
func (c *Conn) joinRanges(i int) {
	for j := range c.naccs {
		if j == i {
			continue
		}
		m, ok := c.accs[i].a.extend(c.accs[j].a)
		if !ok {
			continue
		}
		keep, cut := i, j
		if c.accs[j].off < c.accs[i].off {
			keep, cut = j, i
		}
		c.accs[keep].a = m
		appendAccepted(c.queued[c.accs[keep].off:c.accs[keep].off], m)
		off := c.accs[cut].off
		c.queued = append(c.queued[:off], c.queued[off+mergedSize:]...)
		c.unwritten -= mergedSize
		for k := range c.naccs {
			if c.accs[k].off > off {
				c.accs[k].off -= mergedSize
			}
		}
		copy(c.accs[cut:c.naccs], c.accs[cut+1:c.naccs])
		c.naccs--
		c.stats.Merged++
		return
	}
}

// waitRoom waits until room is closed or the deadline dl (none if zero)
// passes; the caller looks at the state again either way.
func waitRoom(room <-chan struct{}, dl time.Time) {
	if dl.IsZero() {
		<-room
		return
	}
	t := time.NewTimer(time.Until(dl))
	defer t.Stop()
	select {
	case <-room:
	case <-t.C:
	}
}

// wakeRoomLocked releases the Writes waiting for room.
func (c *Conn) wakeRoomLocked() {
	if c.room != nil {
		close(c.room)
		c.room = nil
	}
}

// timeout is the error of a Write whose deadline passed, built as the net
// package builds its own so that go-amqp and the library see a timeout.
func (c *Conn) timeout() error {
	var network string
	if a := c.c.LocalAddr(); a != nil {
		network = a.Network()
	}
	return &net.OpError{Op: "write", Net: network, Source: c.c.LocalAddr(), Addr: c.c.RemoteAddr(), Err: os.ErrDeadlineExceeded}
}

// flusher writes what Write queued, one syscall per batch, until Close has
// drained the queue, Abort, or a write error.
func (c *Conn) flusher() {
	defer close(c.done)
	c.mu.Lock()
	for {
		for len(c.queued) == 0 && c.err == nil && !c.closing {
			c.idle = true
			c.wake.Wait()
			c.idle = false
		}
		if c.err != nil || len(c.queued) == 0 {
			c.mu.Unlock()
			return
		}
		buf := c.queued
		c.queued, c.spare = c.spare, nil
		c.naccs = 0
		if !c.wdl.Equal(c.applied) {
			c.applied = c.wdl
			_ = c.c.SetWriteDeadline(c.wdl) // an error here shows in the Write
		}
		c.flushing = true
		c.mu.Unlock()

		n, err := c.c.Write(buf)
		if err == nil && n < len(buf) {
			err = io.ErrShortWrite
		}
		if err != nil {
			// Close the socket before the error is seen: a Read blocked in
			// go-amqp's reader fails at once, and whoever sees the error
			// finds the socket closed. The socket, not c: tls.Conn.Close
			// would first try to send close_notify over the socket that just
			// failed, for up to 5 s.
			_ = c.closeRaw() // the write error is what the caller sees
		}

		c.mu.Lock()
		c.flushing = false
		c.unwritten -= len(buf)
		c.stats.Flushes++
		c.stats.Bytes += uint64(max(0, n))
		if cap(buf) <= 2*c.max {
			c.spare = buf[:0] // else let an outsized buffer go
		}
		c.wakeRoomLocked()
		if err != nil {
			if c.err == nil {
				c.err = err
			}
			c.queued = c.queued[:0]
			c.naccs = 0
			c.unwritten = 0
			c.mu.Unlock()
			return
		}
	}
}

// Read reads from the connection, passing the bytes through unchanged; the
// first ones are also parsed for the peer's sasl-outcome (see SASLOutcome).
func (c *Conn) Read(p []byte) (int, error) {
	n, err := c.c.Read(p)
	if c.sniffing.Load() {
		c.sniffRead(p[:n], err)
	}
	return n, err
}

func (c *Conn) sniffRead(b []byte, err error) {
	c.sniffMu.Lock()
	defer c.sniffMu.Unlock()
	if c.sniff == nil {
		return
	}
	done := c.sniff.feed(b)
	if c.sniff.seen {
		c.outcome.Store(outcomeSeen | uint32(c.sniff.code))
	}
	if done || err != nil {
		c.sniff = nil
		c.sniffing.Store(false)
	}
}

const outcomeSeen = 1 << 8

// SASLOutcome returns the code of the sasl-outcome the peer sent, and
// whether one was read at all (see SASLOK and the other codes). Read looks
// for it in the first 4 KiB of the stream: the SASL protocol header, then
// SASL frames (sasl-mechanisms and sasl-challenge are skipped), with
// smallulong or ulong descriptors and list8 or list32 bodies. It stops at the
// outcome or at anything else.
func (c *Conn) SASLOutcome() (code byte, seen bool) {
	v := c.outcome.Load()
	return byte(v & 0xff), v&outcomeSeen != 0
}

// Close writes what is queued, bounded by the write deadline in force, then
// closes the connection; Writes waiting for room fail with net.ErrClosed.
// It returns nil if every byte Write accepted was written and the
// connection closed cleanly; otherwise the write error that lost bytes
// (ErrAborted after Abort), or the connection's close error. It waits for
// the flusher. Later calls wait for the first and return the same value.
//
// A flush with no write deadline on a peer that does not read blocks Close
// until Abort. Over TLS the connection's Close sends close_notify, which
// crypto/tls bounds by 5 s of its own.
func (c *Conn) Close() error {
	c.closeOnce.Do(func() {
		c.mu.Lock()
		c.closing = true
		c.wake.Signal()
		c.wakeRoomLocked()
		c.mu.Unlock()
		<-c.done

		c.mu.Lock()
		err := c.err
		c.mu.Unlock()
		cerr := c.closeC()
		switch {
		case err != nil:
			c.closeErr = err
		case cerr != nil:
			c.closeErr = cerr
		}
	})
	return c.closeErr
}

// Abort closes the raw socket at once, so that any Write waiting for room,
// the flush in progress, a Read and a Close in progress return; Writes fail
// with ErrAborted from then on. It waits for the flusher, which ends without
// writing what is queued. It returns the socket's close error (nil if it was
// already closed); later calls return the same value.
func (c *Conn) Abort() error {
	c.abortOnce.Do(func() {
		c.mu.Lock()
		if c.err == nil {
			c.err = ErrAborted
		}
		c.wake.Signal()
		c.wakeRoomLocked()
		c.mu.Unlock()
		if err := c.closeRaw(); err != nil && !errors.Is(err, net.ErrClosed) {
			c.abortErr = err
		}
	})
	<-c.done
	return c.abortErr
}

func (c *Conn) closeRaw() error {
	c.rawOnce.Do(func() { c.rawErr = c.raw.Close() })
	return c.rawErr
}

// closeC closes c, or only raw when c is raw.
func (c *Conn) closeC() error {
	if c.c == c.raw {
		return c.closeRaw()
	}
	c.cOnce.Do(func() { c.cErr = c.c.Close() })
	return c.cErr
}

// Err returns the error that ended writing: the first write error on the
// connection, or ErrAborted; nil while writes can still succeed. go-amqp
// keeps such an error only as the text of its *amqp.ConnError (which does
// not unwrap it), so the library asks the Conn.
func (c *Conn) Err() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.err
}

// Stats returns the counters so far.
func (c *Conn) Stats() Stats {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.stats
}

// LocalAddr returns the connection's local address.
func (c *Conn) LocalAddr() net.Addr { return c.c.LocalAddr() }

// RemoteAddr returns the connection's remote address.
func (c *Conn) RemoteAddr() net.Addr { return c.c.RemoteAddr() }

// SetDeadline sets the read and write deadlines, as SetReadDeadline and
// SetWriteDeadline do.
func (c *Conn) SetDeadline(t time.Time) error {
	rerr := c.c.SetReadDeadline(t)
	werr := c.SetWriteDeadline(t)
	if rerr != nil {
		return rerr
	}
	return werr
}

// SetReadDeadline sets the connection's read deadline.
func (c *Conn) SetReadDeadline(t time.Time) error { return c.c.SetReadDeadline(t) }

// SetWriteDeadline sets the deadline for Writes, including one waiting for
// room now; the zero time means none. The flusher sets on the connection,
// before each syscall, the latest deadline set before it took the batch: a
// flush is bounded by the deadline in force when its newest bytes were
// queued. go-amqp sets now+timeout before each frame, so a batch gets the
// timeout of its newest frame, for one deadline change per syscall instead
// of one per frame. A deadline earlier than the one bounding the flush in
// progress is passed on at once, so that, as on a socket, a deadline in the
// past makes a blocked write time out.
func (c *Conn) SetWriteDeadline(t time.Time) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.wdl = t
	c.wakeRoomLocked()
	if c.flushing && earlier(t, c.applied) {
		c.applied = t
		return c.c.SetWriteDeadline(t)
	}
	return nil
}

// earlier reports whether deadline a comes before deadline b, the zero time
// being none, which is never.
func earlier(a, b time.Time) bool {
	return !a.IsZero() && (b.IsZero() || a.Before(b))
}

var _ net.Conn = (*Conn)(nil)

// An accepted is a disposition frame of the receiver role that settles the
// deliveries first..last on channel ch as accepted: what go-amqp writes for
// each AcceptMessage under receiver-settle-mode first, one frame per
// delivery.
type accepted struct {
	ch          uint16
	first, last uint32
}

// accRange is an accepted disposition queued at offset off.
type accRange struct {
	off int
	a   accepted
}

// crossable reports whether an accepted disposition may be merged into
// one queued before p: p is an empty frame (a heartbeat), a flow or a
// disposition. Any other frame, or anything not a whole AMQP frame, is a
// barrier.
func crossable(p []byte) bool {
	if len(p) == 8 {
		return binary.BigEndian.Uint32(p) == 8 && p[5] == 0
	}
	return len(p) >= 11 && int(binary.BigEndian.Uint32(p)) == len(p) && p[4] == 2 && p[5] == 0 &&
		p[8] == codeDescribed && p[9] == codeSmallUlong && (p[10] == descFlow || p[10] == descDispose)
}

// mergedSize is the length of a frame appendAccepted writes.
const mergedSize = 30

// AMQP 1.0 type codes and descriptors the parser knows (part 1, section
// 1.6, and the performative and outcome descriptors of parts 2 and 3).
const (
	codeDescribed  = 0x00
	codeSmallUlong = 0x53
	codeNull       = 0x40
	codeTrue       = 0x41
	codeFalse      = 0x42
	codeBool       = 0x56
	codeUint0      = 0x43
	codeSmallUint  = 0x52
	codeUint       = 0x70
	codeList0      = 0x45
	codeList8      = 0xc0
	codeList32     = 0xd0
	descFlow       = 0x13 // amqp:flow:list
	descDispose    = 0x15 // amqp:disposition:list
	descAccepted   = 0x24 // amqp:accepted:list
)

// parseAccepted reports whether p is exactly one AMQP frame holding a
// settled, accepted disposition of the receiver role with nothing else in
// it (no batchable flag set, no payload). Anything else, or anything it
// cannot read, is not one: such frames pass through untouched.
func parseAccepted(p []byte) (accepted, bool) {
	var a accepted
	// Frame header: size, doff = 2 (8 bytes), type 0 (AMQP), channel.
	if len(p) < 8 || int(binary.BigEndian.Uint32(p)) != len(p) || p[4] != 2 || p[5] != 0 {
		return a, false
	}
	a.ch = binary.BigEndian.Uint16(p[6:])
	r := reader{b: p[8:]}
	if !r.descriptor(descDispose) {
		return a, false
	}
	count, ok := r.listHeader(true)
	if !ok || count < 5 || count > 6 {
		return a, false
	}
	role, ok := r.boolean()
	if !ok || !role { // role true: receiver
		return a, false
	}
	if a.first, ok = r.uint(); !ok {
		return a, false
	}
	a.last = a.first
	if !r.null() {
		if a.last, ok = r.uint(); !ok || a.last < a.first {
			return a, false
		}
	}
	if settled, ok := r.boolean(); !ok || !settled {
		return a, false
	}
	if !r.descriptor(descAccepted) {
		return a, false
	}
	if n, ok := r.listHeader(false); !ok || n != 0 {
		return a, false
	}
	if count == 6 && !r.null() {
		if batchable, ok := r.boolean(); !ok || batchable {
			return a, false
		}
	}
	return a, len(r.b) == 0
}

// appendAccepted appends a as one frame: a disposition with role receiver,
// first, last, settled and the accepted outcome, in mergedSize bytes.
func appendAccepted(b []byte, a accepted) []byte {
	b = binary.BigEndian.AppendUint32(b, mergedSize)
	b = append(b, 2, 0)
	b = binary.BigEndian.AppendUint16(b, a.ch)
	b = append(b, codeDescribed, codeSmallUlong, descDispose,
		codeList8, 17, 5, // size: count byte + 16 bytes of fields; 5 fields
		codeTrue, codeUint)
	b = binary.BigEndian.AppendUint32(b, a.first)
	b = append(b, codeUint)
	b = binary.BigEndian.AppendUint32(b, a.last)
	return append(b, codeTrue, codeDescribed, codeSmallUlong, descAccepted, codeList0)
}

// extend returns the range of a and next as one, if next follows a or
// precedes it with no gap, on the same channel, and neither wraps around
// the delivery-id space (a range across the wrap is legal in AMQP but
// brokers need not read it as such).
func (a accepted) extend(next accepted) (accepted, bool) {
	switch {
	case a.ch != next.ch:
		return a, false
	case a.last != math.MaxUint32 && next.first == a.last+1:
		a.last = next.last
		return a, true
	case next.last != math.MaxUint32 && next.last+1 == a.first:
		a.first = next.first
		return a, true
	}
	return a, false
}

// reader reads the AMQP encodings parseAccepted needs. A read that runs
// past the end empties b.
type reader struct{ b []byte }

func (r *reader) take(n int) []byte {
	if len(r.b) < n {
		r.b = nil
		return nil
	}
	v := r.b[:n]
	r.b = r.b[n:]
	return v
}

// descriptor reads a small-ulong descriptor and reports whether it is code.
func (r *reader) descriptor(code byte) bool {
	d := r.take(3)
	return d != nil && d[0] == codeDescribed && d[1] == codeSmallUlong && d[2] == code
}

// listHeader reads a list's constructor and size and returns its count.
// With whole, the list must end exactly where the frame ends (the
// performative's list, with no payload after it); otherwise it must be
// empty.
func (r *reader) listHeader(whole bool) (uint32, bool) {
	c := r.take(1)
	if c == nil {
		return 0, false
	}
	switch c[0] {
	case codeList0:
		return 0, !whole || len(r.b) == 0
	case codeList8:
		h := r.take(2) // size (of what follows it), count
		if h == nil {
			return 0, false
		}
		if whole {
			return uint32(h[1]), int(h[0]) == len(r.b)+1
		}
		return uint32(h[1]), h[0] == 1 && h[1] == 0
	case codeList32:
		h := r.take(8)
		if h == nil {
			return 0, false
		}
		size, count := binary.BigEndian.Uint32(h), binary.BigEndian.Uint32(h[4:])
		if whole {
			return count, uint64(size) == uint64(len(r.b))+4
		}
		return count, size == 4 && count == 0
	}
	return 0, false
}

func (r *reader) boolean() (bool, bool) {
	c := r.take(1)
	if c == nil {
		return false, false
	}
	switch c[0] {
	case codeTrue:
		return true, true
	case codeFalse:
		return false, true
	case codeBool:
		v := r.take(1)
		if v == nil || v[0] > 1 {
			return false, false
		}
		return v[0] == 1, true
	}
	return false, false
}

// null reads a null if one is next and reports whether it did.
func (r *reader) null() bool {
	if len(r.b) > 0 && r.b[0] == codeNull {
		r.b = r.b[1:]
		return true
	}
	return false
}

func (r *reader) uint() (uint32, bool) {
	c := r.take(1)
	if c == nil {
		return 0, false
	}
	switch c[0] {
	case codeUint0:
		return 0, true
	case codeSmallUint:
		v := r.take(1)
		if v == nil {
			return 0, false
		}
		return uint32(v[0]), true
	case codeUint:
		v := r.take(4)
		if v == nil {
			return 0, false
		}
		return binary.BigEndian.Uint32(v), true
	}
	return 0, false
}
