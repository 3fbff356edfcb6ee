package wire_test

import (
	"errors"
	"net"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"go.uber.org/goleak"

	"github.com/amqpsub/amqpsub/internal/wire"
)

// stuckConn's Write blocks until Close and ignores deadlines, so only the
// wire.Conn's own timer can release a Write waiting for room.
type stuckConn struct {
	streamConn
	closed chan struct{}
}

func (s *stuckConn) Write(p []byte) (int, error) { <-s.closed; return 0, net.ErrClosed }
func (s *stuckConn) Close() error                { close(s.closed); return nil }

func TestSetWriteDeadlineReleasesAWaitingWriteByItself(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		c := wire.New(&stuckConn{closed: make(chan struct{})}, nil, wire.Options{MaxQueued: 10})
		defer c.Abort()
		c.Write(make([]byte, 10)) // the flusher blocks on it for good
		res := make(chan error, 1)
		go func() {
			_, err := c.Write(make([]byte, 10))
			res <- err
		}()
		synctest.Wait()
		start := time.Now()
		c.SetWriteDeadline(start.Add(time.Second))
		assertTimeout(t, <-res)
		if d := time.Since(start); d != time.Second {
			t.Fatalf("the waiting Write returned after %v, want 1s", d)
		}
	})
}

func TestAbortReleasesAStuckFlushOverTCP(t *testing.T) {
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
	client, server := tcpPair(t)
	client.SetWriteBuffer(4096)
	server.SetReadBuffer(4096)
	c := wire.New(client, nil, wire.Options{MaxQueued: 32 << 10})
	waiting := make(chan struct{})
	var once sync.Once
	wire.SetWaitHook(c, func() { once.Do(func() { close(waiting) }) })
	writeErr := make(chan error, 1)
	go func() {
		p := make([]byte, 8<<10)
		for {
			if _, err := c.Write(p); err != nil {
				writeErr <- err
				return
			}
		}
	}()
	<-waiting // MaxQueued bytes are unwritten: the flusher is blocked in write(2)
	if err := c.Abort(); err != nil {
		t.Fatal(err)
	}
	if _, err := client.Write([]byte{1}); !errors.Is(err, net.ErrClosed) {
		t.Fatalf("Abort left the socket open: Write = %v", err)
	}
	if err := <-writeErr; !errors.Is(err, wire.ErrAborted) {
		t.Fatalf("Write = %v", err)
	}
	if err := c.Close(); !errors.Is(err, wire.ErrAborted) {
		t.Fatalf("Close = %v", err)
	}
}
