package servicebus_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"testing/synctest"
	"time"

	"github.com/Azure/go-amqp"
	"go.uber.org/zap"

	"github.com/amqpsub/amqpsub/internal/driver"

	"github.com/amqpsub/amqpsub/internal/driver/servicebus"
)

// goAMQPLink plays a receive link's settlement as go-amqp 1.7 does it: the
// first call writes the disposition and returns the peer's answer; the
// peer's disposition, error or not, marks the message settled, so every
// later call returns nil and writes nothing.
type goAMQPLink struct {
	answer error
	frames int // dispositions written
	calls  int
}

func (l *goAMQPLink) settle() error {
	l.calls++
	if l.frames > 0 {
		return nil
	}
	l.frames++
	return l.answer
}

// A settlement the service answers on the link as busy or timed out is
// sent once on the link and then by lock token, once, with the retries
// left of the budget; after server-busy no sooner than ServerBusyWait. A
// lost link goes by token with the whole budget; a final answer (a lost
// lock, a refusal) is returned as it is, and nothing goes by token.
func TestASettlementAnsweredBusyOrTimedOutIsSentAgainByLockToken(t *testing.T) {
	cond := func(c amqp.ErrCond) error { return &amqp.Error{Condition: c, Description: "answered so by the test"} }
	for _, tc := range []struct {
		name      string
		answer    error
		byToken   bool
		retries   int
		waitLeast time.Duration
	}{
		{"server-busy", cond(servicebus.CondServerBusy), true, servicebus.DispositionRetries - 1, servicebus.ServerBusyWait},
		{"timeout", cond(servicebus.CondTimeout), true, servicebus.DispositionRetries - 1, 0},
		{"operation-cancelled", cond("com.microsoft:operation-cancelled"), true, servicebus.DispositionRetries - 1, 0},
		{"link gone", &amqp.LinkError{}, true, servicebus.DispositionRetries, 0},
		{"lock lost", cond(servicebus.CondLockLost), false, 0, 0},
		{"not allowed", cond(amqp.ErrCondNotAllowed), false, 0, 0},
		{"taken", nil, false, 0, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				link := &goAMQPLink{answer: tc.answer}
				var sent []int // the retries of each settlement by token
				start := time.Now()
				var waited time.Duration
				msg := &amqp.Message{DeliveryTag: make([]byte, 16)}
				err := servicebus.SettleThrough(context.Background(), msg, driver.Outcome{Kind: driver.Accept}, link.settle,
					func(_ context.Context, m *amqp.Message, o driver.Outcome, retries int) error {
						if m != msg || o.Kind != driver.Accept {
							t.Errorf("by token: message %p outcome %v, want %p accept", m, o.Kind, msg)
						}
						waited = time.Since(start)
						sent = append(sent, retries)
						return nil
					})
				if link.frames != 1 {
					t.Fatalf("%d dispositions written on the link, want 1", link.frames)
				}
				if !tc.byToken {
					if len(sent) != 0 || !errors.Is(err, tc.answer) {
						t.Fatalf("sent by token %v, returned %v: want nothing by token and the link's answer %v", sent, err, tc.answer)
					}
					return
				}
				if err != nil || len(sent) != 1 || sent[0] != tc.retries {
					t.Fatalf("returned %v, sent by token %v (the retries of each): want nil, once with %d retries (link called %d times)",
						err, sent, tc.retries, link.calls)
				}
				if waited < tc.waitLeast {
					t.Fatalf("sent by token %v after the link's answer, want no sooner than %v", waited, tc.waitLeast)
				}
			})
		})
	}
}

// A settlement whose context ends during the wait before its resend is
// not sent by token: it returns the link's answer.
func TestASettlementCancelledBeforeItsResendReturnsTheAnswer(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		busy := &amqp.Error{Condition: servicebus.CondServerBusy}
		link := &goAMQPLink{answer: busy}
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		time.AfterFunc(time.Second, cancel) // a stop, during the server-busy wait
		sent := 0
		err := servicebus.SettleThrough(ctx, &amqp.Message{DeliveryTag: make([]byte, 16)}, driver.Outcome{Kind: driver.Accept}, link.settle,
			func(context.Context, *amqp.Message, driver.Outcome, int) error { sent++; return nil })
		if !errors.Is(err, busy) || sent != 0 {
			t.Fatalf("returned %v, sent by token %d times: want the server-busy answer, nothing by token", err, sent)
		}
	})
}

// A settlement bounded by less than the server-busy wait (SettleTimeout
// may be 1 s) is still sent again by token, halfway to its deadline.
func TestASettlementWithAShortDeadlineIsStillSentAgain(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		link := &goAMQPLink{answer: &amqp.Error{Condition: servicebus.CondServerBusy}}
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		start := time.Now()
		var at time.Duration
		err := servicebus.SettleThrough(ctx, &amqp.Message{DeliveryTag: make([]byte, 16)}, driver.Outcome{Kind: driver.Accept}, link.settle,
			func(context.Context, *amqp.Message, driver.Outcome, int) error { at = time.Since(start); return nil })
		if err != nil || at != time.Second {
			t.Fatalf("returned %v, sent by token after %v: want nil, sent after 1s", err, at)
		}
	})
}

// A release by lock token goes as an abandon, so its answer says so
// whatever it is: unanswered before the caller's deadline, or refused
// because the dispositions' goroutine had ended. The pump then counts one
// outcome for it on every path.
func TestAReleaseByTokenIsAnAbandonOnEveryAnswer(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		f := servicebus.NewDispositions(func(ctx context.Context) (*servicebus.Management, error) {
			<-ctx.Done() // no link comes
			return nil, ctx.Err()
		}, zap.NewNop())
		rctx, stop := context.WithCancel(t.Context())
		ran := make(chan struct{})
		go func() { defer close(ran); f.Run(rctx) }()
		msg := &amqp.Message{DeliveryTag: make([]byte, 16)}
		release := driver.Outcome{Kind: driver.Release}
		ctx, cancel := context.WithTimeout(t.Context(), 50*time.Millisecond)
		late := servicebus.SettleByToken(ctx, f, msg, release)
		cancel()
		stop()
		<-ran
		after := servicebus.SettleByToken(t.Context(), f, msg, release)
		for name, err := range map[string]error{"unanswered": late, "after Run ended": after} {
			if err == nil || !strings.HasPrefix(err.Error(), "driver: settling as modify: ") {
				t.Errorf("%s: %v, want the answer of an abandon (driver.SentAs(driver.Modify, …))", name, err)
			}
		}
		accept := servicebus.SettleByToken(t.Context(), f, msg, driver.Outcome{Kind: driver.Accept})
		if accept == nil || strings.HasPrefix(accept.Error(), "driver: settling as") {
			t.Errorf("an accept after Run ended: %v, want the plain refusal", accept)
		}
	})
}
