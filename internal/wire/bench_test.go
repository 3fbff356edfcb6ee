package wire_test

import (
	"io"
	"net"
	"testing"
	"time"

	"github.com/amqpsub/amqpsub/internal/wire"
)

// 40-byte frames (the size of a disposition) from one goroutine to a peer
// on loopback that reads as fast as it can, timed until the peer has read
// them all: the plain socket makes one syscall per frame, the wrapper one
// per batch. "deadline" also sets a write deadline before each frame, as
// go-amqp does.
func BenchmarkWrite40(b *testing.B) {
	for _, bc := range []struct {
		name           string
		wrap, deadline bool
	}{
		{"plain", false, false},
		{"wire", true, false},
		{"plain+deadline", false, true},
		{"wire+deadline", true, true},
	} {
		b.Run(bc.name, func(b *testing.B) {
			client, server := tcpPair(b)
			drained := make(chan struct{})
			go func() {
				io.Copy(io.Discard, server)
				close(drained)
			}()
			var w net.Conn = client
			var wc *wire.Conn
			if bc.wrap {
				wc = wire.New(client, nil, wire.Options{})
				w = wc
			}
			frame := make([]byte, 40)
			b.ReportAllocs()
			b.ResetTimer()
			for range b.N {
				if bc.deadline {
					w.SetWriteDeadline(time.Now().Add(30 * time.Second))
				}
				if _, err := w.Write(frame); err != nil {
					b.Fatal(err)
				}
			}
			// Timed to the last byte read by the peer: the wrapper's Write
			// returns before its bytes are written.
			if err := w.Close(); err != nil {
				b.Fatal(err)
			}
			<-drained
			b.StopTimer()
			perFlush := 1.0
			if wc != nil {
				st := wc.Stats()
				perFlush = float64(st.Writes) / float64(st.Flushes)
			}
			b.ReportMetric(perFlush, "frames/flush")
		})
	}
}
