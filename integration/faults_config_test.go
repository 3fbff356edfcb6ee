package integration

import (
	"context"
	"errors"
	"net"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/Azure/go-amqp"
	"go.uber.org/goleak"

	"github.com/amqpsub/amqpsub/amqpsub"
)

// Configuration and addresses that cannot work.

// Bad configuration and addresses: clear errors, Run returns within its
// dial timeout, and no goroutine is left behind.
func TestFaultBadConfig(t *testing.T) {
	url := artemisURL(t)
	hostPort := strings.TrimPrefix(url, "amqp://")
	nop := amqpsub.HandlerFunc(func(context.Context, *amqpsub.Delivery) error { return nil })
	const dialTimeout = 2 * time.Second

	// run runs a subscriber that must fail, and checks it fails in time.
	run := func(t *testing.T, c amqpsub.Connector, q string, opts ...amqpsub.Option) error {
		t.Helper()
		s, err := amqpsub.New(c, q, nop, append([]amqpsub.Option{amqpsub.DialTimeout(dialTimeout), amqpsub.Logger(logger(t))}, opts...)...)
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		start := time.Now()
		err = s.Run(ctx)
		took := time.Since(start)
		t.Logf("Run = %v (after %v)", err, took.Round(time.Millisecond))
		if err == nil {
			t.Fatal("Run succeeded")
		}
		// The dial timeout bounds connect, session and attach together; a
		// little more for this busy machine.
		if took > dialTimeout+500*time.Millisecond {
			t.Errorf("Run returned after %v, past its dial timeout %v", took, dialTimeout)
		}
		return err
	}
	wantCond := func(t *testing.T, err error, cond amqp.ErrCond, fatal bool, names ...string) {
		t.Helper()
		var ae *amqp.Error
		if !errors.As(err, &ae) || ae.Condition != cond {
			t.Errorf("error %v, want condition %s", err, cond)
		}
		if amqpsub.IsFatal(err) != fatal {
			t.Errorf("IsFatal(%v) = %v, want %v", err, !fatal, fatal)
		}
		for _, n := range names {
			if !strings.Contains(err.Error(), n) {
				t.Errorf("error %q does not name %q", err, n)
			}
		}
	}

	t.Run("unreachable port", func(t *testing.T) {
		defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
		addr := closedPort(t)
		err := run(t, amqpsub.Dial("amqp://"+addr, nil), queueName(t))
		if !errors.Is(err, syscall.ECONNREFUSED) || !strings.Contains(err.Error(), addr) {
			t.Errorf("error %v, want connection refused naming %s", err, addr)
		}
	})
	t.Run("silent listener", func(t *testing.T) {
		defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
		// Accepts TCP, never speaks AMQP: only the dial timeout ends it.
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		var held []net.Conn
		var wg sync.WaitGroup
		wg.Go(func() {
			for {
				c, err := ln.Accept()
				if err != nil {
					return
				}
				held = append(held, c)
			}
		})
		err = run(t, amqpsub.Dial("amqp://"+ln.Addr().String(), nil), queueName(t))
		ln.Close()
		wg.Wait()
		for _, c := range held {
			c.Close()
		}
		if !errors.Is(err, context.DeadlineExceeded) {
			t.Errorf("error %v, want the dial timeout", err)
		}
	})
	t.Run("wrong password", func(t *testing.T) {
		defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
		err := run(t, amqpsub.Dial("amqp://amqpsub:wrong@"+hostPort, nil), queueName(t))
		if !amqpsub.IsFatal(err) || !strings.Contains(err.Error(), "SASL") {
			t.Errorf("error %v, want a fatal SASL error", err)
		}
	})
	t.Run("Artemis queue capability on a multicast address", func(t *testing.T) {
		q := queueName(t)
		// A sender with capability topic makes q a multicast address.
		func() {
			conn := dial(t, url)
			defer conn.Close()
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			sess, err := conn.NewSession(ctx, nil)
			if err != nil {
				t.Fatal(err)
			}
			if _, err := sess.NewSender(ctx, q, &amqp.SenderOptions{TargetCapabilities: []string{"topic"}}); err != nil {
				t.Fatal(err)
			}
		}()
		defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
		err := run(t, amqpsub.Dial(url, nil), q)
		// Artemis answers amqp:illegal-state, which IsFatal takes as fatal,
		// so a reconnect does not retry it forever.
		wantCond(t, err, amqp.ErrCondIllegalState, true, q, hostPort)
	})
	t.Run("Artemis DLQ before its first dead letter", func(t *testing.T) {
		defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
		q := dlq(queueName(t))
		err := run(t, amqpsub.Dial(url, nil), q)
		wantCond(t, err, amqp.ErrCondNotFound, true, q, hostPort)
	})
	t.Run("RabbitMQ missing queue", func(t *testing.T) {
		rabbit := rabbitURL(t)
		defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
		q := "missing-" + strings.ReplaceAll(queueName(t), "/", ".")
		err := run(t, amqpsub.Dial(rabbit, nil), q, amqpsub.WithProfile(amqpsub.RabbitMQ3))
		wantCond(t, err, amqp.ErrCondNotFound, true, q, "127.0.0.1:5682")
		if strings.Contains(err.Error(), "guest:guest") {
			t.Errorf("credentials in the error: %v", err)
		}
	})
	t.Run("invalid options", func(t *testing.T) {
		defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
		c := amqpsub.Dial(url, nil)
		batch := amqpsub.BatchHandlerFunc(func(context.Context, []*amqpsub.Delivery) []error { return nil })
		for _, tc := range []struct {
			name string
			new  func() (*amqpsub.Subscriber, error)
			says string
		}{
			{"Credit(0)", func() (*amqpsub.Subscriber, error) { return amqpsub.New(c, "q", nop, amqpsub.Credit(0)) }, "Credit(0)"},
			{"Workers(0)", func() (*amqpsub.Subscriber, error) { return amqpsub.New(c, "q", nop, amqpsub.Workers(0)) }, "Workers(0)"},
			{"WorkersByKey(-1)", func() (*amqpsub.Subscriber, error) { return amqpsub.New(c, "q", nop, amqpsub.WorkersByKey(-1)) }, "WorkersByKey(-1)"},
			{"DialTimeout(0)", func() (*amqpsub.Subscriber, error) { return amqpsub.New(c, "q", nop, amqpsub.DialTimeout(0)) }, "DialTimeout(0s)"},
			{"IdleTimeout(-1s)", func() (*amqpsub.Subscriber, error) {
				return amqpsub.New(c, "q", nop, amqpsub.IdleTimeout(-time.Second))
			}, "IdleTimeout(-1s)"},
			{"Backoff(2s, 1s)", func() (*amqpsub.Subscriber, error) {
				return amqpsub.New(c, "q", nop, amqpsub.Backoff(2*time.Second, time.Second))
			}, "Backoff(2s, 1s)"},
			{"LocalRetry(Attempts: -1)", func() (*amqpsub.Subscriber, error) {
				return amqpsub.New(c, "q", nop, amqpsub.LocalRetry(amqpsub.RetryPolicy{Attempts: -1}))
			}, "LocalRetry({Attempts:-1"},
			{"Workers and WorkersByKey", func() (*amqpsub.Subscriber, error) {
				return amqpsub.New(c, "q", nop, amqpsub.Workers(2), amqpsub.WorkersByKey(2))
			}, "WorkersByKey(2) after Workers(2)"},
			{"GracePeriod(-1s)", func() (*amqpsub.Subscriber, error) {
				return amqpsub.New(c, "q", nop, amqpsub.GracePeriod(-time.Second))
			}, "GracePeriod(-1s)"},
			{"Logger(nil)", func() (*amqpsub.Subscriber, error) { return amqpsub.New(c, "q", nop, amqpsub.Logger(nil)) }, "Logger(nil)"},
			{"zero Profile", func() (*amqpsub.Subscriber, error) {
				return amqpsub.New(c, "q", nop, amqpsub.WithProfile(amqpsub.Profile{}))
			}, "zero Profile"},
			{"nil Option", func() (*amqpsub.Subscriber, error) { return amqpsub.New(c, "q", nop, nil) }, "nil Option"},
			{"Batch with a Handler", func() (*amqpsub.Subscriber, error) { return amqpsub.New(c, "q", nop, amqpsub.Batch(10, 0)) }, "NewBatch"},
			{"Batch(0, …) on NewBatch", func() (*amqpsub.Subscriber, error) {
				return amqpsub.NewBatch(c, "q", batch, amqpsub.Batch(0, time.Second))
			}, "Batch(0, 1s)"},
			{"nil Handler", func() (*amqpsub.Subscriber, error) { return amqpsub.New(c, "q", nil) }, "nil Handler"},
			{"nil Connector", func() (*amqpsub.Subscriber, error) { return amqpsub.New(nil, "q", nop) }, "nil Connector"},
			{"empty queue", func() (*amqpsub.Subscriber, error) { return amqpsub.New(c, "", nop) }, "empty queue"},
		} {
			s, err := tc.new()
			if s != nil || !errors.Is(err, amqpsub.ErrInvalidOption) || !strings.Contains(err.Error(), tc.says) {
				t.Errorf("%s: New = %v, %v; want ErrInvalidOption saying %q", tc.name, s, err, tc.says)
			}
		}
		// Two bad options: both are reported.
		_, err := amqpsub.New(c, "q", nop, amqpsub.Credit(0), amqpsub.Workers(0))
		if err == nil || !strings.Contains(err.Error(), "Credit(0)") || !strings.Contains(err.Error(), "Workers(0)") {
			t.Errorf("two bad options: %v", err)
		}
	})
	t.Run("Conn(nil)", func(t *testing.T) {
		_, err := amqpsub.New(amqpsub.Conn(nil), queueName(t), nop)
		if !errors.Is(err, amqpsub.ErrInvalidOption) || !strings.Contains(err.Error(), "Conn(nil)") {
			t.Errorf("New = %v, want ErrInvalidOption saying Conn(nil)", err)
		}
	})
}
