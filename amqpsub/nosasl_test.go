package amqpsub_test

import (
	"context"
	"io"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/Azure/go-amqp"

	"github.com/amqpsub/amqpsub/amqpsub"
)

// noSASLPeer answers like a broker without a SASL layer: to a SASL header
// it sends its AMQP header and closes. It reports each protocol id sent.
func noSASLPeer(t *testing.T) (addr string, ids <-chan byte) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ch := make(chan byte, 16)
	var wg sync.WaitGroup
	t.Cleanup(func() {
		ln.Close()
		wg.Wait()
	})
	wg.Go(func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			hdr := make([]byte, 8)
			if _, err := io.ReadFull(c, hdr); err == nil {
				select {
				case ch <- hdr[4]:
				default:
				}
				_, _ = c.Write([]byte{'A', 'M', 'Q', 'P', 0, 1, 0, 0})
			}
			c.Close()
		}
	})
	return ln.Addr().String(), ch
}

// Dial offers SASL ANONYMOUS by default; a broker without a SASL layer
// answers with its AMQP header, and the error says to use NoSASL, with
// which Dial connects without SASL.
func TestDialNoSASL(t *testing.T) {
	addr, ids := noSASLPeer(t)
	s, err := amqpsub.New(amqpsub.Dial("amqp://"+addr, nil), "q", nop, amqpsub.DialTimeout(2*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	err = s.Run(ctx)
	if id := <-ids; id != 3 || err == nil || !strings.Contains(err.Error(), "amqpsub.NoSASL()") {
		t.Fatalf("protocol id %d, Run = %v; want SASL offered, and an error naming NoSASL", id, err)
	}
	s, err = amqpsub.New(amqpsub.Dial("amqp://"+addr, &amqp.ConnOptions{SASLType: amqpsub.NoSASL()}), "q", nop,
		amqpsub.DialTimeout(2*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	_ = s.Run(ctx) // the peer closes after its header: what counts is what was sent
	if id := <-ids; id != 0 {
		t.Fatalf("with NoSASL: protocol id %d sent, want 0 (AMQP, no SASL)", id)
	}
}

// Shutdown while the first connection is still being made (a broker that
// takes the TCP connection but has not answered yet) returns at once under
// RabbitMQ4 as under RabbitMQ3: there is no link, so nothing to finish,
// though the queue's type is not known (and counts as quorum).
func TestShutdownWhileConnecting(t *testing.T) {
	addr, accepted := silentBroker(t)
	const grace = time.Minute
	for _, p := range []amqpsub.Profile{amqpsub.RabbitMQ3, amqpsub.RabbitMQ4} {
		s, err := amqpsub.New(amqpsub.Dial("amqp://"+addr, nil), "q", nop, amqpsub.WithProfile(p),
			amqpsub.DialTimeout(2*grace), amqpsub.GracePeriod(grace))
		if err != nil {
			t.Fatal(err)
		}
		ran := make(chan error, 1)
		go func() { ran <- s.Run(context.Background()) }()
		<-accepted // Run is connecting
		began := time.Now()
		_ = s.Shutdown(context.Background())
		err = <-ran
		took := time.Since(began)
		t.Logf("%v: Shutdown while connecting took %v (Run = %v)", p, took, err)
		// Waiting for a Hold that no link can end took grace/2 (30 s);
		// the bound leaves room for a loaded machine.
		if took > grace/6 {
			t.Errorf("%v: Shutdown while connecting took %v; want it at once, far below half the grace period (%v)", p, took, grace/2)
		}
	}
}

// NoSASL with credentials in the URL: the credentials choose SASL PLAIN
// (as they always did), and a broker without SASL gets an error that says
// to take them out of the URL.
func TestNoSASLWithCredentials(t *testing.T) {
	addr, ids := noSASLPeer(t)
	s, err := amqpsub.New(amqpsub.Dial("amqp://guest:guest@"+addr, &amqp.ConnOptions{SASLType: amqpsub.NoSASL()}), "q", nop,
		amqpsub.DialTimeout(2*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	err = s.Run(ctx)
	if id := <-ids; id != 3 || err == nil || !strings.Contains(err.Error(), "take the credentials out of the URL") {
		t.Fatalf("protocol id %d, Run = %v; want SASL (PLAIN), and an error saying to take the credentials out", id, err)
	}
}
