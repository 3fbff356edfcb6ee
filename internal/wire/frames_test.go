package wire_test

import (
	"encoding/binary"
	"slices"
)

// Just enough AMQP 1.0 encoding to script a peer and feed the sniffer.

var (
	saslHeader = []byte{'A', 'M', 'Q', 'P', 3, 1, 0, 0}
	amqpHeader = []byte{'A', 'M', 'Q', 'P', 0, 1, 0, 0}
	emptyFrame = []byte{0, 0, 0, 8, 2, 0, 0, 0}
	null       = []byte{0x40}
)

const (
	typeAMQP = 0
	typeSASL = 1
)

// frame returns a frame of the given type with a 2-word header and body.
func frame(typ byte, body []byte) []byte {
	b := binary.BigEndian.AppendUint32(nil, uint32(8+len(body)))
	b = append(b, 2, typ, 0, 0)
	return append(b, body...)
}

// described returns a described type with a smallulong descriptor.
func described(code byte, value []byte) []byte {
	return append([]byte{0x00, 0x53, code}, value...)
}

// describedULong returns a described type with a ulong descriptor.
func describedULong(code byte, value []byte) []byte {
	b := binary.BigEndian.AppendUint64([]byte{0x00, 0x80}, uint64(code))
	return append(b, value...)
}

func list8(fields ...[]byte) []byte {
	body := slices.Concat(fields...)
	return append([]byte{0xc0, byte(1 + len(body)), byte(len(fields))}, body...)
}

func list32(fields ...[]byte) []byte {
	body := slices.Concat(fields...)
	b := binary.BigEndian.AppendUint32([]byte{0xd0}, uint32(4+len(body)))
	b = binary.BigEndian.AppendUint32(b, uint32(len(fields)))
	return append(b, body...)
}

func ubyte(v byte) []byte     { return []byte{0x50, v} }
func sym8(s string) []byte    { return append([]byte{0xa3, byte(len(s))}, s...) }
func str8(s string) []byte    { return append([]byte{0xa1, byte(len(s))}, s...) }
func binary8(b []byte) []byte { return append([]byte{0xa0, byte(len(b))}, b...) }
func uintField(v uint32) []byte {
	return binary.BigEndian.AppendUint32([]byte{0x70}, v)
}

// symArray returns an array8 of symbols.
func symArray(syms ...string) []byte {
	var els []byte
	for _, s := range syms {
		els = append(els, byte(len(s)))
		els = append(els, s...)
	}
	return append([]byte{0xe0, byte(2 + len(els)), byte(len(syms)), 0xa3}, els...)
}

func mechanisms(mechs ...string) []byte {
	return frame(typeSASL, described(0x40, list8(symArray(mechs...))))
}

func challenge(data string) []byte {
	return frame(typeSASL, described(0x42, list8(binary8([]byte(data)))))
}

func outcome(code byte) []byte {
	return frame(typeSASL, described(0x44, list8(ubyte(code))))
}

// open returns an open frame for container "peer", advertising idleMS as
// its idle-time-out when it is not 0.
func open(idleMS uint32) []byte {
	idle := null
	if idleMS > 0 {
		idle = uintField(idleMS)
	}
	return frame(typeAMQP, described(0x10, list8(str8("peer"), null, null, null, idle)))
}

// closeWithError returns a close frame carrying an error condition.
func closeWithError(condition, description string) []byte {
	return frame(typeAMQP, described(0x18, list8(described(0x1d, list8(sym8(condition), str8(description))))))
}
