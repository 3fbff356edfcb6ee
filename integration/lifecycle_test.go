package integration

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/Azure/go-amqp"

	"github.com/amqpsub/amqpsub/amqpsub"
)

// A handler that never returns and ignores its ctx: a graceful stop and a
// Close each end Run within their bound, name the abandoned handler, and
// the broker gives its delivery to another consumer once the connection is
// closed. The buffered deliveries go back at once.
func TestArtemisStuckHandlerIsAbandoned(t *testing.T) {
	url := artemisURL(t)
	for _, how := range []string{"ctx", "Close"} {
		t.Run(how, func(t *testing.T) {
			q := queueName(t)
			conn := dial(t, url)
			publishFast(t, conn, q, true, uniqueSeqs(5, 0))
			const grace, closing = 2 * time.Second, time.Second
			release := make(chan struct{})
			defer close(release)
			var stuckSeq atomic.Int64
			stuckSeq.Store(-2)
			in := make(chan struct{})
			s, err := amqpsub.New(amqpsub.Dial(url, nil), q, amqpsub.HandlerFunc(func(ctx context.Context, d *amqpsub.Delivery) error {
				if stuckSeq.CompareAndSwap(-2, int64(seqOf(d))) {
					close(in)
					<-release // never mind ctx
				}
				return nil
			}), amqpsub.GracePeriod(grace), amqpsub.CloseTimeout(closing), amqpsub.Logger(logger(t)),
				amqpsub.FixedCredit()) // the other 5 buffered behind the stuck one
			if err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			errc := make(chan error, 1)
			go func() { errc <- s.Run(ctx) }()
			<-in
			waitFor(t, 10*time.Second, "the other 5 buffered", func() bool { return s.Stats().Held == 6 })
			began := time.Now()
			bound := grace + closing
			if how == "ctx" {
				cancel()
			} else {
				s.Close()
				bound = closing
			}
			select {
			case err = <-errc:
			case <-time.After(bound + 10*time.Second):
				t.Fatalf("Run had not returned %v after the stop began", bound+10*time.Second)
			}
			took := time.Since(began)
			t.Logf("%s: Run returned after %v: %v", how, took.Round(time.Millisecond), err)
			if took > bound+slack {
				t.Errorf("Run took %v, past %v", took, bound+slack)
			}
			if !errors.Is(err, amqpsub.ErrAbandoned) || !strings.Contains(err.Error(), "1 handlers") {
				t.Fatalf("Run = %v, want ErrAbandoned naming 1 handler", err)
			}
			// Everything, the stuck delivery included, reaches another
			// consumer: the buffered were released, the stuck one comes back
			// when the connection closes.
			got := receiveN(t, rawReceiver(t, conn, q, 10), 6, 10*time.Second)
			seqs := map[int]bool{}
			for _, m := range got {
				seqs[int(m.ApplicationProperties["seq"].(int64))] = true
			}
			if len(got) != 6 || !seqs[int(stuckSeq.Load())] {
				t.Fatalf("the second consumer got %d messages %v, want all 6 with the stuck %d", len(got), seqs, stuckSeq.Load())
			}
		})
	}
}

// Close ends Run within CloseTimeout even when the broker stops answering
// (a frozen connection): the link's detach is never answered, and the
// socket is closed under go-amqp.
func TestArtemisCloseIsBoundedWhenTheBrokerFreezes(t *testing.T) {
	url := artemisURL(t)
	q := queueName(t)
	conn := dial(t, url)
	publishFast(t, conn, q, true, uniqueSeqs(20, 0))
	p := newProxy(t, strings.TrimPrefix(url, "amqp://"))
	const closing = time.Second
	s, err := amqpsub.New(amqpsub.Dial(p.url(), nil), q, amqpsub.HandlerFunc(func(ctx context.Context, d *amqpsub.Delivery) error {
		<-ctx.Done()
		return ctx.Err()
	}), amqpsub.CloseTimeout(closing), amqpsub.Logger(logger(t)), amqpsub.FixedCredit()) // all 21 held
	if err != nil {
		t.Fatal(err)
	}
	_, wait := runSub(t, s)
	waitFor(t, 10*time.Second, "deliveries held", func() bool { return s.Stats().Held == 21 })
	if n := p.freeze(); n != 1 {
		t.Fatalf("%d connections frozen, want 1", n)
	}
	began := time.Now()
	s.Close()
	if err := wait(); err != nil {
		t.Fatalf("Run = %v", err)
	}
	if took := time.Since(began); took > closing+slack {
		t.Fatalf("Run took %v after Close with a frozen broker, past %v", took, closing+slack)
	}
}

// The Conn connector: the subscriber opens and closes its own session on a
// connection the caller owns; a lost link is replaced on the same
// connection; a lost connection ends Run with ErrLinkLost.
func TestArtemisConnConnector(t *testing.T) {
	url := artemisURL(t)

	t.Run("consumes and leaves the connection open", func(t *testing.T) {
		q := queueName(t)
		conn := dial(t, url)
		publishFast(t, conn, q, true, uniqueSeqs(100, 0))
		var handled atomic.Int64
		s, _ := amqpsub.New(amqpsub.Conn(conn), q, amqpsub.HandlerFunc(func(context.Context, *amqpsub.Delivery) error {
			handled.Add(1)
			return nil
		}), amqpsub.Logger(logger(t)))
		stop, wait := runSub(t, s)
		waitFor(t, 30*time.Second, "101 handled", func() bool { return handled.Load() == 101 })
		stop()
		if err := wait(); err != nil {
			t.Fatal(err)
		}
		// The caller's connection still works.
		publishFast(t, conn, q, true, uniqueSeqs(1, 0))
		if got := receiveN(t, rawReceiver(t, conn, q, 10), 2, 10*time.Second); len(got) != 2 {
			t.Fatalf("the connection took %d of 2 after the subscriber stopped", len(got))
		}
	})

	t.Run("a lost link is replaced on the same connection", func(t *testing.T) {
		q := queueName(t)
		conn := dial(t, url)
		publishFast(t, conn, q, true, uniqueSeqs(10, 0))
		var handled atomic.Int64
		s, _ := amqpsub.New(amqpsub.Conn(conn), q, amqpsub.HandlerFunc(func(context.Context, *amqpsub.Delivery) error {
			handled.Add(1)
			return nil
		}), amqpsub.Backoff(10*time.Millisecond, 100*time.Millisecond), amqpsub.Logger(logger(t)))
		stop, wait := runSub(t, s)
		waitFor(t, 30*time.Second, "11 handled", func() bool { return handled.Load() == 11 })
		// Destroying the queue under its consumer detaches the link; the
		// subscriber attaches again (the queue is auto-created anew).
		managementOp(t, conn, "broker", "destroyQueue", q, true)
		waitFor(t, 30*time.Second, "a reconnect", func() bool { return s.Stats().Reconnects == 1 })
		publishFast(t, conn, q, true, uniqueSeqs(10, 0))
		waitFor(t, 30*time.Second, "22 handled", func() bool { return handled.Load() == 22 })
		stop()
		if err := wait(); err != nil {
			t.Fatal(err)
		}
		if st := s.Stats(); st.LinksLost != 1 || st.Links != 2 {
			t.Fatalf("stats %v", st)
		}
	})

	t.Run("a lost connection ends Run with ErrLinkLost", func(t *testing.T) {
		q := queueName(t)
		p := newProxy(t, strings.TrimPrefix(url, "amqp://"))
		conn := dial(t, p.url())
		publishFast(t, conn, q, true, uniqueSeqs(10, 0))
		var handled atomic.Int64
		s, _ := amqpsub.New(amqpsub.Conn(conn), q, amqpsub.HandlerFunc(func(context.Context, *amqpsub.Delivery) error {
			handled.Add(1)
			return nil
		}), amqpsub.Backoff(10*time.Millisecond, 100*time.Millisecond), amqpsub.Logger(logger(t)))
		_, wait := runSub(t, s)
		waitFor(t, 30*time.Second, "11 handled", func() bool { return handled.Load() == 11 })
		p.cut()
		err := wait()
		if !errors.Is(err, amqpsub.ErrLinkLost) || !amqpsub.IsFatal(err) {
			t.Fatalf("Run = %v, want ErrLinkLost", err)
		}
		var ce *amqp.ConnError
		if !errors.As(err, &ce) {
			t.Fatalf("Run = %v, want the connection's error inside", err)
		}
	})
}

// Every option at its smallest valid value runs end to end on Artemis, for
// a Handler and a BatchHandler. The smallest DialTimeout cannot connect: it
// gives a clear error, not a crash.
func TestArtemisSmallestValidOptions(t *testing.T) {
	url := artemisURL(t)
	for _, batch := range []bool{false, true} {
		t.Run(fmt.Sprintf("batch=%v", batch), func(t *testing.T) {
			q := queueName(t)
			conn := dial(t, url)
			publishFast(t, conn, q, true, groups(50, 5))
			var handled atomic.Int64
			opts := []amqpsub.Option{
				amqpsub.Credit(1), amqpsub.WorkersByKey(1), amqpsub.GracePeriod(0), amqpsub.DialTimeout(5 * time.Second),
				amqpsub.CloseTimeout(time.Nanosecond), amqpsub.IdleTimeout(100 * time.Millisecond),
				amqpsub.Backoff(time.Nanosecond, time.Nanosecond), amqpsub.LinkName(""), amqpsub.FatalErrors(nil),
				amqpsub.OnReconnect(nil), amqpsub.OnEvent(nil), amqpsub.MaxDeliveryCount(1),
				amqpsub.LocalRetry(amqpsub.RetryPolicy{Attempts: 1}), amqpsub.Logger(logger(t)),
			}
			var s *amqpsub.Subscriber
			var err error
			if batch {
				s, err = amqpsub.NewBatch(amqpsub.Dial(url, nil), q, amqpsub.BatchHandlerFunc(func(_ context.Context, b []*amqpsub.Delivery) []error {
					handled.Add(int64(len(b)))
					return nil
				}), append(opts, amqpsub.Batch(1, 0))...)
			} else {
				s, err = amqpsub.New(amqpsub.Dial(url, nil), q, amqpsub.HandlerFunc(func(context.Context, *amqpsub.Delivery) error {
					handled.Add(1)
					return nil
				}), opts...)
			}
			if err != nil {
				t.Fatal(err)
			}
			stop, wait := runSub(t, s)
			waitFor(t, 30*time.Second, "51 handled", func() bool { return handled.Load() == 51 })
			stop()
			if err := wait(); err != nil {
				t.Fatal(err)
			}
			if st := s.Stats(); st.MaxHeld != 1 || st.Settled.Accepted != 51 {
				t.Fatalf("stats %v", st)
			}
		})
	}
	t.Run("DialTimeout(1ns)", func(t *testing.T) {
		s, _ := amqpsub.New(amqpsub.Dial(url, nil), queueName(t), amqpsub.HandlerFunc(func(context.Context, *amqpsub.Delivery) error { return nil }),
			amqpsub.DialTimeout(time.Nanosecond))
		err := s.Run(context.Background())
		if !errors.Is(err, context.DeadlineExceeded) || !strings.Contains(err.Error(), "127.0.0.1") {
			t.Fatalf("Run = %v, want a dial timeout naming the broker", err)
		}
	})
}

// Run returns within CloseTimeout of Close, whatever the peer or the
// TokenProvider does: a peer that stops answering (its sockets open,
// nothing forwarded), or a TokenProvider stuck in a refresh that ignores
// its ctx.
func TestServiceBusCloseBound(t *testing.T) {
	p := serviceBusPeer(t)
	const closeTimeout = 200 * time.Millisecond
	const slack = 300 * time.Millisecond // scheduling, under -race on a busy machine
	closeAndTime := func(t *testing.T, s *amqpsub.Subscriber, wait func() error) {
		t.Helper()
		began := time.Now()
		s.Close()
		err := wait()
		took := time.Since(began)
		t.Logf("Run returned %v after Close (CloseTimeout %v): %v", took.Round(time.Millisecond), closeTimeout, err)
		if took > closeTimeout+slack {
			t.Fatalf("Run returned %v after Close, CloseTimeout is %v", took.Round(time.Millisecond), closeTimeout)
		}
	}
	for _, sessions := range []bool{false, true} {
		t.Run(fmt.Sprintf("peer hangs, sessions %v", sessions), func(t *testing.T) {
			spec := map[string]any{"lock_duration_ms": 30000}
			send := map[string]any{"count": 4}
			opts := []amqpsub.Option{amqpsub.CloseTimeout(closeTimeout), amqpsub.Logger(logger(t))}
			if sessions {
				spec["requires_session"] = true
				send["sessions"] = []string{"a", "b"}
				opts = append(opts, amqpsub.Sessions(2))
			}
			q := p.fxEntity(t, spec)
			send["entity"], send["message_id_prefix"] = q, q
			p.call(t, "POST", "/messages", send, nil)
			host := strings.TrimRight(strings.TrimPrefix(connValue(p.conn, "Endpoint"), "sb://"), "/")
			px := newProxy(t, host)
			c, err := amqpsub.ServiceBus(strings.Replace(p.conn, host, px.ln.Addr().String(), 1))
			if err != nil {
				t.Fatal(err)
			}
			s, _ := amqpsub.New(c, q, amqpsub.HandlerFunc(func(context.Context, *amqpsub.Delivery) error { return nil }), opts...)
			_, wait := runSub(t, s)
			waitFor(t, 20*time.Second, "4 accepted", func() bool { return s.Stats().Settled.Accepted == 4 })
			px.freeze()
			closeAndTime(t, s, wait)
		})
	}
	t.Run("TokenProvider blocks", func(t *testing.T) {
		q := p.fxEntity(t, map[string]any{"lock_duration_ms": 30000})
		endpoint, sas := p.tokenEndpoint(4 * time.Second)
		tp := &tokenScript{TokenProvider: sas, blockFrom: 3, blocked: make(chan struct{}), release: make(chan struct{})}
		var once sync.Once
		release := func() { once.Do(func() { close(tp.release) }) }
		defer release()
		c, err := amqpsub.ServiceBusWithToken(endpoint, tp)
		if err != nil {
			t.Fatal(err)
		}
		s, _ := amqpsub.New(c, q, amqpsub.HandlerFunc(func(context.Context, *amqpsub.Delivery) error { return nil }),
			amqpsub.CloseTimeout(closeTimeout), amqpsub.Logger(logger(t)))
		_, wait := runSub(t, s)
		select {
		case <-tp.blocked: // the refresh, due 2 s after connecting, is stuck in Token
		case <-time.After(20 * time.Second):
			t.Fatal("no token refresh within 20 s")
		}
		// Let the provider go if Run is not back in time, so that the test
		// reports the time rather than hanging.
		watchdog := time.AfterFunc(closeTimeout+5*time.Second, release)
		defer watchdog.Stop()
		closeAndTime(t, s, wait)
	})
}
