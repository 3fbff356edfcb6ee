package amqpsub_test

import (
	"context"
	"errors"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/Azure/go-amqp"

	"github.com/amqpsub/amqpsub/amqpsub"
	"github.com/amqpsub/amqpsub/internal/fake"
)

// stuck2 is stuck, recording when its ctx was cancelled.
type stuck2 struct {
	release     chan struct{}
	in          chan struct{}
	cancelledAt atomic.Int64 // UnixNano; 0: not (yet)
}

func (h *stuck2) Handle(ctx context.Context, _ *amqpsub.Delivery) error {
	h.in <- struct{}{}
	go func() {
		<-ctx.Done()
		h.cancelledAt.CompareAndSwap(0, time.Now().UnixNano())
	}()
	<-h.release
	return nil
}

func TestRunReturnsWhateverAHandlerDoes(t *testing.T) {
	const grace, closing = 2 * time.Second, time.Second
	for _, tc := range []struct {
		name     string
		stop     func(s *amqpsub.Subscriber, cancel context.CancelFunc, src *fake.Source) time.Time
		bound    time.Duration // Run returns this long after the stop began
		cancelAt time.Duration // the handlers' ctx is cancelled this long after
		fatal    bool
	}{
		{"ctx", func(_ *amqpsub.Subscriber, cancel context.CancelFunc, _ *fake.Source) time.Time {
			cancel()
			return time.Now()
		}, grace + closing, grace, false},
		{"Shutdown", func(s *amqpsub.Subscriber, _ context.CancelFunc, _ *fake.Source) time.Time {
			go func() { _ = s.Shutdown(context.Background()) }()
			return time.Now()
		}, grace + closing, grace, false},
		{"Close", func(s *amqpsub.Subscriber, _ context.CancelFunc, _ *fake.Source) time.Time {
			_ = s.Close()
			return time.Now()
		}, closing, 0, false},
		{"fatal error", func(_ *amqpsub.Subscriber, _ context.CancelFunc, src *fake.Source) time.Time {
			src.Fail(fake.ErrLinkLost)
			return time.Now()
		}, grace + closing, grace, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				src := fake.New(true, fake.Messages(10)...)
				refused := &amqp.Error{Condition: amqp.ErrCondNotFound, Description: "queue deleted"}
				h := &stuck2{release: make(chan struct{}), in: make(chan struct{}, 2)}
				var events []amqpsub.Event
				var mu sync.Mutex
				s, err := amqpsub.New(amqpsub.SourcesOf(sources(src, refused)), "q", h, amqpsub.Credit(4), amqpsub.Workers(2),
					amqpsub.GracePeriod(grace), amqpsub.CloseTimeout(closing), amqpsub.Backoff(time.Nanosecond, time.Nanosecond),
					amqpsub.OnEvent(func(e amqpsub.Event) {
						mu.Lock()
						events = append(events, e)
						mu.Unlock()
					}))
				if err != nil {
					t.Fatal(err)
				}
				ctx, cancel := context.WithCancel(context.Background())
				defer cancel()
				errc := make(chan error, 1)
				go func() { errc <- s.Run(ctx) }()
				<-h.in
				<-h.in
				synctest.Wait()
				began := tc.stop(s, cancel, src)
				err = <-errc
				// Backoff(1ns, 1ns): a fatal stop may begin up to 1ns late.
				slack := time.Duration(0)
				if tc.fatal {
					slack = time.Nanosecond
				}
				if took := time.Since(began); took < tc.bound || took > tc.bound+slack {
					t.Fatalf("Run returned %v after the stop began, want %v", took, tc.bound)
				}
				if at := time.Duration(h.cancelledAt.Load() - began.UnixNano()); h.cancelledAt.Load() == 0 || at < tc.cancelAt || at > tc.cancelAt+slack {
					t.Fatalf("handlers' ctx cancelled %v after the stop began, want %v", at, tc.cancelAt)
				}
				if !errors.Is(err, amqpsub.ErrAbandoned) || !strings.Contains(err.Error(), "2 handlers") {
					t.Fatalf("Run = %v, want ErrAbandoned naming 2 handlers", err)
				}
				if tc.fatal != errors.Is(err, refused) || tc.fatal != errors.Is(err, amqpsub.ErrLinkLost) {
					t.Fatalf("Run = %v: fatal error reported %v, want %v", err, errors.Is(err, refused), tc.fatal)
				}
				settledBefore := len(src.Settlements())
				close(h.release)
				synctest.Wait()
				if n := len(src.Settlements()); n != settledBefore || src.Count(fake.Accepted) != 0 {
					t.Fatalf("the abandoned handlers' results were settled (%d settlements)", n-settledBefore)
				}
				if st := s.Stats(); st.Abandoned != 2 || st.Results.Accept != 0 {
					t.Fatalf("stats %v: want 2 abandoned, their results not counted", st)
				}
				mu.Lock()
				defer mu.Unlock()
				last := events[len(events)-1]
				if last.Kind != amqpsub.EventAbandoned || last.Count != 2 || last.Queue != "q" {
					t.Fatalf("last event %v, want abandoned", last)
				}
			})
		})
	}
}
