package amqpsub_test

import (
	"context"
	"errors"
	"net"
	"testing"
	"time"

	"github.com/amqpsub/amqpsub/amqpsub"
)

// A broker that accepts the TCP connection but never answers: Run gives up
// at DialTimeout, with an error that says so.
func TestDialTimeoutBoundsASilentBroker(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			defer c.Close() // hold it open, say nothing
		}
	}()
	s, _ := amqpsub.New(amqpsub.Dial("amqp://"+ln.Addr().String(), nil), "q",
		amqpsub.HandlerFunc(func(context.Context, *amqpsub.Delivery) error { return nil }),
		amqpsub.DialTimeout(200*time.Millisecond))
	start := time.Now()
	err = s.Run(context.Background())
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Run = %v, want DeadlineExceeded", err)
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Fatalf("Run took %v with DialTimeout(200ms)", d)
	}
}
