package amqpsub_test

import (
	"context"
	"errors"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/amqpsub/amqpsub/amqpsub"
)

// silentBroker accepts TCP connections on 127.0.0.1, holds them open and
// says nothing, until the test ends; each one is also sent on accepted
// (when there is room).
func silentBroker(t *testing.T) (addr string, accepted <-chan net.Conn) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ch := make(chan net.Conn, 16)
	var mu sync.Mutex
	var conns []net.Conn
	var wg sync.WaitGroup
	wg.Go(func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns = append(conns, c)
			mu.Unlock()
			select {
			case ch <- c:
			default:
			}
		}
	})
	t.Cleanup(func() {
		ln.Close()
		wg.Wait()
		for _, c := range conns {
			c.Close()
		}
	})
	return ln.Addr().String(), ch
}

// A broker that accepts the TCP connection but never answers: Run gives up
// at DialTimeout, with an error that says so.
func TestDialTimeoutBoundsASilentBroker(t *testing.T) {
	addr, _ := silentBroker(t)
	s, _ := amqpsub.New(amqpsub.Dial("amqp://"+addr, nil), "q",
		amqpsub.HandlerFunc(func(context.Context, *amqpsub.Delivery) error { return nil }),
		amqpsub.DialTimeout(200*time.Millisecond))
	start := time.Now()
	err := s.Run(context.Background())
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Run = %v, want DeadlineExceeded", err)
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Fatalf("Run took %v with DialTimeout(200ms)", d)
	}
}
