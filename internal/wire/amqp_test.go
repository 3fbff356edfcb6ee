package wire_test

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"math/big"
	"net"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/Azure/go-amqp"

	"github.com/amqpsub/amqpsub/internal/wire"
)

// peer scripts the broker's end of a connection with raw frames.
type peer struct{ c net.Conn }

func (p peer) expect(want []byte) error {
	got := make([]byte, len(want))
	if _, err := io.ReadFull(p.c, got); err != nil {
		return fmt.Errorf("peer: reading %q: %w", want, err)
	}
	if !bytes.Equal(got, want) {
		return fmt.Errorf("peer: read %q, want %q", got, want)
	}
	return nil
}

// readFrame returns the next frame's type and body (after the header).
func (p peer) readFrame() (typ byte, body []byte, err error) {
	var h [8]byte
	if _, err := io.ReadFull(p.c, h[:]); err != nil {
		return 0, nil, fmt.Errorf("peer: reading a frame: %w", err)
	}
	size, doff := int(h[0])<<24|int(h[1])<<16|int(h[2])<<8|int(h[3]), 4*int(h[4])
	rest := make([]byte, size-8)
	if _, err := io.ReadFull(p.c, rest); err != nil {
		return 0, nil, fmt.Errorf("peer: reading a frame: %w", err)
	}
	return h[5], rest[doff-8:], nil
}

// expectFrame reads the next non-empty frame and checks its performative.
func (p peer) expectFrame(typ, code byte) ([]byte, error) {
	for {
		gotTyp, body, err := p.readFrame()
		if err != nil {
			return nil, err
		}
		if len(body) == 0 {
			continue // a heartbeat
		}
		if gotTyp != typ || len(body) < 3 || body[2] != code {
			return nil, fmt.Errorf("peer: frame type %d % x, want type %d performative %#x", gotTyp, body, typ, code)
		}
		return body, nil
	}
}

func (p peer) write(bs ...[]byte) error {
	for _, b := range bs {
		if _, err := p.c.Write(b); err != nil {
			return fmt.Errorf("peer: %w", err)
		}
	}
	return nil
}

// sasl runs the SASL layer: headers, mechanisms, the client's init for
// mech, then outcomeFrame.
func (p peer) sasl(mechs []string, mech string, outcomeFrame []byte) error {
	if err := p.expect(saslHeader); err != nil {
		return err
	}
	if err := p.write(saslHeader, mechanisms(mechs...)); err != nil {
		return err
	}
	body, err := p.expectFrame(typeSASL, 0x41)
	if err != nil {
		return err
	}
	if !bytes.Contains(body, sym8(mech)) {
		return fmt.Errorf("peer: sasl-init % x does not name %s", body, mech)
	}
	return p.write(outcomeFrame)
}

// openConn runs SASL ANONYMOUS with an ok outcome, then the AMQP headers
// and open frames, advertising idleMS.
func (p peer) openConn(idleMS uint32) error {
	if err := p.sasl([]string{"ANONYMOUS", "PLAIN"}, "ANONYMOUS", outcome(wire.SASLOK)); err != nil {
		return err
	}
	if err := p.expect(amqpHeader); err != nil {
		return err
	}
	if err := p.write(amqpHeader); err != nil {
		return err
	}
	if _, err := p.expectFrame(typeAMQP, 0x10); err != nil {
		return err
	}
	return p.write(open(idleMS))
}

// expectCloseAndEOF reads the client's close frame, then waits for the
// connection to end.
func (p peer) expectCloseAndEOF() error {
	if _, err := p.expectFrame(typeAMQP, 0x18); err != nil {
		return err
	}
	if n, err := io.Copy(io.Discard, p.c); err != nil || n != 0 {
		return fmt.Errorf("peer: after close: %d bytes, %v", n, err)
	}
	return nil
}

// serve accepts one connection on 127.0.0.1 and runs script on it; the
// script's error arrives on the channel.
func serve(t *testing.T, wrap func(net.Conn) net.Conn, script func(peer) error) (addr string, errc <-chan error) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	out := make(chan error, 1)
	go func() {
		defer ln.Close()
		c, err := ln.Accept()
		if err != nil {
			out <- err
			return
		}
		defer c.Close()
		if wrap != nil {
			c = wrap(c)
		}
		out <- script(peer{c})
	}()
	return ln.Addr().String(), out
}

func dialWire(t *testing.T, addr string) *wire.Conn {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	return wire.New(c, nil, wire.Options{})
}

func testCtx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	t.Cleanup(cancel)
	return ctx
}

func TestGoAMQPOpensAndClosesOverTheWrapper(t *testing.T) {
	addr, peerErr := serve(t, nil, func(p peer) error {
		if err := p.openConn(0); err != nil {
			return err
		}
		return p.expectCloseAndEOF()
	})
	w := dialWire(t, addr)
	conn, err := amqp.NewConn(testCtx(t), w, &amqp.ConnOptions{SASLType: amqp.SASLTypeAnonymous()})
	if err != nil {
		t.Fatalf("NewConn: %v", err)
	}
	if code, seen := w.SASLOutcome(); !seen || code != wire.SASLOK {
		t.Fatalf("SASLOutcome = %d, %v", code, seen)
	}
	if err := conn.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
	if err := <-peerErr; err != nil {
		t.Fatal(err)
	}
	// Two headers, sasl-init, open, close.
	if st := w.Stats(); st.Writes != 5 || st.Flushes < 1 || st.Flushes > 5 {
		t.Fatalf("stats %+v", st)
	}
	if w.Err() != nil {
		t.Fatalf("Err = %v", w.Err())
	}
}

// go-amqp reports a refused outcome as text naming PLAIN whatever the
// mechanism; the wrapper saw the code on the wire.
func TestGoAMQPRefusedSASLOutcomeIsSeen(t *testing.T) {
	for _, tc := range []struct {
		name    string
		mechs   []string
		mech    string
		sasl    amqp.SASLType
		outcome []byte
		code    byte
	}{
		{"PLAIN auth", []string{"ANONYMOUS", "PLAIN"}, "PLAIN", amqp.SASLTypePlain("u", "wrong"), outcome(wire.SASLAuth), wire.SASLAuth},
		{"ANONYMOUS sys-perm", []string{"ANONYMOUS", "PLAIN"}, "ANONYMOUS", amqp.SASLTypeAnonymous(), outcome(wire.SASLSysPerm), wire.SASLSysPerm},
		{"EXTERNAL sys-temp", []string{"EXTERNAL"}, "EXTERNAL", amqp.SASLTypeExternal(""), outcome(wire.SASLSysTemp), wire.SASLSysTemp},
		// go-amqp fails this one ("invalid frame body header"): it parses
		// only smallulong descriptors. The wire saw the code all the same.
		{"PLAIN auth, ulong descriptor and list32", []string{"PLAIN"}, "PLAIN", amqp.SASLTypePlain("u", "p"),
			frame(typeSASL, describedULong(0x44, list32(ubyte(wire.SASLAuth), binary8([]byte("nope"))))), wire.SASLAuth},
	} {
		t.Run(tc.name, func(t *testing.T) {
			addr, peerErr := serve(t, nil, func(p peer) error {
				if err := p.sasl(tc.mechs, tc.mech, tc.outcome); err != nil {
					return err
				}
				_, err := io.Copy(io.Discard, p.c) // until the client gives up
				return err
			})
			w := dialWire(t, addr)
			_, err := amqp.NewConn(testCtx(t), w, &amqp.ConnOptions{SASLType: tc.sasl})
			if err == nil {
				t.Fatal("NewConn succeeded")
			}
			if code, seen := w.SASLOutcome(); !seen || code != tc.code {
				t.Fatalf("SASLOutcome = %d, %v, want %d", code, seen, tc.code)
			}
			var se *wire.SASLError
			if herr := wire.HandshakeError(w, err); !errors.As(herr, &se) || se.Code != tc.code || !errors.Is(herr, err) {
				t.Fatalf("HandshakeError = %v", herr)
			}
			t.Logf("go-amqp: %v", err)
			if err := <-peerErr; err != nil {
				t.Fatal(err)
			}
			w.Close() // go-amqp closed it already: a no-op
		})
	}
}

// Empty frames flow both ways through the wrapper: go-amqp's keepalives
// reach the peer, and the peer's reach go-amqp's reader, which parses the
// close after them.
func TestGoAMQPHeartbeatsFlow(t *testing.T) {
	addr, peerErr := serve(t, nil, func(p peer) error {
		if err := p.openConn(40); err != nil { // the client sends keepalives every 20 ms
			return err
		}
		for {
			_, body, err := p.readFrame()
			if err != nil {
				return err
			}
			if len(body) == 0 {
				break // a keepalive from the client
			}
		}
		if err := p.write(emptyFrame, emptyFrame, emptyFrame, closeWithError("amqp:internal-error", "bye")); err != nil {
			return err
		}
		return p.expectCloseAndEOF()
	})
	w := dialWire(t, addr)
	ctx := testCtx(t)
	conn, err := amqp.NewConn(ctx, w, &amqp.ConnOptions{SASLType: amqp.SASLTypeAnonymous()})
	if err != nil {
		t.Fatalf("NewConn: %v", err)
	}
	select {
	case <-conn.Done():
	case <-ctx.Done():
		t.Fatal("the peer's close never arrived")
	}
	var ce *amqp.ConnError
	if err := conn.Err(); !errors.As(err, &ce) || ce.RemoteErr == nil || ce.RemoteErr.Condition != "amqp:internal-error" {
		t.Fatalf("Err = %v, want the peer's close", err)
	}
	conn.Close()
	if err := <-peerErr; err != nil {
		t.Fatal(err)
	}
	if w.Stats().Writes < 5 {
		t.Fatalf("stats %+v", w.Stats())
	}
}

// flushWatch is the connection under a wire.Conn: a net.Pipe end whose
// Write reports on closeFlush when it starts writing bytes that hold an AMQP
// close frame.
type flushWatch struct {
	net.Conn
	closeFlush chan struct{}
	once       sync.Once
}

func (f *flushWatch) Write(p []byte) (int, error) {
	if bytes.Contains(p, []byte{0x00, 0x53, 0x18}) {
		f.once.Do(func() { close(f.closeFlush) })
	}
	return f.Conn.Write(p)
}

// openOverPipe opens a go-amqp connection over a net.Pipe wrapped in a
// wire.Conn; the peer stops reading once the connection is open. The
// channel is closed when the flusher starts writing go-amqp's close frame,
// a write that cannot complete since nobody reads the pipe.
func openOverPipe(t *testing.T, writeTimeout time.Duration) (*amqp.Conn, *wire.Conn, <-chan struct{}) {
	client, server := net.Pipe()
	t.Cleanup(func() { server.Close() })
	peerErr := make(chan error, 1)
	go func() { peerErr <- peer{server}.openConn(0) }()
	fw := &flushWatch{Conn: client, closeFlush: make(chan struct{})}
	w := wire.New(fw, nil, wire.Options{})
	conn, err := amqp.NewConn(testCtx(t), w, &amqp.ConnOptions{
		SASLType:     amqp.SASLTypeAnonymous(),
		WriteTimeout: writeTimeout,
	})
	if err != nil {
		t.Fatalf("NewConn: %v", err)
	}
	if err := <-peerErr; err != nil {
		t.Fatal(err)
	}
	return conn, w, fw.closeFlush
}

// go-amqp's Close queues its close frame, then closes the wrapper, whose
// flush waits for a peer that stopped reading: until Abort, or at most
// go-amqp's write timeout. (Not in a synctest bubble: go-amqp's goroutines
// meet in a sync.Once, which is not durably blocking.)
func TestGoAMQPCloseOnAPeerThatStopsReading(t *testing.T) {
	t.Run("Abort ends it", func(t *testing.T) {
		conn, w, closeFlush := openOverPipe(t, 0) // go-amqp's default: 30 s
		closed := make(chan error, 1)
		go func() { closed <- conn.Close() }()
		<-closeFlush
		select {
		case err := <-closed:
			t.Fatalf("Close returned %v while its close frame is unwritten", err)
		default:
		}
		if err := w.Abort(); err != nil {
			t.Fatal(err)
		}
		select {
		case err := <-closed:
			t.Logf("go-amqp Close: %v", err)
		case <-time.After(10 * time.Second):
			t.Fatal("Close did not return after Abort")
		}
		if !errors.Is(w.Err(), wire.ErrAborted) {
			t.Fatalf("wire Err = %v", w.Err())
		}
	})
	t.Run("bounded by the write timeout", func(t *testing.T) {
		const timeout = 100 * time.Millisecond
		conn, w, _ := openOverPipe(t, timeout)
		start := time.Now()
		err := conn.Close()
		if d := time.Since(start); d < timeout {
			t.Fatalf("Close returned after %v, before the %v write timeout", d, timeout)
		}
		if !errors.Is(w.Err(), os.ErrDeadlineExceeded) {
			t.Fatalf("wire Err = %v, want the flush's timeout", w.Err())
		}
		// go-amqp reports whichever of its reader's and writer's errors it
		// met first, as text: here the pipe's, after the flusher closed it.
		if err == nil {
			t.Fatal("go-amqp Close = nil after a failed flush")
		}
	})
}

// selfSigned returns a server certificate for 127.0.0.1 and a pool that
// trusts it.
func selfSigned(t *testing.T) (tls.Certificate, *x509.CertPool) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1),
		NotBefore:    time.Now().Add(-time.Hour),
		NotAfter:     time.Now().Add(time.Hour),
		IPAddresses:  []net.IP{net.IPv4(127, 0, 0, 1)},
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	leaf, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatal(err)
	}
	pool := x509.NewCertPool()
	pool.AddCert(leaf)
	return tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key, Leaf: leaf}, pool
}

// dialTLS layers raw TCP → *tls.Conn → wire.Conn, as the library does.
func dialTLS(t *testing.T, ctx context.Context, addr string, pool *x509.CertPool, opts wire.Options) (*wire.Conn, net.Conn) {
	t.Helper()
	raw, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	tc := tls.Client(raw, &tls.Config{RootCAs: pool, ServerName: "127.0.0.1"})
	if err := tc.HandshakeContext(ctx); err != nil {
		raw.Close()
		t.Fatal(err)
	}
	return wire.New(tc, raw, opts), raw
}

// Over TLS, Abort closes the TCP socket under a TLS write stuck on a peer
// that never reads.
func TestAbortOverTLSClosesTheSocket(t *testing.T) {
	cert, pool := selfSigned(t)
	srvConf := &tls.Config{Certificates: []tls.Certificate{cert}}
	release := make(chan struct{})
	addr, peerErr := serve(t, func(c net.Conn) net.Conn {
		c.(*net.TCPConn).SetReadBuffer(4096)
		return tls.Server(c, srvConf)
	}, func(p peer) error {
		if err := p.c.(*tls.Conn).Handshake(); err != nil {
			return err
		}
		<-release // and never read
		return nil
	})
	w, raw := dialTLS(t, testCtx(t), addr, pool, wire.Options{MaxQueued: 32 << 10})
	raw.(*net.TCPConn).SetWriteBuffer(4096)
	waiting := make(chan struct{})
	var once sync.Once
	wire.SetWaitHook(w, func() { once.Do(func() { close(waiting) }) })
	writeErr := make(chan error, 1)
	go func() {
		p := make([]byte, 8<<10)
		for {
			if _, err := w.Write(p); err != nil {
				writeErr <- err
				return
			}
		}
	}()
	<-waiting // the flusher is stuck in tls.Conn.Write
	if err := w.Abort(); err != nil {
		t.Fatal(err)
	}
	if err := <-writeErr; !errors.Is(err, wire.ErrAborted) {
		t.Fatalf("Write = %v", err)
	}
	if _, err := raw.Write([]byte{1}); !errors.Is(err, net.ErrClosed) {
		t.Fatalf("the socket is open: %v", err)
	}
	if err := w.Close(); !errors.Is(err, wire.ErrAborted) {
		t.Fatalf("Close = %v", err)
	}
	close(release)
	if err := <-peerErr; err != nil {
		t.Fatal(err)
	}
}
