package wire_test

import (
	"crypto/tls"
	"io"
	"net"
	"testing"

	"github.com/Azure/go-amqp"

	"github.com/amqpsub/amqpsub/internal/wire"
)

// The peer answers the client's close with its own, as a broker does, before
// waiting for EOF.
func TestGoAMQPOverTLS(t *testing.T) {
	cert, pool := selfSigned(t)
	srvConf := &tls.Config{Certificates: []tls.Certificate{cert}}
	addr, peerErr := serve(t, func(c net.Conn) net.Conn { return tls.Server(c, srvConf) }, func(p peer) error {
		if err := p.openConn(0); err != nil {
			return err
		}
		if _, err := p.expectFrame(typeAMQP, 0x18); err != nil {
			return err
		}
		if err := p.write(frame(typeAMQP, described(0x18, list8()))); err != nil {
			return err
		}
		_, err := io.Copy(io.Discard, p.c)
		return err
	})
	ctx := testCtx(t)
	w, _ := dialTLS(t, ctx, addr, pool, wire.Options{})
	conn, err := amqp.NewConn(ctx, w, &amqp.ConnOptions{SASLType: amqp.SASLTypeAnonymous()})
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
}
