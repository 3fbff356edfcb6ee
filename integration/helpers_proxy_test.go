package integration

import (
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// A TCP proxy that fails connections on purpose.

// proxy forwards TCP connections to a broker and can drop them (as a
// network blip or a load balancer does), cut them and refuse new ones, or
// freeze them (keep the sockets open, forward nothing).
type proxy struct {
	ln     net.Listener
	target string
	wg     sync.WaitGroup

	mu     sync.Mutex
	conns  map[*proxyConn]struct{}
	refuse bool
	closed bool
}

type proxyConn struct {
	client, server net.Conn
	frozen         atomic.Bool
	once           sync.Once
}

func (c *proxyConn) close() {
	c.once.Do(func() {
		c.client.Close()
		c.server.Close()
	})
}

func newProxy(t testing.TB, target string) *proxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &proxy{ln: ln, target: target, conns: map[*proxyConn]struct{}{}}
	p.wg.Go(p.accept)
	t.Cleanup(p.close)
	return p
}

func (p *proxy) url() string { return "amqp://" + p.addr() }

// addr is the proxy's host:port.
func (p *proxy) addr() string { return p.ln.Addr().String() }

func (p *proxy) accept() {
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		p.mu.Lock()
		refuse := p.refuse || p.closed
		p.mu.Unlock()
		if refuse {
			c.Close()
			continue
		}
		s, err := net.DialTimeout("tcp", p.target, 5*time.Second)
		if err != nil {
			c.Close()
			continue
		}
		pc := &proxyConn{client: c, server: s}
		p.mu.Lock()
		if p.closed {
			p.mu.Unlock()
			pc.close()
			continue
		}
		p.conns[pc] = struct{}{}
		p.mu.Unlock()
		p.wg.Go(func() { p.pipe(pc, s, c) })
		p.wg.Go(func() { p.pipe(pc, c, s) })
	}
}

// pipe copies src to dst until either side ends, then closes both. A
// frozen connection's data is read and dropped: each side sees silence.
func (p *proxy) pipe(pc *proxyConn, dst, src net.Conn) {
	defer func() {
		pc.close()
		p.mu.Lock()
		delete(p.conns, pc)
		p.mu.Unlock()
	}()
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		if n > 0 && !pc.frozen.Load() {
			if _, err := dst.Write(buf[:n]); err != nil {
				return
			}
		}
		if err != nil {
			return
		}
	}
}

// cut closes every connection and refuses new ones until acceptAgain.
func (p *proxy) cut() int {
	p.mu.Lock()
	p.refuse = true
	p.mu.Unlock()
	return p.drop()
}

// drop closes every connection; new ones are let through.
func (p *proxy) drop() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	for pc := range p.conns {
		pc.close()
	}
	return len(p.conns)
}

// acceptAgain lets new connections through again.
func (p *proxy) acceptAgain() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.refuse = false
}

// freeze stops forwarding on every open connection, keeping them open.
func (p *proxy) freeze() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	for pc := range p.conns {
		pc.frozen.Store(true)
	}
	return len(p.conns)
}

func (p *proxy) close() {
	p.mu.Lock()
	p.closed = true
	for pc := range p.conns {
		pc.close()
	}
	p.mu.Unlock()
	p.ln.Close()
	p.wg.Wait()
}
