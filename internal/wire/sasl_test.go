package wire_test

import (
	"bytes"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/amqpsub/amqpsub/internal/wire"
)

// streamConn is a net.Conn whose Reads return stream, each at most the next
// of sizes bytes (cycling; 0 means no limit), then io.EOF. Writes are
// discarded.
type streamConn struct {
	stream []byte
	sizes  []int
	i      int
}

func (s *streamConn) Read(p []byte) (int, error) {
	if len(s.stream) == 0 {
		return 0, io.EOF
	}
	n := len(p)
	if len(s.sizes) > 0 {
		if m := s.sizes[s.i%len(s.sizes)]; m > 0 && m < n {
			n = m
		}
		s.i++
	}
	n = copy(p[:n], s.stream)
	s.stream = s.stream[n:]
	return n, nil
}

func (*streamConn) Write(p []byte) (int, error)      { return len(p), nil }
func (*streamConn) Close() error                     { return nil }
func (*streamConn) LocalAddr() net.Addr              { return &net.TCPAddr{} }
func (*streamConn) RemoteAddr() net.Addr             { return &net.TCPAddr{} }
func (*streamConn) SetDeadline(time.Time) error      { return nil }
func (*streamConn) SetReadDeadline(time.Time) error  { return nil }
func (*streamConn) SetWriteDeadline(time.Time) error { return nil }

// readThrough reads stream through a Conn with Reads of the given sizes into
// buffers of bufSize, and returns what came out and the outcome sniffed.
func readThrough(t testing.TB, stream []byte, sizes []int, bufSize int) (out []byte, code byte, seen bool) {
	c := wire.New(&streamConn{stream: stream, sizes: sizes}, nil, wire.Options{})
	defer c.Close()
	buf := make([]byte, bufSize)
	for {
		n, err := c.Read(buf)
		out = append(out, buf[:n]...)
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatalf("Read: %v", err)
		}
	}
	code, seen = c.SASLOutcome()
	return out, code, seen
}

func TestSniffsTheSASLOutcome(t *testing.T) {
	mech := mechanisms("ANONYMOUS", "PLAIN")
	tests := []struct {
		name   string
		stream []byte
		code   byte
		seen   bool
	}{
		{"ok", slices.Concat(saslHeader, mech, outcome(0), amqpHeader, open(0)), 0, true},
		{"auth", slices.Concat(saslHeader, mech, outcome(1)), 1, true},
		{"sys-temp after challenges", slices.Concat(saslHeader, mech, challenge("a"), challenge(`{"status":"401"}`), outcome(4)), 4, true},
		{"empty SASL frames skipped", slices.Concat(saslHeader, frame(typeSASL, nil), mech, frame(typeSASL, nil), outcome(2)), 2, true},
		{"ulong descriptor, list32", slices.Concat(saslHeader, frame(typeSASL, describedULong(0x40, list32(symArray("PLAIN")))),
			frame(typeSASL, describedULong(0x44, list32(ubyte(3), binary8([]byte("x")))))), 3, true},
		{"extended header", slices.Concat(saslHeader, func() []byte {
			f := frame(typeSASL, append([]byte{0, 0, 0, 0}, described(0x44, list8(ubyte(1)))...))
			f[4] = 3 // doff 3: one word of extended header
			return f
		}()), 1, true},
		{"outcome with additional-data", slices.Concat(saslHeader, frame(typeSASL, described(0x44, list8(ubyte(1), binary8([]byte("no")))))), 1, true},
		{"unknown code kept", slices.Concat(saslHeader, outcome(9)), 9, true},
		{"no SASL: AMQP header", slices.Concat(amqpHeader, open(0)), 0, false},
		{"TLS header", []byte{'A', 'M', 'Q', 'P', 2, 1, 0, 0}, 0, false},
		{"not AMQP", []byte("HTTP/1.1 400 Bad Request\r\n\r\n"), 0, false},
		{"AMQP frame before the outcome", slices.Concat(saslHeader, mech, open(0), outcome(1)), 0, false},
		{"sasl-init inbound stops", slices.Concat(saslHeader, frame(typeSASL, described(0x41, list8(sym8("PLAIN")))), outcome(1)), 0, false},
		{"symbolic descriptor not understood", slices.Concat(saslHeader, frame(typeSASL, append([]byte{0x00}, sym8("amqp:sasl-outcome:list")...))), 0, false},
		{"list0 outcome has no code", slices.Concat(saslHeader, frame(typeSASL, described(0x44, []byte{0x45}))), 0, false},
		{"empty list8", slices.Concat(saslHeader, frame(typeSASL, described(0x44, list8()))), 0, false},
		{"code not a ubyte", slices.Concat(saslHeader, frame(typeSASL, described(0x44, list8(null)))), 0, false},
		{"list size too small for the code", slices.Concat(saslHeader, frame(typeSASL, described(0x44, []byte{0xc0, 2, 1, 0x50, 1}))), 0, false},
		{"truncated outcome", slices.Concat(saslHeader, mech, outcome(1)[:10]), 0, false},
		{"frame size below 8", slices.Concat(saslHeader, []byte{0, 0, 0, 4, 2, 1, 0, 0}, outcome(1)), 0, false},
		{"doff below 2", slices.Concat(saslHeader, func() []byte { f := outcome(1); f[4] = 1; return f }()), 0, false},
		{"doff beyond size", slices.Concat(saslHeader, func() []byte { f := outcome(1); f[4] = 200; return f }()), 0, false},
		{"frame larger than the cap", slices.Concat(saslHeader, frame(typeSASL, described(0x42, list8(make([]byte, wire.SniffCap)))), outcome(1)), 0, false},
		{"outcome past the cap", slices.Concat(saslHeader, bytes.Repeat(challenge(strings.Repeat("x", 200)), wire.SniffCap/200), outcome(1)), 0, false},
		{"outcome ends at the cap", slices.Concat(saslHeader, padChallenge(wire.SniffCap-len(saslHeader)-len(outcome(1))), outcome(1)), 1, true},
		{"outcome one byte past the cap", slices.Concat(saslHeader, padChallenge(wire.SniffCap-len(saslHeader)-len(outcome(1))+1), outcome(1)), 0, false},
		{"empty stream", nil, 0, false},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			wantCode, wantSeen := refOutcome(tc.stream)
			if wantCode != tc.code || wantSeen != tc.seen {
				t.Fatalf("reference parse = %d, %v; the table says %d, %v", wantCode, wantSeen, tc.code, tc.seen)
			}
			for _, sizes := range [][]int{nil, {1}, {3, 7, 1}, {8}, {9}} {
				out, code, seen := readThrough(t, tc.stream, sizes, 1024)
				if !bytes.Equal(out, tc.stream) {
					t.Fatalf("reads of %v: the bytes changed", sizes)
				}
				if code != tc.code || seen != tc.seen {
					t.Fatalf("reads of %v: SASLOutcome = %d, %v, want %d, %v", sizes, code, seen, tc.code, tc.seen)
				}
			}
		})
	}
}

// padChallenge returns a challenge frame of exactly n bytes (n >= 25): a
// vbin32 challenge in a list32.
func padChallenge(n int) []byte {
	data := n - 8 - 3 - 9 - 5 // frame header, descriptor, list32 header, vbin32 header
	v := binary.BigEndian.AppendUint32([]byte{0xb0}, uint32(data))
	return frame(typeSASL, described(0x42, list32(append(v, make([]byte, data)...))))
}

func TestSniffingAllocatesNothingPerRead(t *testing.T) {
	stream := slices.Concat(saslHeader, mechanisms("PLAIN"), challenge("c"), outcome(0))
	src := &streamConn{stream: bytes.Repeat(stream, 1000), sizes: []int{1}}
	c := wire.New(src, nil, wire.Options{})
	defer c.Close()
	buf := make([]byte, 64)
	if a := testing.AllocsPerRun(len(stream)-1, func() { c.Read(buf) }); a != 0 {
		t.Fatalf("%v allocations per Read while sniffing", a)
	}
	if _, seen := c.SASLOutcome(); !seen {
		t.Fatal("outcome not seen")
	}
	if a := testing.AllocsPerRun(1000, func() { c.Read(buf) }); a != 0 {
		t.Fatalf("%v allocations per Read after sniffing", a)
	}
}

// refOutcome is the reference parse: the whole stream at once, as the
// specification reads, limited to the first SniffCap bytes.
func refOutcome(stream []byte) (code byte, seen bool) {
	if len(stream) > wire.SniffCap {
		stream = stream[:wire.SniffCap]
	}
	if !bytes.HasPrefix(stream, saslHeader) {
		return 0, false
	}
	frames := stream[len(saslHeader):]
	for len(frames) >= 8 {
		size := int(binary.BigEndian.Uint32(frames[0:4]))
		doff, typ := 4*int(frames[4]), frames[5]
		if typ != typeSASL || size < 8 || doff < 8 || doff > size || size > len(frames) {
			return 0, false
		}
		body := frames[doff:size]
		frames = frames[size:]
		if len(body) == 0 {
			continue
		}
		var desc uint64
		switch {
		case len(body) >= 3 && body[0] == 0 && body[1] == 0x53:
			desc, body = uint64(body[2]), body[3:]
		case len(body) >= 10 && body[0] == 0 && body[1] == 0x80:
			desc, body = binary.BigEndian.Uint64(body[2:10]), body[10:]
		default:
			return 0, false
		}
		switch desc {
		case 0x40, 0x42:
			continue
		case 0x44:
			return refCode(body)
		default:
			return 0, false
		}
	}
	return 0, false
}

func refCode(list []byte) (byte, bool) {
	var elems []byte
	var count uint32
	switch {
	case len(list) >= 3 && list[0] == 0xc0:
		size := int(list[1])
		if size < 1 || 2+size > len(list) {
			return 0, false
		}
		count, elems = uint32(list[2]), list[3:2+size]
	case len(list) >= 9 && list[0] == 0xd0:
		size := int(binary.BigEndian.Uint32(list[1:5]))
		if size < 4 || 5+size > len(list) {
			return 0, false
		}
		count, elems = binary.BigEndian.Uint32(list[5:9]), list[9:5+size]
	default:
		return 0, false
	}
	if count == 0 || len(elems) < 2 || elems[0] != 0x50 {
		return 0, false
	}
	return elems[1], true
}

// Inbound bytes come off the wire: any stream, split at any Read
// boundaries, must come out unchanged, never panic, and be sniffed as the
// reference parse reads it.
func FuzzSASLSniffer(f *testing.F) {
	f.Add(slices.Concat(saslHeader, mechanisms("ANONYMOUS", "PLAIN"), outcome(1)), []byte{1, 5, 200})
	f.Add(slices.Concat(saslHeader, mechanisms("PLAIN"), outcome(0), amqpHeader, open(0)), []byte{0})
	f.Add(slices.Concat(saslHeader, challenge("x"), frame(typeSASL, describedULong(0x44, list32(ubyte(4))))), []byte{7, 0, 3})
	f.Add(slices.Concat(saslHeader, frame(typeSASL, nil), outcome(2)), []byte{})
	f.Add(slices.Concat(amqpHeader, open(0)), []byte{2})
	f.Add([]byte{}, []byte{})
	f.Fuzz(func(t *testing.T, stream, splits []byte) {
		sizes := make([]int, len(splits))
		for i, s := range splits {
			sizes[i] = int(s) // 0: no limit
		}
		bufSize := 512
		if len(splits) > 0 {
			bufSize = 1 + int(splits[0])
		}
		out, code, seen := readThrough(t, stream, sizes, bufSize)
		if !bytes.Equal(out, stream) {
			t.Fatalf("the bytes changed")
		}
		wantCode, wantSeen := refOutcome(stream)
		if code != wantCode || seen != wantSeen {
			t.Fatalf("sniffed %d, %v; reference %d, %v", code, seen, wantCode, wantSeen)
		}
	})
}

func TestHandshakeError(t *testing.T) {
	refused := wire.New(&streamConn{stream: slices.Concat(saslHeader, outcome(wire.SASLAuth))}, nil, wire.Options{})
	defer refused.Close()
	io.Copy(io.Discard, refused)
	okConn := wire.New(&streamConn{stream: slices.Concat(saslHeader, outcome(wire.SASLOK))}, nil, wire.Options{})
	defer okConn.Close()
	io.Copy(io.Discard, okConn)
	none := wire.New(&streamConn{}, nil, wire.Options{})
	defer none.Close()

	amqpErr := errors.New("SASL PLAIN auth failed with code 0x1: ")
	err := wire.HandshakeError(refused, amqpErr)
	var se *wire.SASLError
	if !errors.As(err, &se) || se.Code != wire.SASLAuth || !errors.Is(err, amqpErr) {
		t.Fatalf("HandshakeError = %v, want a *SASLError with code 1 wrapping the original", err)
	}
	if want := "sasl: authentication refused by the peer (code 1, auth): SASL PLAIN auth failed with code 0x1: "; err.Error() != want {
		t.Fatalf("Error() = %q", err.Error())
	}
	if wire.HandshakeError(refused, nil) != nil {
		t.Fatal("nil error became non-nil")
	}
	if err := wire.HandshakeError(okConn, amqpErr); err != amqpErr {
		t.Fatalf("ok outcome: %v", err)
	}
	if err := wire.HandshakeError(none, amqpErr); err != amqpErr {
		t.Fatalf("no outcome: %v", err)
	}
	for code, name := range map[byte]string{wire.SASLSys: "sys", wire.SASLSysPerm: "sys-perm", wire.SASLSysTemp: "sys-temp", 7: "unknown"} {
		e := &wire.SASLError{Code: code}
		if !strings.Contains(e.Error(), name) || e.Unwrap() != nil {
			t.Fatalf("code %d: %q", code, e.Error())
		}
	}
}
