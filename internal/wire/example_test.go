package wire_test

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"time"

	"github.com/Azure/go-amqp"

	"github.com/amqpsub/amqpsub/internal/wire"
)

// Write queues and returns; Close writes what is queued, then closes.
func ExampleNew() {
	client, server := net.Pipe()
	c := wire.New(client, nil, wire.Options{})
	go func() {
		c.Write([]byte("AMQP"))
		c.Write([]byte{3, 1, 0, 0})
		c.Close()
	}()
	b, _ := io.ReadAll(server)
	fmt.Printf("%q\n", b)
	// Output: "AMQP\x03\x01\x00\x00"
}

// The dialer's layering: raw TCP, then TLS, then the wire.Conn that go-amqp
// writes through; a refused SASL outcome becomes a *wire.SASLError; and a
// close that cannot finish within a bound is cut short by Abort.
func Example_dialer() {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	raw, err := (&net.Dialer{}).DialContext(ctx, "tcp", "broker.example:5671")
	if err != nil {
		return
	}
	tc := tls.Client(raw, &tls.Config{ServerName: "broker.example"})
	if err := tc.HandshakeContext(ctx); err != nil {
		raw.Close()
		return
	}
	w := wire.New(tc, raw, wire.Options{})
	conn, err := amqp.NewConn(ctx, w, &amqp.ConnOptions{
		HostName: "broker.example",             // amqp.Dial fills it from the URL; NewConn does not
		SASLType: amqp.SASLTypePlain("u", "p"), // nor the SASL type
		// No TLSConfig: the TLS layer is already under w.
	})
	if err != nil {
		var se *wire.SASLError
		if errors.As(wire.HandshakeError(w, err), &se) && se.Code == wire.SASLAuth {
			fmt.Println("credentials refused")
		}
		return
	}

	// A bounded close: go-amqp's Close waits for its close frame to be
	// written, for up to its write timeout (30 s by default).
	closed := make(chan error, 1)
	go func() { closed <- conn.Close() }()
	select {
	case <-closed:
	case <-time.After(5 * time.Second):
		w.Abort()
		<-closed
	}
}
