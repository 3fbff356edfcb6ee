package amqpsub_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/amqpsub/amqpsub/amqpsub"
	"github.com/amqpsub/amqpsub/internal/fake"
)

// Every profile, every lane mode, with and without Service Bus's own
// options (given before and after the others), over a test source: 24
// deliveries all accepted, Run returns at the stop, and Stats add up; or,
// for Service Bus's own options under another profile, New refuses them.
func TestEveryProfileLaneModeAndOptionSetRuns(t *testing.T) {
	profiles := []amqpsub.Profile{amqpsub.Artemis, amqpsub.RabbitMQ3, amqpsub.RabbitMQ4, amqpsub.Generic, amqpsub.AzureServiceBus}
	modes := map[string][]amqpsub.Option{
		"workers1":   {amqpsub.Workers(1)},
		"workers4":   {amqpsub.Workers(4)},
		"bykey4":     {amqpsub.WorkersByKey(4)},
		"balanced":   {amqpsub.WorkersByKey(4), amqpsub.BalanceKeys()},
		"batch":      {amqpsub.Workers(2), amqpsub.Batch(5, time.Millisecond)},
		"batchbykey": {amqpsub.WorkersByKey(2), amqpsub.Batch(5, time.Millisecond)},
	}
	sbOpts := map[string][]amqpsub.Option{
		"none":       nil,
		"renewal0":   {amqpsub.MaxLockRenewal(0)},
		"allsb":      {amqpsub.MaxLockRenewal(time.Minute), amqpsub.SettleTimeout(time.Second), amqpsub.SessionIdleTimeout(time.Second)},
		"poison":     {amqpsub.MaxDeliveryCount(5), amqpsub.MaxMessageSize(1 << 20)},
		"localretry": {amqpsub.LocalRetry(amqpsub.RetryPolicy{Attempts: 2, Initial: time.Millisecond, Max: time.Millisecond})},
		"sessions":   {amqpsub.Sessions(3), amqpsub.MaxLockRenewal(0)},
		"sessionids": {amqpsub.SessionIDs("a", "b"), amqpsub.SessionIdleTimeout(time.Second)},
	}
	for _, prof := range profiles {
		for mname, mode := range modes {
			for oname, opt := range sbOpts {
				for _, sbFirst := range []bool{false, true} {
					name := fmt.Sprintf("%s/%s/%s/sbfirst=%v", prof, mname, oname, sbFirst)
					t.Run(name, func(t *testing.T) {
						synctest.Test(t, func(t *testing.T) {
							optionMatrixRow(t, prof, mode, opt, sbFirst, mname, oname)
						})
					})
				}
			}
		}
	}
}

// sbOnly names the option sets of TestEveryProfileLaneModeAndOptionSetRuns
// that New refuses under every profile but AzureServiceBus.
var sbOnly = map[string]bool{"renewal0": true, "allsb": true, "sessions": true, "sessionids": true}

func optionMatrixRow(t *testing.T, prof amqpsub.Profile, mode, sbOpt []amqpsub.Option, sbFirst bool, mname, oname string) {
	const n = 24
	src := fake.New(true, fake.Messages(n, "a", "b", "c")...)
	var handled atomic.Int64
	opts := append([]amqpsub.Option{amqpsub.WithProfile(prof), amqpsub.GracePeriod(time.Second)}, mode...)
	if sbFirst {
		opts = append(slices.Clone(sbOpt), opts...)
	} else {
		opts = append(opts, sbOpt...)
	}
	var s *amqpsub.Subscriber
	var err error
	if mname == "batch" || mname == "batchbykey" {
		s, err = amqpsub.NewBatch(amqpsub.SourceOf(src), "q", amqpsub.BatchHandlerFunc(func(_ context.Context, b []*amqpsub.Delivery) []error {
			handled.Add(int64(len(b)))
			return nil
		}), opts...)
	} else {
		s, err = amqpsub.New(amqpsub.SourceOf(src), "q", amqpsub.HandlerFunc(func(context.Context, *amqpsub.Delivery) error {
			handled.Add(1)
			return nil
		}), opts...)
	}
	if sbOnly[oname] && prof.String() != amqpsub.AzureServiceBus.String() {
		if !errors.Is(err, amqpsub.ErrInvalidOption) {
			t.Fatalf("Service Bus's own options (%s) under %s: New = %v, want ErrInvalidOption", oname, prof, err)
		}
		return
	}
	if err != nil {
		t.Fatalf("New with valid options: %v", err)
	}
	cancel, errc := run(t, s)
	for handled.Load() < n {
		select {
		case err := <-errc:
			t.Fatalf("Run returned %v after %d of %d", err, handled.Load(), n)
		case <-time.After(10 * time.Millisecond):
		}
	}
	synctest.Wait()
	cancel()
	select {
	case err := <-errc:
		if err != nil {
			t.Fatalf("Run = %v", err)
		}
	case <-time.After(time.Minute):
		t.Fatal("Run did not return within a minute of the stop")
	}
	st := s.Stats()
	if st.Results.Accept != n || src.Count(fake.Accepted) != n || st.Locks.Held != 0 {
		t.Fatalf("accepted %d by the handlers, %d at the source, %d locks held; want %d, %d, 0: %v",
			st.Results.Accept, src.Count(fake.Accepted), st.Locks.Held, n, n, st)
	}
}
