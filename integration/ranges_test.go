package integration

import (
	"context"
	"errors"
	"net"
	neturl "net/url"
	"testing"
	"time"

	"github.com/Azure/go-amqp"

	"github.com/amqpsub/amqpsub/internal/wire"
)

// amqpsub's connection layer merges settled acceptances still queued into
// one disposition for a range of deliveries. Both brokers must settle
// every delivery of a range: after a drain through wire.Conn in which
// ranges were sent, a new receiver finds the queue empty (a broker that
// settled only the first of each range would redeliver the rest once the
// connection closed).
func TestBrokersSettleRangedAcceptances(t *testing.T) {
	for _, b := range []struct {
		name    string
		url     func(testing.TB) string
		send    func(q string) string
		recv    func(q string) string
		artemis bool
		srcCaps []string
	}{
		{name: "artemis", url: artemisURL, send: func(q string) string { return q }, recv: func(q string) string { return q },
			artemis: true, srcCaps: []string{"queue"}},
		{name: "rabbitmq", url: rabbitURL, send: func(q string) string { return "/queue/" + q },
			recv: func(q string) string { return "/amq/queue/" + q }},
	} {
		t.Run(b.name, func(t *testing.T) {
			url := b.url(t)
			const n = 5000
			q := queueName(t)
			msgs := make([]msgSpec, n)
			for i := range msgs {
				msgs[i] = msgSpec{seq: i, body: make([]byte, 100)}
			}
			publishFast(t, dial(t, url), b.send(q), b.artemis, msgs)

			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
			defer cancel()
			conn, wc := dialWire(t, ctx, url)
			sess, err := conn.NewSession(ctx, nil)
			if err != nil {
				t.Fatal(err)
			}
			// Manual credit, a window of 256 at a time once the last one
			// has arrived: go-amqp's automatic credit stalls on RabbitMQ
			// 3.10, which sends past its credit (see brokers.md).
			rcv, err := sess.NewReceiver(ctx, b.recv(q), &amqp.ReceiverOptions{Credit: -1, SourceCapabilities: b.srcCaps})
			if err != nil {
				t.Fatal(err)
			}
			const window = 256
			granted := 0
			for i := range n + 1 {
				if i >= granted {
					if err := rcv.IssueCredit(window); err != nil {
						t.Fatal(err)
					}
					granted = i + window
				}
				m, err := rcv.Receive(ctx, nil)
				if err != nil {
					t.Fatalf("receive %d: %v", i, err)
				}
				if err := rcv.AcceptMessage(ctx, m); err != nil {
					t.Fatalf("accept %d: %v", i, err)
				}
			}
			closeSession(sess)
			if err := conn.Close(); err != nil && !errors.Is(err, net.ErrClosed) {
				t.Logf("close: %v", err)
			}
			st := wc.Stats()
			t.Logf("%d acceptances: %d merged into ranges, %d writes in %d flushes", n+1, st.Merged, st.Writes, st.Flushes)
			if st.Merged == 0 {
				t.Fatal("no acceptance was merged: the test did not send a range")
			}

			// The queue is empty: nothing comes within 2 s.
			probe := dial(t, url)
			ps, err := probe.NewSession(ctx, nil)
			if err != nil {
				t.Fatal(err)
			}
			pr, err := ps.NewReceiver(ctx, b.recv(q), &amqp.ReceiverOptions{Credit: 16, SourceCapabilities: b.srcCaps})
			if err != nil {
				t.Fatal(err)
			}
			wctx, wcancel := context.WithTimeout(ctx, 2*time.Second)
			defer wcancel()
			if m, err := pr.Receive(wctx, nil); err == nil {
				t.Fatalf("the queue still had a message (%d bytes) after every one was accepted", len(m.GetData()))
			} else if !errors.Is(err, context.DeadlineExceeded) {
				t.Fatalf("probe: %v", err)
			}
		})
	}
}

type hostPort struct{ host, hostname, user, password string }

// parseHostPort reads an amqp://[user:password@]host:port URL.
func parseHostPort(raw string) (hostPort, error) {
	u, err := neturl.Parse(raw)
	if err != nil {
		return hostPort{}, err
	}
	hp := hostPort{host: u.Host, hostname: u.Hostname()}
	if u.Port() == "" {
		hp.host = net.JoinHostPort(u.Hostname(), "5672")
	}
	if u.User != nil {
		hp.user = u.User.Username()
		hp.password, _ = u.User.Password()
	}
	return hp, nil
}

// dialWire opens a go-amqp connection over a wire.Conn, as amqpsub.Dial
// does, and returns both.
func dialWire(t *testing.T, ctx context.Context, url string) (*amqp.Conn, *wire.Conn) {
	t.Helper()
	u, err := parseHostPort(url)
	if err != nil {
		t.Fatal(err)
	}
	var d net.Dialer
	nc, err := d.DialContext(ctx, "tcp", u.host)
	if err != nil {
		t.Fatal(err)
	}
	wc := wire.New(nc, nil, wire.Options{})
	opts := &amqp.ConnOptions{HostName: u.hostname}
	if u.user != "" {
		opts.SASLType = amqp.SASLTypePlain(u.user, u.password)
	}
	conn, err := amqp.NewConn(ctx, wc, opts)
	if err != nil {
		wc.Abort()
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close(); wc.Abort() })
	return conn, wc
}
