package amqpsub_test

import (
	"io"
	"net"
	"testing"
	"time"

	"github.com/amqpsub/amqpsub/amqpsub"
)

// muteAfterOpen returns the address of a broker that opens AMQP
// connections and then answers nothing (no begin): one that is starting,
// overloaded, or a node that takes connections but cannot serve the queue.
func muteAfterOpen(t *testing.T) string {
	t.Helper()
	return acceptAll(t, func(c net.Conn) {
		hdr := make([]byte, 8)
		if _, err := io.ReadFull(c, hdr); err != nil {
			return
		}
		if write(c, peerAMQPHeader) != nil {
			return
		}
		if _, _, err := readPeerFrame(c); err != nil { // open
			return
		}
		if write(c, peerFrame(0, 0, described(0x10, list8(str8("mute"))))) != nil {
			return
		}
		_, _ = io.Copy(io.Discard, c)
	})
}

// On the first connect, an address that opens the connection but never
// opens the session is passed over: the good address after it serves the
// subscriber. (An outside review found Run ending with the first one's
// error.)
func TestFailoverFirstAttachMovesOn(t *testing.T) {
	good := newPeer(t, false)
	c, err := amqpsub.DialFailover([]string{"amqp://" + muteAfterOpen(t), "amqp://" + good.addr()}, nil)
	if err != nil {
		t.Fatal(err)
	}
	s, _ := amqpsub.New(c, "q", nop, amqpsub.DialTimeout(300*time.Millisecond))
	cancel, errc := run(t, s)
	defer cancel()
	select {
	case <-good.attached:
		cancel()
		<-errc
	case err := <-errc:
		t.Fatalf("Run = %v; the second address (accepted %d connections) was never tried", err, good.accepted.Load())
	case <-time.After(10 * time.Second):
		t.Fatal("neither")
	}
}
