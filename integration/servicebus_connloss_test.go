package integration

import (
	"context"
	"io"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/amqpsub/amqpsub/amqpsub"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"
)

// cutProxy forwards TCP to target and can cut every connection at once,
// as a network blip or a load balancer does: go-amqp then ends the
// connection, its receive link and its $management pair with a ConnError.
type cutProxy struct {
	ln    net.Listener
	mu    sync.Mutex
	conns []net.Conn
}

func newCutProxy(t *testing.T, target string) *cutProxy {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &cutProxy{ln: ln}
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			u, err := net.Dial("tcp", target)
			if err != nil {
				c.Close()
				continue
			}
			p.mu.Lock()
			p.conns = append(p.conns, c, u)
			p.mu.Unlock()
			go func() { io.Copy(u, c); u.Close() }()
			go func() { io.Copy(c, u); c.Close() }()
		}
	}()
	t.Cleanup(func() { ln.Close(); p.cut() })
	return p
}

func (p *cutProxy) cut() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, c := range p.conns {
		c.Close()
	}
	p.conns = nil
}

// A lost connection, not only a link detach: accepts in flight on the
// receive link when the connection goes fall back to update-disposition,
// which waits for the next link's $management (not the dead one's), so
// none fails and no message whose handler had finished comes back.
func TestServiceBusConnectionLossLosesNoFinishedWork(t *testing.T) {
	p := serviceBusPeer(t)
	q := p.entity(t, map[string]any{"lock_duration_ms": 5000})
	const n = 64
	p.send(t, q, n)
	// Each accept waits 300 ms for its answer: some are in flight at the cut.
	p.call(t, "POST", "/faults/settle-delay", map[string]any{"ms": 300}, nil)
	defer p.call(t, "POST", "/faults/settle-delay", map[string]any{"ms": 0}, nil)
	target := strings.TrimPrefix(strings.SplitN(strings.SplitN(p.conn, ";", 2)[0], "=", 2)[1], "sb://")
	px := newCutProxy(t, target)
	conn := strings.Replace(p.conn, target, px.ln.Addr().String(), 1)
	c, err := amqpsub.ServiceBus(conn)
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	calls := make([]int, n)
	finished := make([]bool, n)
	againFinished := 0
	handled := 0
	cut := make(chan struct{})
	s, err := amqpsub.New(c, q, amqpsub.HandlerFunc(func(ctx context.Context, d *amqpsub.Delivery) error {
		i := sbIndex(d)
		mu.Lock()
		calls[i]++
		if calls[i] > 1 && finished[i] {
			againFinished++
		}
		mu.Unlock()
		time.Sleep(20 * time.Millisecond)
		mu.Lock()
		finished[i] = true
		if handled++; handled == 24 {
			close(cut)
		}
		mu.Unlock()
		return nil
	}), amqpsub.Workers(16), amqpsub.Credit(16), amqpsub.Backoff(50*time.Millisecond, 200*time.Millisecond), amqpsub.Logger(zaptest.NewLogger(t, zaptest.Level(zap.DebugLevel))))
	if err != nil {
		t.Fatal(err)
	}
	stop, wait := runSub(t, s)
	<-cut
	// Cut while the peer holds accepts unanswered (its settle delay).
	waitFor(t, 10*time.Second, "settlements outstanding at the peer", func() bool {
		return p.counters(t)["settlements_outstanding"] > 0
	})
	px.cut()
	waitFor(t, 2*time.Minute, "all completed", func() bool { return p.info(t, q).Stats["completed"] == n })
	stop()
	if err := wait(); err != nil {
		t.Fatal(err)
	}
	st := s.Stats()
	mu.Lock()
	defer mu.Unlock()
	t.Logf("handled again though their handler had finished: %d; stats %v", againFinished, st)
	if st.LinksLost < 1 {
		t.Fatalf("no link lost")
	}
	if st.Locks.DispositionRequests == 0 {
		t.Fatalf("no settlement went by lock token: the cut caught none in flight")
	}
	if againFinished != 0 || st.SettleErrors != 0 {
		t.Fatalf("after a connection loss: %d messages whose handler had finished were handled again; %d settle errors",
			againFinished, st.SettleErrors)
	}
}
