package integration

import (
	"context"
	"errors"
	"fmt"
	"net"
	neturl "net/url"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/Azure/go-amqp"

	"github.com/amqpsub/amqpsub/amqpsub"
	"github.com/amqpsub/amqpsub/internal/shapes"
	"github.com/amqpsub/amqpsub/internal/wire"
)

// How settlements reach the broker: ranged acceptances, the Service Bus
// round trip, and settlements the peer answers busy.

// The settle rate with every settling disposition answered 5 ms late:
// Workers(16), 2,000 messages an iteration; one settlement at a time
// would give 200 msg/s. The figure TestServiceBusSettleRoundTrip only
// logs.
func BenchmarkServiceBusSettleRoundTrip(b *testing.B) {
	p := serviceBusPeer(b)
	p.call(b, "POST", "/faults/settle-delay", map[string]any{"ms": 5}, nil)
	b.Cleanup(func() { p.call(b, "POST", "/faults/settle-delay", map[string]any{"ms": 0}, nil) })
	const n = 2000
	for range b.N {
		b.StopTimer()
		q := p.entity(b, map[string]any{"lock_duration_ms": 60000})
		p.send(b, q, n)
		var first atomic.Int64
		s, _ := amqpsub.New(sbConnector(b, p), q, amqpsub.HandlerFunc(func(ctx context.Context, d *amqpsub.Delivery) error {
			first.CompareAndSwap(0, time.Now().UnixNano())
			return nil
		}), amqpsub.Workers(16), amqpsub.Logger(logger(b)))
		b.StartTimer()
		stop, wait := runSub(b, s)
		waitFor(b, 2*time.Minute, "2,000 accepted", func() bool { return s.Stats().Settled.Accepted == n })
		took := time.Since(time.Unix(0, first.Load()))
		b.StopTimer()
		stop()
		if err := wait(); err != nil {
			b.Fatal(err)
		}
		b.ReportMetric(n/took.Seconds(), "msgs/s")
		b.StartTimer()
	}
}

// TestServiceBusSettleRoundTrip: with a 5 ms settle delay on the peer and
// Workers(16), settlements go out concurrently: the peer sees at least 8
// of them outstanding at once (settlements_outstanding_max). The rate is
// logged only; it is the benchmark's figure, not a pass condition.
func TestServiceBusSettleRoundTrip(t *testing.T) {
	p := serviceBusPeer(t)
	q := p.entity(t, map[string]any{"lock_duration_ms": 60000})
	const n = 2000
	p.send(t, q, n)
	p.call(t, "POST", "/faults/settle-delay", map[string]any{"ms": 5}, nil)
	t.Cleanup(func() { p.call(t, "POST", "/faults/settle-delay", map[string]any{"ms": 0}, nil) })
	p.call(t, "POST", "/counters/reset", nil, nil)
	var first, last atomic.Int64
	s, _ := amqpsub.New(sbConnector(t, p), q, amqpsub.HandlerFunc(func(ctx context.Context, d *amqpsub.Delivery) error {
		first.CompareAndSwap(0, time.Now().UnixNano())
		return nil
	}), amqpsub.Workers(16), amqpsub.Logger(logger(t)))
	stop, wait := runSub(t, s)
	waitFor(t, 2*time.Minute, "2,000 completed", func() bool {
		if s.Stats().Settled.Accepted == n {
			last.CompareAndSwap(0, time.Now().UnixNano())
			return true
		}
		return false
	})
	stop()
	if err := wait(); err != nil {
		t.Fatal(err)
	}
	c := p.counters(t)
	took := time.Duration(last.Load() - first.Load())
	t.Logf("%d settled in %v: %.0f msg/s; peer saw at most %d settlements outstanding (stats %v)",
		n, took.Round(time.Millisecond), float64(n)/took.Seconds(), c["settlements_outstanding_max"], s.Stats())
	if got := p.info(t, q).Stats["completed"]; got != n {
		t.Fatalf("the peer completed %d of %d", got, n)
	}
	if c["settlements_outstanding_max"] < 8 {
		t.Fatalf("at most %d settlements were outstanding at once with Workers(16), want >= 8", c["settlements_outstanding_max"])
	}
}

// The peer answers the first link dispositions of an entity as busy
// (com.microsoft:server-busy) or timed out (com.microsoft:timeout); go-amqp
// takes either answer as the delivery's settlement, so a settlement sent
// again on the link would write nothing. Each of those settlements goes
// out again by lock token (update-disposition), once, keeping its outcome:
// none is redelivered, none expires, and Stats count them. Timed-out
// answers in each lane mode of shapes.Lanes with a Handler (under
// WorkersByKey the settlements of a group go out one after the other, a
// resend included; a BatchHandler's settle through the same path).
func TestServiceBusSettlementAnsweredBusyIsSentByLockToken(t *testing.T) {
	t.Parallel() // its entities, faults and counters are its own
	p := serviceBusPeer(t)
	type row struct {
		mode   string
		lane   shapes.Lane
		lockMs int
	}
	// Locks outlive the 10 s wait after a server-busy answer, or, at 4 s,
	// are renewed through it: nothing is out for the message meanwhile.
	rows := []row{{"server-busy", shapes.Lanes()[0], 30000}, {"server-busy", shapes.Lanes()[0], 4000}}
	for _, l := range shapes.Lanes() {
		if l.Batch == 0 {
			rows = append(rows, row{"timeout", l, 30000})
		}
	}
	for _, r := range rows {
		mode := r.mode
		// A "+" in an entity's name would need escaping in the control API.
		t.Run(fmt.Sprintf("%s/%s/lock-%ds", mode, strings.ReplaceAll(r.lane.Name, "+", "-"), r.lockMs/1000), func(t *testing.T) {
			t.Parallel()
			const n, faults = 12, 5
			q := p.entity(t, map[string]any{"lock_duration_ms": r.lockMs, "max_delivery_count": 10})
			msgs := map[string]any{"entity": q, "count": n, "message_id_prefix": "m"}
			if mode != "server-busy" {
				// In 3 groups. Not after server-busy, where a group's
				// second resend would wait for its first, 10 s.
				msgs["sessions"] = []string{"a", "b", "c"}
			}
			p.call(t, "POST", "/messages", msgs, nil)
			t.Cleanup(func() { p.call(t, "POST", "/faults/disposition/clear", map[string]any{"entity": q}, nil) })
			var armed struct{ Remaining int }
			p.call(t, "POST", "/faults/disposition", map[string]any{"entity": q, "mode": mode, "count": faults}, &armed)
			if armed.Remaining != faults {
				t.Fatalf("fault armed for %d dispositions, want %d", armed.Remaining, faults)
			}
			// Odd messages are dead-lettered: a resend keeps the outcome
			// and its reason. The credit takes all at once, so that the
			// faults hit settlements in flight together.
			s, err := amqpsub.New(sbConnector(t, p), q, amqpsub.HandlerFunc(func(_ context.Context, d *amqpsub.Delivery) error {
				if id, _ := d.MessageID().(string); strings.IndexAny(id[len(id)-1:], "13579") == 0 {
					return amqpsub.RejectWith("poison", "odd")
				}
				return nil
			}), append(r.lane.Options(), amqpsub.Credit(n), amqpsub.FixedCredit(), amqpsub.Logger(logger(t)))...)
			if err != nil {
				t.Fatal(err)
			}
			stop, wait := runSub(t, s)
			waitFor(t, 30*time.Second, "every message settled", func() bool {
				e := p.info(t, q)
				return e.Stats["completed"]+e.DeadLetter == n && e.Locked == 0 && e.Available == 0
			})
			stop()
			if err := wait(); err != nil {
				t.Fatal(err)
			}
			var f struct {
				Hits     int
				Requests int `json:"update_disposition_requests"`
				Tokens   int `json:"update_disposition_tokens"`
			}
			p.call(t, "GET", "/faults/disposition?entity="+q, nil, &f)
			e := p.info(t, q)
			st := s.Stats()
			requests, tokens := f.Requests, f.Tokens
			t.Logf("faults hit %d; update-disposition: %d requests, %d tokens; entity %+v; settled %+v, settle errors %d, by token %d in %d requests",
				f.Hits, requests, tokens, e, st.Settled, st.SettleErrors, st.Locks.SettledByToken, st.Locks.DispositionRequests)
			if f.Hits != faults || tokens != faults || e.Stats["disposition_faults"] != faults {
				t.Fatalf("%d dispositions answered %s, %d settled by lock token: want %d each", f.Hits, mode, tokens, faults)
			}
			if e.Stats["delivered"] != n || e.Stats["lock_expired"] != 0 || e.Stats["completed"] != n/2 || e.DeadLetter != n/2 {
				t.Fatalf("entity %+v: want %d delivered once, %d completed, %d dead-lettered, no lock expired", e, n, n/2, n/2)
			}
			for _, m := range p.messages(t, q+"/$DeadLetterQueue") {
				if m.AppProps["DeadLetterReason"] != "poison" {
					t.Fatalf("dead letter %s has reason %v, want poison", m.MessageID, m.AppProps["DeadLetterReason"])
				}
			}
			if st.Settled.Accepted != n/2 || st.Settled.Rejected != n/2 || st.SettleErrors != 0 ||
				st.Locks.SettledByToken != faults || st.Locks.DispositionRequests != uint64(requests) ||
				mode == "server-busy" && r.lockMs < 10000 && st.Locks.Renewed < faults {
				t.Fatalf("stats: settled %+v, settle errors %d, by token %d in %d requests, %d locks renewed: want %d accepted and rejected, no error, %d by token in the peer's %d requests (and, on locks shorter than the wait, each renewed)",
					st.Settled, st.SettleErrors, st.Locks.SettledByToken, st.Locks.DispositionRequests, st.Locks.Renewed, n/2, faults, requests)
			}
		})
	}
}

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
