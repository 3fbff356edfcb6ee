package wire

import (
	"encoding/binary"
	"fmt"
)

// The codes of a sasl-outcome (AMQP 1.0 security, section 5.3.3.6).
const (
	SASLOK      byte = 0 // authentication succeeded
	SASLAuth    byte = 1 // failed: the credentials were refused
	SASLSys     byte = 2 // failed: a system error on the peer
	SASLSysPerm byte = 3 // failed: a system error unlikely to be corrected
	SASLSysTemp byte = 4 // failed: a transient system error; a retry may succeed
)

// SASLError reports that the peer answered the SASL exchange with a
// sasl-outcome other than ok. HandshakeError returns one.
type SASLError struct {
	Code byte  // the outcome's code: SASLAuth, SASLSys, SASLSysPerm, SASLSysTemp or another
	Err  error // the error the AMQP client returned for the handshake
}

func (e *SASLError) Error() string {
	msg := fmt.Sprintf("sasl: authentication refused by the peer (code %d, %s)", e.Code, codeName(e.Code))
	if e.Err == nil {
		return msg
	}
	return msg + ": " + e.Err.Error()
}

func (e *SASLError) Unwrap() error { return e.Err }

func codeName(code byte) string {
	switch code {
	case SASLOK:
		return "ok"
	case SASLAuth:
		return "auth"
	case SASLSys:
		return "sys"
	case SASLSysPerm:
		return "sys-perm"
	case SASLSysTemp:
		return "sys-temp"
	}
	return "unknown"
}

// HandshakeError returns err wrapped in a *SASLError when c read a
// sasl-outcome other than ok, and err itself otherwise; nil stays nil. Call
// it with the error amqp.NewConn returned for c: go-amqp reports a refused
// outcome only as text, and the same text for every mechanism.
func HandshakeError(c *Conn, err error) error {
	if err == nil {
		return nil
	}
	if code, seen := c.SASLOutcome(); seen && code != SASLOK {
		return &SASLError{Code: code, Err: err}
	}
	return err
}

// sniffCap is how many inbound bytes the sniffer looks at: the protocol
// header, sasl-mechanisms, any challenges and the outcome fit many times.
const sniffCap = 4 << 10

// The descriptor codes of the SASL frames a client receives.
const (
	descMechanisms = 0x40
	descChallenge  = 0x42
	descOutcome    = 0x44
)

var saslHeader = [8]byte{'A', 'M', 'Q', 'P', 3, 1, 0, 0}

// sniffer parses the start of an inbound AMQP stream for the sasl-outcome:
// the SASL protocol header, then whole SASL frames, stopping after the
// outcome, at anything else, or when sniffCap bytes did not hold one. It
// copies what it is fed into a fixed buffer, so it never allocates, and
// parses a unit (the header, a frame) only once the unit is complete.
type sniffer struct {
	buf    [sniffCap]byte
	n      int  // bytes in buf
	pos    int  // start of the next unit to parse
	header bool // the protocol header was parsed
	done   bool
	seen   bool // an outcome was parsed; code holds its code
	code   byte
}

// feed takes the next bytes of the stream and reports whether sniffing is
// over.
func (s *sniffer) feed(b []byte) bool {
	if s.done {
		return true
	}
	s.n += copy(s.buf[s.n:], b)
	s.parse()
	if !s.done && s.n == len(s.buf) {
		s.done = true // the cap is reached with no outcome: give up
	}
	return s.done
}

func (s *sniffer) parse() {
	for !s.done {
		rest := s.buf[s.pos:s.n]
		if !s.header {
			if len(rest) < len(saslHeader) {
				return
			}
			if [8]byte(rest[:8]) != saslHeader {
				s.done = true
				return
			}
			s.header = true
			s.pos += len(saslHeader)
			continue
		}
		if len(rest) < 8 {
			return
		}
		size := binary.BigEndian.Uint32(rest)
		doff := int(rest[4]) * 4
		if rest[5] != 1 || size < 8 || doff < 8 || uint64(doff) > uint64(size) ||
			int64(size) > int64(len(s.buf)-s.pos) {
			s.done = true // not a SASL frame, malformed, or larger than the cap
			return
		}
		if len(rest) < int(size) {
			return
		}
		s.pos += int(size)
		body := rest[doff:size]
		if len(body) == 0 {
			continue // an empty frame
		}
		desc, fields, ok := descriptor(body)
		switch {
		case ok && (desc == descMechanisms || desc == descChallenge):
			continue
		case ok && desc == descOutcome:
			s.code, s.seen = outcomeCode(fields)
		}
		s.done = true
	}
}

// descriptor parses the numeric descriptor that starts a described type and
// returns it with the bytes after it.
func descriptor(b []byte) (desc uint64, rest []byte, ok bool) {
	if len(b) < 2 || b[0] != 0x00 {
		return 0, nil, false
	}
	switch b[1] {
	case 0x53: // smallulong
		if len(b) < 3 {
			return 0, nil, false
		}
		return uint64(b[2]), b[3:], true
	case 0x80: // ulong
		if len(b) < 10 {
			return 0, nil, false
		}
		return binary.BigEndian.Uint64(b[2:]), b[10:], true
	}
	return 0, nil, false
}

// outcomeCode returns the first field of a sasl-outcome's list, the code,
// if it is a ubyte inside the list.
func outcomeCode(b []byte) (byte, bool) {
	var field []byte // the list's elements, as far as its size says
	switch {
	case len(b) >= 3 && b[0] == 0xc0: // list8: size, count, elements
		size, count := int(b[1]), int(b[2])
		if count == 0 || size < 1 || size > len(b)-2 {
			return 0, false
		}
		field = b[3 : 2+size]
	case len(b) >= 9 && b[0] == 0xd0: // list32: size, count, elements
		size, count := binary.BigEndian.Uint32(b[1:]), binary.BigEndian.Uint32(b[5:])
		if count == 0 || size < 4 || int64(size) > int64(len(b)-5) {
			return 0, false
		}
		field = b[9 : 5+size]
	default: // list0 has no code; anything else is not a list
		return 0, false
	}
	if len(field) < 2 || field[0] != 0x50 { // ubyte
		return 0, false
	}
	return field[1], true
}
