package wire_test

import (
	"bytes"
	"encoding/binary"
	"errors"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"sync"
	"syscall"
	"testing"
	"testing/synctest"
	"time"

	"go.uber.org/goleak"

	"github.com/amqpsub/amqpsub/internal/wire"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// tcpPair returns both ends of a TCP connection over 127.0.0.1, closed when
// the test ends.
func tcpPair(t testing.TB) (client, server *net.TCPConn) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	accepted := make(chan net.Conn, 1)
	go func() {
		c, _ := ln.Accept()
		accepted <- c
	}()
	c, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	s := <-accepted
	if s == nil {
		t.Fatal("accept failed")
	}
	t.Cleanup(func() { c.Close(); s.Close() })
	return c.(*net.TCPConn), s.(*net.TCPConn)
}

// readAll reads r to EOF in a goroutine; the result arrives on the channel.
func readAll(r io.Reader) <-chan []byte {
	out := make(chan []byte, 1)
	go func() {
		b, _ := io.ReadAll(r)
		out <- b
	}()
	return out
}

func assertTimeout(t *testing.T, err error) {
	t.Helper()
	var ne net.Error
	if !errors.Is(err, os.ErrDeadlineExceeded) || !errors.As(err, &ne) || !ne.Timeout() {
		t.Fatalf("err = %v, want a timeout satisfying os.ErrDeadlineExceeded", err)
	}
}

func TestSerialWritesArriveInOrderByteExact(t *testing.T) {
	for _, tc := range []struct {
		name string
		pair func(t *testing.T) (net.Conn, net.Conn)
	}{
		{"tcp", func(t *testing.T) (net.Conn, net.Conn) { c, s := tcpPair(t); return c, s }},
		{"pipe", func(*testing.T) (net.Conn, net.Conn) { c, s := net.Pipe(); return c, s }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			client, server := tc.pair(t)
			c := wire.New(client, nil, wire.Options{MaxQueued: 4096})
			got := readAll(server)
			rng := rand.New(rand.NewPCG(1, 2))
			var want bytes.Buffer
			for range 5000 {
				p := make([]byte, 1+rng.IntN(300))
				for i := range p {
					p[i] = byte(rng.Uint32())
				}
				want.Write(p)
				if n, err := c.Write(p); n != len(p) || err != nil {
					t.Fatalf("Write = %d, %v", n, err)
				}
				clear(p) // Write must have copied p
			}
			if err := c.Close(); err != nil {
				t.Fatalf("Close = %v", err)
			}
			if b := <-got; !bytes.Equal(b, want.Bytes()) {
				t.Fatalf("peer read %d bytes, not the %d written in order", len(b), want.Len())
			}
			st := c.Stats()
			if st.Writes != 5000 || st.Bytes != uint64(want.Len()) || st.Flushes == 0 || st.Flushes > st.Writes {
				t.Fatalf("stats %+v", st)
			}
		})
	}
}

// Records of concurrent writers arrive whole, each writer's in its order.
func TestConcurrentWritesArriveWholeAndInOrder(t *testing.T) {
	const writers, records = 8, 2000
	client, server := tcpPair(t)
	c := wire.New(client, nil, wire.Options{MaxQueued: 8192})
	got := readAll(server)
	var wg sync.WaitGroup
	for w := range writers {
		wg.Go(func() {
			rng := rand.New(rand.NewPCG(uint64(w), 7))
			for seq := range records {
				n := rng.IntN(200)
				rec := make([]byte, 8+n)
				rec[0] = byte(w)
				binary.BigEndian.PutUint32(rec[1:], uint32(seq))
				binary.BigEndian.PutUint16(rec[5:], uint16(n))
				for i := 8; i < len(rec); i++ {
					rec[i] = byte(w) ^ byte(seq) ^ byte(i)
				}
				if _, err := c.Write(rec); err != nil {
					t.Errorf("Write: %v", err)
					return
				}
			}
		})
	}
	wg.Wait()
	if err := c.Close(); err != nil {
		t.Fatal(err)
	}
	b := <-got
	next := make([]uint32, writers)
	for len(b) > 0 {
		if len(b) < 8 {
			t.Fatalf("%d stray bytes", len(b))
		}
		w, seq, n := b[0], binary.BigEndian.Uint32(b[1:]), int(binary.BigEndian.Uint16(b[5:]))
		if int(w) >= writers || seq != next[w] || len(b) < 8+n {
			t.Fatalf("record writer %d seq %d len %d, want seq %d", w, seq, n, next[w])
		}
		for i := 8; i < 8+n; i++ {
			if b[i] != w^byte(seq)^byte(i) {
				t.Fatalf("record writer %d seq %d corrupt at %d", w, seq, i)
			}
		}
		next[w]++
		b = b[8+n:]
	}
	for w, n := range next {
		if n != records {
			t.Fatalf("writer %d: %d records arrived, want %d", w, n, records)
		}
	}
}

// While a syscall is in progress later Writes accumulate and go out
// together in the next one; an idle Write goes out at once, with no timer
// (the bubble's clock never moves).
func TestCoalescesWhileASyscallIsInProgress(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		client, server := net.Pipe()
		c := wire.New(client, nil, wire.Options{})
		start := time.Now()
		frame := bytes.Repeat([]byte{0xab}, 40)

		c.Write(frame) // the flusher takes it and blocks: nobody reads the pipe yet
		synctest.Wait()
		for range 9 {
			c.Write(frame)
		}
		synctest.Wait()
		buf := make([]byte, 1000)
		if n, _ := io.ReadFull(server, buf[:40]); n != 40 {
			t.Fatal("first frame not written alone")
		}
		if n, _ := io.ReadFull(server, buf[:360]); n != 360 {
			t.Fatal("the other nine not written")
		}
		synctest.Wait()
		if st := c.Stats(); st.Writes != 10 || st.Flushes != 2 || st.Bytes != 400 {
			t.Fatalf("stats %+v, want 10 writes in 2 flushes", st)
		}

		// Idle again: one Write goes out by itself, at once.
		c.Write(frame)
		if n, _ := io.ReadFull(server, buf[:40]); n != 40 {
			t.Fatal("idle frame not written")
		}
		if d := time.Since(start); d != 0 {
			t.Fatalf("the clock moved %v: a timer was involved", d)
		}
		if err := c.Close(); err != nil {
			t.Fatal(err)
		}
	})
}

func TestIdleWriteGoesOutAtOnceOverTCP(t *testing.T) {
	client, server := tcpPair(t)
	c := wire.New(client, nil, wire.Options{})
	defer c.Close()
	if _, err := c.Write([]byte("ping")); err != nil {
		t.Fatal(err)
	}
	// The connection stays open: the bytes can only arrive if the Write
	// itself made them go out.
	server.SetReadDeadline(time.Now().Add(10 * time.Second))
	buf := make([]byte, 4)
	if _, err := io.ReadFull(server, buf); err != nil || string(buf) != "ping" {
		t.Fatalf("read %q, %v", buf, err)
	}
}

// Coalescing over a real socket: the peer reads slowly, so Writes pile up
// behind each syscall.
func TestCoalescesOverTCPWithASlowReader(t *testing.T) {
	client, server := tcpPair(t)
	c := wire.New(client, nil, wire.Options{MaxQueued: 64 << 10})
	done := make(chan int64, 1)
	go func() {
		var n int64
		buf := make([]byte, 512) // small reads: the peer is the bottleneck
		for {
			m, err := server.Read(buf)
			n += int64(m)
			if err != nil {
				done <- n
				return
			}
		}
	}()
	frame := make([]byte, 40)
	for range 20000 {
		if _, err := c.Write(frame); err != nil {
			t.Fatal(err)
		}
	}
	if err := c.Close(); err != nil {
		t.Fatal(err)
	}
	if n := <-done; n != 40*20000 {
		t.Fatalf("peer read %d bytes", n)
	}
	st := c.Stats()
	if st.Flushes >= st.Writes {
		t.Fatalf("no coalescing: %+v", st)
	}
	t.Logf("%d writes in %d flushes (%.1f per flush)", st.Writes, st.Flushes, float64(st.Writes)/float64(st.Flushes))
}

// A Write that has to wait for room gives up at the write deadline; the
// flush, under the same deadline, fails too and closes the connection, so a
// blocked Read returns and later Writes return the error.
func TestWriteWaitingForRoomTimesOutAtTheDeadline(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		client, server := net.Pipe() // nobody reads server
		defer server.Close()
		c := wire.New(client, nil, wire.Options{MaxQueued: 64})
		readErr := make(chan error, 1)
		go func() {
			_, err := c.Read(make([]byte, 1))
			readErr <- err
		}()
		start := time.Now()
		c.SetWriteDeadline(start.Add(5 * time.Second))
		if _, err := c.Write(make([]byte, 64)); err != nil { // accepted: the queue was empty
			t.Fatal(err)
		}
		_, err := c.Write(make([]byte, 1)) // 65 > 64: waits
		if d := time.Since(start); d != 5*time.Second {
			t.Fatalf("Write returned after %v, want 5s", d)
		}
		assertTimeout(t, err)

		synctest.Wait()
		select {
		case err := <-readErr:
			if err == nil {
				t.Fatal("Read succeeded")
			}
		default:
			t.Fatal("a Read is still blocked after the write error")
		}
		_, err = c.Write([]byte{1})
		assertTimeout(t, err) // the flush's error, from now on
		c.SetWriteDeadline(time.Time{})
		_, err = c.Write([]byte{1})
		assertTimeout(t, err) // sticky even with no deadline
		if err := c.Close(); !errors.Is(err, os.ErrDeadlineExceeded) {
			t.Fatalf("Close = %v, want the flush's timeout", err)
		}
	})
}

// SetWriteDeadline reaches a Write already waiting, as on a socket.
func TestSetWriteDeadlineReleasesAWaitingWrite(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		client, server := net.Pipe()
		defer server.Close()
		c := wire.New(client, nil, wire.Options{MaxQueued: 10})
		defer c.Abort()
		c.Write(make([]byte, 10))
		res := make(chan error, 1)
		go func() {
			_, err := c.Write(make([]byte, 10))
			res <- err
		}()
		synctest.Wait()
		select {
		case err := <-res:
			t.Fatalf("Write returned %v with no room and no deadline", err)
		default:
		}
		c.SetWriteDeadline(time.Now().Add(time.Second))
		assertTimeout(t, <-res)
		if _, err := c.Write([]byte{1}); err == nil { // the deadline is still in force
			t.Fatal("Write succeeded past its deadline")
		}
	})
}

// A waiting Write goes on as soon as the flusher frees room.
func TestWriteWaitsForRoomThenProceeds(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		client, server := net.Pipe()
		c := wire.New(client, nil, wire.Options{MaxQueued: 10})
		got := readAll(server)
		var waits int
		wire.SetWaitHook(c, func() { waits++ })
		for i := range 5 {
			if _, err := c.Write(bytes.Repeat([]byte{byte(i)}, 8)); err != nil {
				t.Fatal(err)
			}
		}
		if err := c.Close(); err != nil {
			t.Fatal(err)
		}
		if b := <-got; len(b) != 40 {
			t.Fatalf("peer read %d bytes", len(b))
		}
		if waits == 0 {
			t.Fatal("no Write waited with MaxQueued 10 and 8-byte writes")
		}
	})
}

func TestWriteWithADeadlineAlreadyPastFailsAtOnce(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		client, server := net.Pipe()
		got := readAll(server)
		c := wire.New(client, nil, wire.Options{})
		c.SetWriteDeadline(time.Now().Add(-time.Second))
		_, err := c.Write([]byte("x"))
		assertTimeout(t, err)
		// Nothing was queued and the connection is still usable, as a
		// socket is once the deadline is extended.
		c.SetWriteDeadline(time.Time{})
		if _, err := c.Write([]byte("y")); err != nil {
			t.Fatal(err)
		}
		if err := c.Close(); err != nil {
			t.Fatal(err)
		}
		if b := <-got; string(b) != "y" {
			t.Fatalf("peer read %q", b)
		}
	})
}

func TestWriteErrorIsStickyAndClosesTheConnection(t *testing.T) {
	client, server := tcpPair(t)
	c := wire.New(client, nil, wire.Options{})
	readErr := make(chan error, 1)
	go func() {
		_, err := c.Read(make([]byte, 1))
		readErr <- err
	}()
	server.SetLinger(0)
	server.Close() // a reset: the client's writes fail
	var first error
	for i := 0; first == nil; i++ {
		if i == 100000 {
			t.Fatal("no write error after a reset")
		}
		_, first = c.Write(make([]byte, 1024))
	}
	if !errors.Is(first, syscall.ECONNRESET) && !errors.Is(first, syscall.EPIPE) {
		t.Fatalf("first error %v, want the socket's", first)
	}
	for range 3 {
		if _, err := c.Write([]byte{1}); err != first {
			t.Fatalf("later Write = %v, want %v", err, first)
		}
	}
	if err := <-readErr; err == nil {
		t.Fatal("Read succeeded")
	}
	if _, err := client.Write([]byte{1}); !errors.Is(err, net.ErrClosed) {
		t.Fatalf("the socket is not closed: Write = %v", err)
	}
	if err := c.Close(); err != first {
		t.Fatalf("Close = %v, want %v", err, first)
	}
}

func TestCloseFlushesWhatIsQueued(t *testing.T) {
	client, server := tcpPair(t)
	c := wire.New(client, nil, wire.Options{})
	got := readAll(server)
	want := bytes.Repeat([]byte("0123456789"), 100000)
	for p := want; len(p) > 0; p = p[1000:] {
		c.Write(p[:1000])
	}
	if err := c.Close(); err != nil {
		t.Fatal(err)
	}
	if b := <-got; !bytes.Equal(b, want) {
		t.Fatalf("peer read %d bytes of %d", len(b), len(want))
	}
	if _, err := c.Write([]byte{1}); !errors.Is(err, net.ErrClosed) {
		t.Fatalf("Write after Close = %v", err)
	}
}

// A peer that never reads: a Write waiting for room, the flush, a Read and
// then a Close (which waits for the flush, here with no write deadline) all
// stay blocked until Abort, which releases them at once.
func TestAbortReleasesEverythingStuckOnAPeerThatNeverReads(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		client, server := net.Pipe()
		defer server.Close()
		c := wire.New(client, nil, wire.Options{MaxQueued: 100})
		start := time.Now()
		c.Write(make([]byte, 100))
		writeErr, readErr, closeErr := make(chan error, 1), make(chan error, 1), make(chan error, 1)
		go func() { _, err := c.Write(make([]byte, 100)); writeErr <- err }()
		go func() { _, err := c.Read(make([]byte, 1)); readErr <- err }()
		synctest.Wait()
		select {
		case <-writeErr:
			t.Fatal("Write returned with no room")
		case <-readErr:
			t.Fatal("Read returned")
		default:
		}

		go func() { closeErr <- c.Close() }()
		synctest.Wait()
		// Close refuses what was not queued and waits for the flush.
		if err := <-writeErr; !errors.Is(err, net.ErrClosed) {
			t.Fatalf("waiting Write = %v after Close, want net.ErrClosed", err)
		}
		select {
		case <-readErr:
			t.Fatal("Read returned before Abort")
		case <-closeErr:
			t.Fatal("Close returned before Abort")
		default:
		}

		if err := c.Abort(); err != nil {
			t.Fatalf("Abort = %v", err)
		}
		if err := <-readErr; err == nil {
			t.Fatal("Read succeeded")
		}
		if err := <-closeErr; !errors.Is(err, wire.ErrAborted) || !errors.Is(err, net.ErrClosed) {
			t.Fatalf("Close = %v, want ErrAborted", err)
		}
		if d := time.Since(start); d != 0 {
			t.Fatalf("took %v", d)
		}
		if _, err := c.Write([]byte{1}); !errors.Is(err, wire.ErrAborted) {
			t.Fatalf("Write after Abort = %v", err)
		}
	})
}

// Abort alone releases a Write waiting for room.
func TestAbortReleasesAWaitingWrite(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		client, server := net.Pipe()
		defer server.Close()
		c := wire.New(client, nil, wire.Options{MaxQueued: 1})
		c.Write([]byte{1})
		writeErr := make(chan error, 1)
		go func() { _, err := c.Write([]byte{2}); writeErr <- err }()
		synctest.Wait()
		c.Abort()
		if err := <-writeErr; !errors.Is(err, wire.ErrAborted) {
			t.Fatalf("Write = %v, want ErrAborted", err)
		}
	})
}

func TestCloseAndAbortAreIdempotentFromAnyGoroutine(t *testing.T) {
	client, server := tcpPair(t)
	got := readAll(server)
	c := wire.New(client, nil, wire.Options{})
	c.Write([]byte("bye"))
	var wg sync.WaitGroup
	errs := make([]error, 8)
	for i := range errs {
		wg.Go(func() { errs[i] = c.Close() })
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Fatalf("Close #%d = %v", i, err)
		}
	}
	for range 3 {
		if err := c.Abort(); err != nil {
			t.Fatalf("Abort after Close = %v", err)
		}
	}
	if err := c.Close(); err != nil {
		t.Fatalf("Close after Abort = %v: the first call's value is kept", err)
	}
	if b := <-got; string(b) != "bye" {
		t.Fatalf("peer read %q", b)
	}

	client2, _ := tcpPair(t)
	c2 := wire.New(client2, nil, wire.Options{})
	for i := range errs {
		wg.Go(func() { errs[i] = c2.Abort() })
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Fatalf("Abort #%d = %v", i, err)
		}
	}
	if err := c2.Close(); !errors.Is(err, wire.ErrAborted) {
		t.Fatalf("Close after Abort = %v", err)
	}
}

func TestAWriteLargerThanMaxQueuedIsAcceptedWhenNothingIsUnwritten(t *testing.T) {
	client, server := tcpPair(t)
	got := readAll(server)
	c := wire.New(client, nil, wire.Options{MaxQueued: 16})
	big := bytes.Repeat([]byte{7}, 1000)
	for range 3 {
		if n, err := c.Write(big); n != len(big) || err != nil {
			t.Fatalf("Write = %d, %v", n, err)
		}
	}
	if n, err := c.Write(nil); n != 0 || err != nil {
		t.Fatalf("empty Write = %d, %v", n, err)
	}
	if err := c.Close(); err != nil {
		t.Fatal(err)
	}
	if b := <-got; len(b) != 3000 {
		t.Fatalf("peer read %d bytes", len(b))
	}
	if st := c.Stats(); st.Writes != 3 {
		t.Fatalf("stats %+v: the empty Write counted", st)
	}
}

func TestOptions(t *testing.T) {
	if err := (wire.Options{}).Validate(); err != nil {
		t.Fatal(err)
	}
	if err := (wire.Options{MaxQueued: 1}).Validate(); err != nil {
		t.Fatal(err)
	}
	err := (wire.Options{MaxQueued: -1}).Validate()
	if !errors.Is(err, wire.ErrInvalidOption) {
		t.Fatalf("Validate = %v, want ErrInvalidOption", err)
	}
	defer func() {
		if r := recover(); r == nil {
			t.Fatal("New accepted MaxQueued -1")
		}
	}()
	a, b := net.Pipe()
	defer a.Close()
	defer b.Close()
	wire.New(a, nil, wire.Options{MaxQueued: -1})
}

// Deadlines and addresses pass through to the connection.
func TestPassThrough(t *testing.T) {
	client, server := tcpPair(t)
	c := wire.New(client, nil, wire.Options{})
	defer c.Close()
	if c.LocalAddr().String() != client.LocalAddr().String() || c.RemoteAddr().String() != server.LocalAddr().String() {
		t.Fatalf("addresses %v %v", c.LocalAddr(), c.RemoteAddr())
	}
	if err := c.SetReadDeadline(time.Now().Add(-time.Second)); err != nil {
		t.Fatal(err)
	}
	_, err := c.Read(make([]byte, 1))
	assertTimeout(t, err)
	if err := c.SetDeadline(time.Now().Add(-time.Second)); err != nil {
		t.Fatal(err)
	}
	_, err = c.Write([]byte{1})
	assertTimeout(t, err)
	_, err = c.Read(make([]byte, 1))
	assertTimeout(t, err)
}
