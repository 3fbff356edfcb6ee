package wire

import (
	"encoding/binary"
	"math"
)

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
