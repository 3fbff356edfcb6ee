package amqpsub_test

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"testing/synctest"

	"github.com/amqpsub/amqpsub/amqpsub"
	"github.com/amqpsub/amqpsub/internal/fake"
)

func TestRetryOfARetryIsTheSameRetry(t *testing.T) {
	cause := errors.New("store down")
	once := amqpsub.Retry(cause)
	twice := amqpsub.Retry(once)
	if twice != once || twice.Error() != "amqpsub: retry: store down" || !errors.Is(twice, cause) {
		t.Fatalf("Retry(Retry(err)) = %q", twice)
	}
	if wrapped := amqpsub.Retry(fmt.Errorf("save: %w", once)); !errors.Is(wrapped, cause) {
		t.Fatalf("wrapped retry lost its cause: %q", wrapped)
	}
}

// A typed-nil *OutcomeError returned as an error, or a zero OutcomeError,
// is a non-nil error: Retry, never a crash or an accept.
func TestInvalidOutcomeErrorsMeanRetry(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		src := fake.New(true, fake.Messages(2)...)
		var calls atomic.Int32
		s, _ := amqpsub.New(amqpsub.SourceOf(src), "q", amqpsub.HandlerFunc(func(context.Context, *amqpsub.Delivery) error {
			switch calls.Add(1) {
			case 1:
				var oe *amqpsub.OutcomeError
				var err error = oe
				return err
			case 2:
				return &amqpsub.OutcomeError{}
			}
			return nil // the redeliveries
		}))
		cancel, errc := run(t, s)
		synctest.Wait()
		cancel()
		<-errc
		if src.Count(fake.Accepted) != 2 || src.Count(fake.Modified) != 2 || s.Stats().Results.Retry != 2 {
			t.Fatalf("accepted %d, modified %d, results %+v", src.Count(fake.Accepted), src.Count(fake.Modified), s.Stats().Results)
		}
	})
	var nilOE *amqpsub.OutcomeError
	if nilOE.Error() == "" || (&amqpsub.OutcomeError{}).Error() == "" || amqpsub.Retry(nilOE) == nil {
		t.Fatal("invalid OutcomeErrors must still describe themselves")
	}
}

func TestResultOf(t *testing.T) {
	for _, c := range []struct {
		err  error
		want amqpsub.Result
	}{
		{nil, amqpsub.ResultAccept},
		{amqpsub.Release(), amqpsub.ResultRelease},
		{amqpsub.Reject("x"), amqpsub.ResultReject},
		{amqpsub.RejectWith("x", "y"), amqpsub.ResultReject},
		{amqpsub.Retry(errors.New("x")), amqpsub.ResultRetry},
		{errors.New("x"), amqpsub.ResultRetry},
		{context.Canceled, amqpsub.ResultRetry},
	} {
		if got := amqpsub.ResultOf(c.err); got != c.want {
			t.Errorf("ResultOf(%v) = %v, want %v", c.err, got, c.want)
		}
	}
}
