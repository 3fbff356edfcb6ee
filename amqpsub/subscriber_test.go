package amqpsub_test

import (
	"context"
	"errors"
	"testing"
	"testing/synctest"
	"time"

	"go.uber.org/goleak"

	"github.com/amqpsub/amqpsub/amqpsub"
	"github.com/amqpsub/amqpsub/internal/fake"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

var nowhere = amqpsub.Dial("amqp://127.0.0.1:1", nil)

func run(t *testing.T, s *amqpsub.Subscriber) (context.CancelFunc, <-chan error) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	errc := make(chan error, 1)
	go func() { errc <- s.Run(ctx) }()
	return cancel, errc
}

func index(d *amqpsub.Delivery) int {
	v, err := d.Value()
	if err != nil {
		panic(err)
	}
	return v.(int)
}

func TestInvalidOptionsFailAtConstruction(t *testing.T) {
	h := amqpsub.HandlerFunc(func(context.Context, *amqpsub.Delivery) error { return nil })
	bh := amqpsub.BatchHandlerFunc(func(context.Context, []*amqpsub.Delivery) []error { return nil })
	for name, build := range map[string]func() (*amqpsub.Subscriber, error){
		"credit 0":         func() (*amqpsub.Subscriber, error) { return amqpsub.New(nowhere, "q", h, amqpsub.Credit(0)) },
		"credit -1":        func() (*amqpsub.Subscriber, error) { return amqpsub.New(nowhere, "q", h, amqpsub.Credit(-1)) },
		"workers 0":        func() (*amqpsub.Subscriber, error) { return amqpsub.New(nowhere, "q", h, amqpsub.Workers(0)) },
		"workers by key 0": func() (*amqpsub.Subscriber, error) { return amqpsub.New(nowhere, "q", h, amqpsub.WorkersByKey(0)) },
		"batch size 0":     func() (*amqpsub.Subscriber, error) { return amqpsub.NewBatch(nowhere, "q", bh, amqpsub.Batch(0, 0)) },
		"negative wait": func() (*amqpsub.Subscriber, error) {
			return amqpsub.NewBatch(nowhere, "q", bh, amqpsub.Batch(10, -time.Millisecond))
		},
		"batch on New":   func() (*amqpsub.Subscriber, error) { return amqpsub.New(nowhere, "q", h, amqpsub.Batch(10, 0)) },
		"negative grace": func() (*amqpsub.Subscriber, error) { return amqpsub.New(nowhere, "q", h, amqpsub.GracePeriod(-1)) },
		"zero dial":      func() (*amqpsub.Subscriber, error) { return amqpsub.New(nowhere, "q", h, amqpsub.DialTimeout(0)) },
		"nil logger":     func() (*amqpsub.Subscriber, error) { return amqpsub.New(nowhere, "q", h, amqpsub.Logger(nil)) },
		"zero profile": func() (*amqpsub.Subscriber, error) {
			return amqpsub.New(nowhere, "q", h, amqpsub.WithProfile(amqpsub.Profile{}))
		},
		"nil handler":     func() (*amqpsub.Subscriber, error) { return amqpsub.New(nowhere, "q", nil) },
		"nil batch":       func() (*amqpsub.Subscriber, error) { return amqpsub.NewBatch(nowhere, "q", nil) },
		"empty queue":     func() (*amqpsub.Subscriber, error) { return amqpsub.New(nowhere, "", h) },
		"nil connector":   func() (*amqpsub.Subscriber, error) { return amqpsub.New(nil, "q", h) },
		"close timeout 0": func() (*amqpsub.Subscriber, error) { return amqpsub.New(nowhere, "q", h, amqpsub.CloseTimeout(0)) },
		"credit too big":  func() (*amqpsub.Subscriber, error) { return amqpsub.New(nowhere, "q", h, amqpsub.Credit(1<<20+1)) },
		"workers twice": func() (*amqpsub.Subscriber, error) {
			return amqpsub.New(nowhere, "q", h, amqpsub.Workers(2), amqpsub.WorkersByKey(2))
		},
		"nil option":          func() (*amqpsub.Subscriber, error) { return amqpsub.New(nowhere, "q", h, nil) },
		"sessions on artemis": func() (*amqpsub.Subscriber, error) { return amqpsub.New(nowhere, "q", h, amqpsub.Sessions(2)) },
		"zero sessions":       func() (*amqpsub.Subscriber, error) { return amqpsub.New(nowhere, "q", h, amqpsub.Sessions(0)) },
		"empty session id":    func() (*amqpsub.Subscriber, error) { return amqpsub.New(nowhere, "q", h, amqpsub.SessionIDs("a", "")) },
		"negative lock renewal": func() (*amqpsub.Subscriber, error) {
			return amqpsub.New(nowhere, "q", h, amqpsub.MaxLockRenewal(-time.Second))
		},
		"zero settle timeout": func() (*amqpsub.Subscriber, error) { return amqpsub.New(nowhere, "q", h, amqpsub.SettleTimeout(0)) },
		"settle timeout under 1s": func() (*amqpsub.Subscriber, error) {
			return amqpsub.New(nowhere, "q", h, amqpsub.SettleTimeout(999*time.Millisecond))
		},
		"empty dead-letter address": func() (*amqpsub.Subscriber, error) { return amqpsub.New(nowhere, "q", h, amqpsub.DeadLetterCopy("")) },
		"DeadLetterCopy on Service Bus": func() (*amqpsub.Subscriber, error) {
			return amqpsub.New(nowhere, "q", h, amqpsub.WithProfile(amqpsub.AzureServiceBus), amqpsub.DeadLetterCopy("dlq"))
		},
		"DeadLetterCopy on RabbitMQ3": func() (*amqpsub.Subscriber, error) {
			return amqpsub.New(nowhere, "q", h, amqpsub.WithProfile(amqpsub.RabbitMQ3), amqpsub.DeadLetterCopy("dlq"))
		},
	} {
		s, err := build()
		if !errors.Is(err, amqpsub.ErrInvalidOption) || s != nil {
			t.Errorf("%s: %v, %v; want ErrInvalidOption", name, s, err)
		}
	}
	if _, err := amqpsub.NewBatch(nowhere, "q", bh, amqpsub.Batch(1, 0), amqpsub.Credit(1), amqpsub.WorkersByKey(1)); err != nil {
		t.Errorf("smallest valid options: %v", err)
	}
}

// With handlers that block, the deliveries held never exceed the credit.
func TestHeldNeverExceedsCredit(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		src := fake.New(false, fake.Messages(100)...)
		unblock := make(chan struct{})
		s, _ := amqpsub.New(amqpsub.SourceOf(src), "q", amqpsub.HandlerFunc(func(context.Context, *amqpsub.Delivery) error {
			<-unblock
			return nil
		}), amqpsub.Credit(8), amqpsub.FixedCredit(), amqpsub.Workers(3))
		cancel, errc := run(t, s)
		synctest.Wait()
		st := s.Stats()
		if st.Held != 8 || st.Handling != 3 || st.Buffered != 5 {
			t.Fatalf("held %d handling %d buffered %d, want 8/3/5", st.Held, st.Handling, st.Buffered)
		}
		close(unblock)
		for s.Stats().Settled.Accepted < 100 {
			time.Sleep(time.Millisecond)
		}
		cancel()
		if err := <-errc; err != nil {
			t.Fatal(err)
		}
		if st := s.Stats(); st.MaxHeld != 8 || st.Held != 0 {
			t.Fatalf("max held %d, held %d", st.MaxHeld, st.Held)
		}
	})
}

// valueHandler's methods take it by value: called through a nil
// *valueHandler, they panic.
type valueHandler struct{}

func (valueHandler) Handle(context.Context, *amqpsub.Delivery) error { return nil }

func (valueHandler) HandleBatch(context.Context, []*amqpsub.Delivery) []error { return nil }

// pointerHandler's methods take a pointer and never use it: a nil one works.
type pointerHandler struct{}

func (*pointerHandler) Handle(context.Context, *amqpsub.Delivery) error { return nil }

// chain is a handler that is a slice: a nil one has nothing to run.
type chain []amqpsub.Handler

func (c chain) Handle(ctx context.Context, d *amqpsub.Delivery) error {
	for _, h := range c {
		if err := h.Handle(ctx, d); err != nil {
			return err
		}
	}
	return nil
}

// A handler that would panic on every call (nil, HandlerFunc(nil), a
// pointer to a nil func, a nil *T whose T has the method) is refused by New
// and NewBatch, rather than retrying every message until the broker
// dead-letters it; a nil pointer or slice whose methods work is not.
func TestNilHandlersAreRefused(t *testing.T) {
	c := amqpsub.Dial("amqp://127.0.0.1:1", nil)
	var nv *valueHandler
	for name, h := range map[string]amqpsub.Handler{"nil": nil, "HandlerFunc(nil)": amqpsub.HandlerFunc(nil),
		"nil *T, value methods": nv, "pointer to a nil HandlerFunc": new(amqpsub.HandlerFunc)} {
		if _, err := amqpsub.New(c, "q", h); !errors.Is(err, amqpsub.ErrInvalidOption) {
			t.Errorf("New with a %s handler: %v, want ErrInvalidOption", name, err)
		}
	}
	for name, h := range map[string]amqpsub.BatchHandler{"nil": nil, "BatchHandlerFunc(nil)": amqpsub.BatchHandlerFunc(nil),
		"nil *T, value methods": nv} {
		if _, err := amqpsub.NewBatch(c, "q", h, amqpsub.Batch(10, time.Millisecond)); !errors.Is(err, amqpsub.ErrInvalidOption) {
			t.Errorf("NewBatch with a %s handler: %v, want ErrInvalidOption", name, err)
		}
	}
	var np *pointerHandler
	for name, h := range map[string]amqpsub.Handler{"a value": valueHandler{}, "nil *T, pointer methods": np, "nil slice": chain(nil)} {
		if _, err := amqpsub.New(c, "q", h); err != nil {
			t.Errorf("New with a %s handler: %v", name, err)
		}
	}
}
