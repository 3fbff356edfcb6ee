package amqpsub_test

import (
	"context"
	"errors"
	"net"
	"strings"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/amqpsub/amqpsub/amqpsub"
	"github.com/amqpsub/amqpsub/amqpsubtest"
	"github.com/amqpsub/amqpsub/internal/fake"
)

func TestShutdownWaitsForRun(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		src := fake.New(true, fake.Messages(50)...)
		var started atomic.Int64
		finish := make(chan struct{})
		s, _ := amqpsub.New(amqpsub.SourceOf(src), "q", amqpsub.HandlerFunc(func(ctx context.Context, d *amqpsub.Delivery) error {
			started.Add(1)
			<-finish
			return ctx.Err()
		}), amqpsub.Credit(20), amqpsub.Workers(2))
		_, errc := run(t, s)
		synctest.Wait()
		shut := make(chan error, 1)
		go func() { shut <- s.Shutdown(context.Background()) }()
		synctest.Wait()
		select {
		case err := <-shut:
			t.Fatalf("Shutdown returned %v while 2 handlers run", err)
		default:
		}
		close(finish)
		if err := <-shut; err != nil {
			t.Fatal(err)
		}
		if err := <-errc; err != nil {
			t.Fatal(err)
		}
	})
}

// Run after a Run that ended with its ctx: ErrClosed, not a second pump.
func TestSecondRunAfterCtxEnd(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		src := fake.New(true, fake.Messages(1)...)
		s, _ := amqpsub.New(amqpsub.SourceOf(src), "q", amqpsub.HandlerFunc(func(context.Context, *amqpsub.Delivery) error { return nil }))
		cancel, errc := run(t, s)
		synctest.Wait()
		cancel()
		if err := <-errc; err != nil {
			t.Fatal(err)
		}
		if err := s.Run(context.Background()); !errors.Is(err, amqpsub.ErrClosed) {
			t.Fatalf("second Run = %v, want ErrClosed", err)
		}
	})
}

// Close during the grace period of a graceful stop (or of a fatal error's)
// ends the wait: Run returns within CloseTimeout of Close.
func TestCloseCutsTheGracePeriodShort(t *testing.T) {
	for _, fatal := range []bool{false, true} {
		synctest.Test(t, func(t *testing.T) {
			src := fake.New(true, fake.Messages(3)...)
			refused := errors.New("refused")
			s, _ := amqpsub.New(amqpsub.SourcesOf(sources(src, refused)), "q", amqpsub.HandlerFunc(func(ctx context.Context, _ *amqpsub.Delivery) error {
				<-ctx.Done()
				return ctx.Err()
			}), amqpsub.GracePeriod(time.Hour), amqpsub.CloseTimeout(time.Second),
				amqpsub.Backoff(time.Nanosecond, time.Nanosecond),
				amqpsub.FatalErrors(func(err error) bool { return errors.Is(err, refused) }))
			cancel, errc := run(t, s)
			synctest.Wait()
			if fatal {
				src.Fail(fake.ErrLinkLost)
			} else {
				cancel()
			}
			time.Sleep(time.Minute) // well into the grace period
			start := time.Now()
			s.Close()
			<-errc
			if d := time.Since(start); d != 0 {
				t.Fatalf("fatal %v: Run returned %v after Close, want at once", fatal, d)
			}
			cancel()
		})
	}
}

// A broker that accepts the TCP connection but never answers: Run gives up
// at DialTimeout, with an error that says so.
func TestDialTimeoutBoundsASilentBroker(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			defer c.Close() // hold it open, say nothing
		}
	}()
	s, _ := amqpsub.New(amqpsub.Dial("amqp://"+ln.Addr().String(), nil), "q",
		amqpsub.HandlerFunc(func(context.Context, *amqpsub.Delivery) error { return nil }),
		amqpsub.DialTimeout(200*time.Millisecond))
	start := time.Now()
	err = s.Run(context.Background())
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Run = %v, want DeadlineExceeded", err)
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Fatalf("Run took %v with DialTimeout(200ms)", d)
	}
}

// An address that does not parse is quoted whole in the error: the password
// in it is scrubbed all the same.
func TestUnparsableAddressHidesThePassword(t *testing.T) {
	s, _ := amqpsub.New(amqpsub.Dial("amqp://alice:s3cr3t%zz@127.0.0.1:1", nil), "q",
		amqpsub.HandlerFunc(func(context.Context, *amqpsub.Delivery) error { return nil }))
	err := s.Run(context.Background())
	// Not a fragment of it either: url.Parse's error quotes the password
	// partly decoded ("%zz"), where scrubbing cannot find it.
	if err == nil || strings.Contains(err.Error(), "s3cr3t") || strings.Contains(err.Error(), "%zz") {
		t.Fatalf("Run = %v: want an error without the password", err)
	}
}

func TestLocalRetryGivesUpToTheBroker(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		src := fake.New(true, fake.Messages(1)...)
		var calls atomic.Int64
		s, _ := amqpsub.New(amqpsub.SourceOf(src), "q", amqpsub.HandlerFunc(func(_ context.Context, d *amqpsub.Delivery) error {
			if calls.Add(1) <= 5 {
				return errors.New("down")
			}
			return nil
		}), amqpsub.LocalRetry(amqpsub.RetryPolicy{Attempts: 2, Initial: time.Millisecond, Max: time.Millisecond}))
		cancel, errc := run(t, s)
		synctest.Wait()
		time.Sleep(time.Second)
		cancel()
		<-errc
		// 1 call + 2 local retries, then modified; on the redelivery 2
		// more fail and the third is accepted.
		if calls.Load() != 6 || src.Count(fake.Modified) != 1 || src.Count(fake.Accepted) != 1 {
			t.Fatalf("calls %d modified %d accepted %d", calls.Load(), src.Count(fake.Modified), src.Count(fake.Accepted))
		}
	})
}

// Workers ignores group-ids: deliveries of one group run side by side.
func TestWorkersIgnoreGroups(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		src := fake.New(true, fake.Messages(4, "g")...)
		gate := make(chan struct{})
		s, _ := amqpsub.New(amqpsub.SourceOf(src), "q", amqpsub.HandlerFunc(func(context.Context, *amqpsub.Delivery) error {
			<-gate
			return nil
		}), amqpsub.Workers(2))
		cancel, errc := run(t, s)
		synctest.Wait()
		if st := s.Stats(); st.Handling != 2 {
			t.Fatalf("%d handlers run for one group under Workers(2), want 2", st.Handling)
		}
		close(gate)
		synctest.Wait()
		cancel()
		if err := <-errc; err != nil {
			t.Fatal(err)
		}
	})
}

// A handler's context cancelled by a stop says so: its cause is
// ErrStopping, not a bare context.Canceled.
func TestStopCancelsHandlersWithErrStopping(t *testing.T) {
	q := amqpsubtest.NewQueue()
	q.Publish(amqpsubtest.Message("", "1"))
	began := make(chan struct{})
	cause := make(chan error, 1)
	s, err := amqpsub.New(q.Connector(), "q", amqpsub.HandlerFunc(func(ctx context.Context, _ *amqpsub.Delivery) error {
		close(began)
		<-ctx.Done()
		cause <- context.Cause(ctx)
		return ctx.Err()
	}), amqpsub.GracePeriod(0))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	errc := make(chan error, 1)
	go func() { errc <- s.Run(ctx) }()
	<-began
	cancel()
	if err := <-errc; err != nil {
		t.Fatal(err)
	}
	if c := <-cause; !errors.Is(c, amqpsub.ErrStopping) {
		t.Fatalf("cause %v, want ErrStopping", c)
	}
}
