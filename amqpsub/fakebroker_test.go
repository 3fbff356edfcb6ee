package amqpsub_test

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
)

// peer is an AMQP 1.0 broker on 127.0.0.1 just good enough for a receiver
// to attach and stay: it answers SASL (ANONYMOUS or PLAIN: taken, or
// refused with code auth), open, begin and attach, echoes detach, end and
// close, and ignores the rest. It sends no messages. drop closes the
// connections it holds, as a broker that dies does. Everything it started
// ends with the test.
type peer struct {
	ln       net.Listener
	refuse   bool          // refuse every SASL handshake (auth)
	saslOnly bool          // answer a client without SASL with the SASL header, as RabbitMQ 4 does
	mechs    chan string   // the mechanism of each sasl-init, as sent
	accepted atomic.Int64  // TCP connections accepted
	attached chan struct{} // one per receiver attached that gave credit
	mute     atomic.Bool   // answer no detach, end or close (a peer that froze)

	mu    sync.Mutex
	conns map[net.Conn]bool
	wg    sync.WaitGroup
}

func newPeer(t *testing.T, refuse bool) *peer {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &peer{ln: ln, refuse: refuse, attached: make(chan struct{}, 16), mechs: make(chan string, 16), conns: map[net.Conn]bool{}}
	p.wg.Go(func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			p.accepted.Add(1)
			p.mu.Lock()
			p.conns[c] = true
			p.mu.Unlock()
			p.wg.Go(func() {
				defer func() {
					p.mu.Lock()
					delete(p.conns, c)
					p.mu.Unlock()
					c.Close()
				}()
				if err := p.serve(c); err != nil && !errors.Is(err, io.EOF) && !errors.Is(err, net.ErrClosed) {
					t.Logf("peer %s: %v", ln.Addr(), err)
				}
			})
		}
	})
	t.Cleanup(func() {
		ln.Close()
		p.drop()
		p.wg.Wait()
	})
	return p
}

func (p *peer) addr() string { return p.ln.Addr().String() }

// drop closes every connection the peer holds.
func (p *peer) drop() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for c := range p.conns {
		c.Close()
	}
}

var (
	peerSASLHeader = []byte{'A', 'M', 'Q', 'P', 3, 1, 0, 0}
	peerAMQPHeader = []byte{'A', 'M', 'Q', 'P', 0, 1, 0, 0}
)

func (p *peer) serve(c net.Conn) error {
	hdr := make([]byte, 8)
	if _, err := io.ReadFull(c, hdr); err != nil {
		return err
	}
	if slices.Equal(hdr, peerSASLHeader) {
		mechs := described(0x40, list8(symArray8("ANONYMOUS", "PLAIN")))
		if err := write(c, peerSASLHeader, peerFrame(1, 0, mechs)); err != nil {
			return err
		}
		_, init, err := readPeerFrame(c) // sasl-init
		if err != nil {
			return err
		}
		for _, m := range []string{"ANONYMOUS", "PLAIN"} {
			if bytes.Contains(init, []byte(m)) {
				select {
				case p.mechs <- m:
				default:
				}
			}
		}
		code := byte(0)
		if p.refuse {
			code = 1 // auth
		}
		if err := write(c, peerFrame(1, 0, described(0x44, list8([]byte{0x50, code})))); err != nil {
			return err
		}
		if p.refuse {
			_, err := io.Copy(io.Discard, c) // until the client gives up
			return err
		}
		if _, err := io.ReadFull(c, hdr); err != nil {
			return err
		}
	}
	if p.saslOnly && slices.Equal(hdr, peerAMQPHeader) {
		_ = write(c, peerSASLHeader)
		return nil
	}
	if !slices.Equal(hdr, peerAMQPHeader) {
		return fmt.Errorf("protocol header % x", hdr)
	}
	if err := write(c, peerAMQPHeader); err != nil {
		return err
	}
	credited := false
	for {
		ch, body, err := readPeerFrame(c)
		if err != nil {
			return err
		}
		if len(body) < 3 {
			continue // a heartbeat
		}
		var reply []byte
		switch body[2] {
		case 0x10: // open
			reply = described(0x10, list8(str8("peer")))
		case 0x11: // begin: ours answers the client's channel, with room to spare
			reply = described(0x11, list8(
				[]byte{0x60, byte(ch >> 8), byte(ch)}, []byte{0x43},
				binary.BigEndian.AppendUint32([]byte{0x70}, 5000), binary.BigEndian.AppendUint32([]byte{0x70}, 5000)))
		case 0x12: // attach: the client's, as the sender's
			if reply, err = senderAttach(body); err != nil {
				return err
			}
		case 0x13: // flow: the subscriber has the link (and counts it)
			if !credited {
				credited = true
				select {
				case p.attached <- struct{}{}:
				default: // 16 ahead of the test: it stopped looking
				}
			}
		case 0x16, 0x17, 0x18: // detach, end, close: the same back
			if !p.mute.Load() {
				reply = body
			}
		}
		if reply != nil {
			if err := write(c, peerFrame(0, ch, reply)); err != nil {
				return err
			}
		}
		if body[2] == 0x18 {
			return nil
		}
	}
}

// senderAttach turns a receiver's attach into the sender's answer: the
// same fields, role false.
func senderAttach(body []byte) ([]byte, error) {
	out := slices.Clone(body)
	i := 3
	switch out[i] { // the list's constructor, size and count
	case 0xc0:
		i += 3
	case 0xd0:
		i += 9
	default:
		return nil, fmt.Errorf("attach: list % x", out[i])
	}
	switch out[i] { // name
	case 0xa1:
		i += 2 + int(out[i+1])
	case 0xb1:
		i += 5 + int(binary.BigEndian.Uint32(out[i+1:]))
	default:
		return nil, fmt.Errorf("attach: name % x", out[i])
	}
	switch out[i] { // handle
	case 0x43:
		i++
	case 0x52:
		i += 2
	case 0x70:
		i += 5
	default:
		return nil, fmt.Errorf("attach: handle % x", out[i])
	}
	switch out[i] { // role
	case 0x41:
		out[i] = 0x42
	case 0x56:
		out[i+1] = 0
	default:
		return nil, fmt.Errorf("attach: role % x", out[i])
	}
	return out, nil
}

func readPeerFrame(r io.Reader) (ch uint16, body []byte, err error) {
	var h [8]byte
	if _, err := io.ReadFull(r, h[:]); err != nil {
		return 0, nil, err
	}
	size, doff := int(binary.BigEndian.Uint32(h[:])), 4*int(h[4])
	if size < doff || doff < 8 {
		return 0, nil, fmt.Errorf("frame header % x", h)
	}
	rest := make([]byte, size-8)
	if _, err := io.ReadFull(r, rest); err != nil {
		return 0, nil, err
	}
	return binary.BigEndian.Uint16(h[6:]), rest[doff-8:], nil
}

func peerFrame(typ byte, ch uint16, body []byte) []byte {
	b := binary.BigEndian.AppendUint32(nil, uint32(8+len(body)))
	b = append(b, 2, typ)
	b = binary.BigEndian.AppendUint16(b, ch)
	return append(b, body...)
}

func write(w io.Writer, bs ...[]byte) error {
	_, err := w.Write(slices.Concat(bs...))
	return err
}

func described(code byte, value []byte) []byte { return append([]byte{0x00, 0x53, code}, value...) }

func list8(fields ...[]byte) []byte {
	body := slices.Concat(fields...)
	return append([]byte{0xc0, byte(1 + len(body)), byte(len(fields))}, body...)
}

func str8(s string) []byte { return append([]byte{0xa1, byte(len(s))}, s...) }

func symArray8(syms ...string) []byte {
	els := []byte{0xa3}
	for _, s := range syms {
		els = append(els, byte(len(s)))
		els = append(els, s...)
	}
	return append([]byte{0xe0, byte(1 + len(els)), byte(len(syms))}, els...)
}
