package servicebus

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/Azure/go-amqp"
	"go.uber.org/zap"

	"github.com/amqpsub/amqpsub/internal/backoff"
	"github.com/amqpsub/amqpsub/internal/driver"
	"github.com/amqpsub/amqpsub/internal/fake"
	"github.com/amqpsub/amqpsub/internal/pump"
)

// testEnv is a pipe's environment over a real pump, for a queue without
// sessions: what the pipe calls of it that a test needs. Any other call
// panics on the nil PipeEnv.
type testEnv struct {
	driver.PipeEnv
	opt  Options
	pump *pump.Pump
}

func (e *testEnv) Config() driver.PipeConfig {
	return driver.PipeConfig{Queue: "q", Address: "q", Credit: 8, DialTimeout: time.Second, CloseTimeout: time.Second, Options: e.opt}
}
func (e *testEnv) Log() *zap.Logger                        { return zap.NewNop() }
func (e *testEnv) OnRenewed() func(int)                    { return nil }
func (e *testEnv) Engine() driver.EngineEnv                { return e.pump }
func (e *testEnv) Current() (driver.Link, <-chan struct{}) { return nil, nil }

// pumpedPipe is a Service Bus pipe of opt over a pump that receives from
// src until the test ends.
func pumpedPipe(t *testing.T, opt Options, src driver.Source) (*pipe, *pump.Pump) {
	t.Helper()
	env := &testEnv{opt: opt}
	k := newPipe(env)
	e := k.Engine()
	env.pump = pump.New(pump.Config{Credit: 8, Logger: zap.NewNop(), Leases: e.Leases, Settlers: e.Settlers,
		SettleTimeout: e.SettleTimeout, LeasesOutliveLinks: e.LeasesOutliveLinks, DropBufferedOn: e.DropBufferedOn})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = env.pump.Run(ctx, func(context.Context, error) (driver.Source, error) { return src, nil })
	}()
	t.Cleanup(func() { cancel(); <-done })
	return k, env.pump
}

// A handler whose delivery's lock was lost between the lane's Begin and the
// binding of its context (the book has let go of the delivery) gets a
// context cancelled with ErrLockLost at once, as it would have a moment
// later, rather than one never cancelled.
func TestLeasedContextOfADeliveryOutOfTheBook(t *testing.T) {
	src := fake.New(false, &amqp.Message{Properties: &amqp.MessageProperties{MessageID: "m"}})
	k, p := pumpedPipe(t, DefaultOptions(), src)
	tk := <-p.Out()
	tk.Begin()
	hctx, release := k.HandlerContext(context.Background(), tk)
	if hctx.Err() != nil {
		t.Fatalf("a delivery in the book got a cancelled context: %v", context.Cause(hctx))
	}
	release()
	k.book.Remove(tk.Entry()) // what losing its lock does
	hctx, release = k.HandlerContext(context.Background(), tk)
	defer release()
	if !errors.Is(context.Cause(hctx), ErrLockLost) {
		t.Fatalf("context of a delivery out of the book: cause %v, want ErrLockLost", context.Cause(hctx))
	}
	p.Settle(tk, driver.Outcome{Kind: driver.Accept})
}

// What the pipe adds to the engine: settlers bounded by the credit, a
// lease book, and, without sessions, leases that outlive their links and
// a drop of what is buffered when the connection is lost.
func TestPipeEngine(t *testing.T) {
	for _, tc := range []struct {
		name     string
		sessions bool
	}{{"queue", false}, {"sessions", true}} {
		t.Run(tc.name, func(t *testing.T) {
			opt := DefaultOptions()
			opt.Sessions = tc.sessions
			e := newPipe(&testEnv{opt: opt}).Engine()
			if e.Leases == nil || e.Settlers != 8 || e.SettleTimeout != 30*time.Second {
				t.Fatalf("engine %+v: want a lease book, 8 settlers (the credit) and a 30 s settle timeout", e)
			}
			if e.LeasesOutliveLinks == tc.sessions || (e.DropBufferedOn != nil) == tc.sessions {
				t.Fatalf("sessions %v: LeasesOutliveLinks %v, DropBufferedOn set %v; want both %v",
					tc.sessions, e.LeasesOutliveLinks, e.DropBufferedOn != nil, !tc.sessions)
			}
			if !tc.sessions && (!e.DropBufferedOn(&amqp.ConnError{}) || e.DropBufferedOn(&amqp.LinkError{})) {
				t.Fatal("DropBufferedOn: want a lost connection only")
			}
		})
	}
}

// Which lost links Service Bus attaches again on their connection: link
// and session ends, and refusals of such an attach, but not a lost
// connection nor what azservicebus recovers with a new one; a link
// detached for its token only once fresh tokens are on the connection.
func TestServiceBusReattachOn(t *testing.T) {
	k := newPipe(&testEnv{opt: DefaultOptions()})
	detached := func(c amqp.ErrCond) error { return &amqp.LinkError{RemoteErr: &amqp.Error{Condition: c}} }
	errPut := errors.New("put-token: no answer")
	var reclaims int
	reclaim := func(err error) func(context.Context) error {
		return func(context.Context) error { reclaims++; return err }
	}
	for _, tc := range []struct {
		name    string
		lost    error
		refused bool
		reclaim func(context.Context) error
		want    bool
		claims  int
	}{
		{"forced detach", detached(amqp.ErrCondDetachForced), false, nil, true, 0},
		{"closed here", &amqp.LinkError{}, false, nil, true, 0},
		{"session ended", &amqp.SessionError{}, false, nil, true, 0},
		{"connection lost", &amqp.ConnError{}, false, nil, false, 0},
		{"connection forced", detached(amqp.ErrCondConnectionForced), false, nil, false, 0},
		{"internal error", detached(amqp.ErrCondInternalError), false, nil, false, 0},
		{"a link the pump gave up (IssueCredit refused)", errors.New("pump: issue credit: draining"), false, nil, true, 0},
		{"an attach that failed unanswered", context.DeadlineExceeded, true, nil, false, 0},
		{"attach refused", &amqp.Error{Condition: amqp.ErrCondDetachForced}, true, nil, true, 0},
		{"attach refused for the token", &amqp.Error{Condition: amqp.ErrCondUnauthorizedAccess}, true, reclaim(nil), false, 0},
		{"detached for the token, no refresher", detached(amqp.ErrCondUnauthorizedAccess), false, nil, false, 0},
		{"detached for the token, fresh tokens put", detached(amqp.ErrCondUnauthorizedAccess), false, reclaim(nil), true, 1},
		{"detached for the token, put fails", detached(amqp.ErrCondUnauthorizedAccess), false, reclaim(errPut), false, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			reclaims = 0
			if got := k.ReattachOn(t.Context(), tc.reclaim, tc.lost, tc.refused); got != tc.want || reclaims != tc.claims {
				t.Fatalf("ReattachOn(%v, refused %v) = %v with %d put-token rounds; want %v, %d", tc.lost, tc.refused, got, reclaims, tc.want, tc.claims)
			}
		})
	}
	if (driver.Base{}).ReattachOn(t.Context(), nil, detached(amqp.ErrCondDetachForced), false) {
		t.Fatal("driver.Base reattaches on the connection")
	}
}

// A session consumer reads the service's "no session free" and "session
// held" answers as waits; a consumer without sessions reads neither.
func TestServiceBusRefused(t *testing.T) {
	timeout := &amqp.Error{Condition: CondTimeout}
	held := &amqp.Error{Condition: CondSessionCannotBeLocked}
	plain := newPipe(&testEnv{opt: DefaultOptions()})
	opt := DefaultOptions()
	opt.Sessions = true
	sess := newPipe(&testEnv{opt: opt})
	for _, err := range []error{timeout, held} {
		if r, _ := plain.Refused(err, 0); r != driver.RefusedNot {
			t.Errorf("without sessions, %v read as %v", err, r)
		}
	}
	if r, _ := sess.Refused(timeout, 0); r != driver.RefusedNoneFree {
		t.Errorf("timeout read as %v, want RefusedNoneFree", r)
	}
	c := backoff.Ceiling(3, sessionLockedFloor, sessionLockedMax)
	if r, w := sess.Refused(held, 3); r != driver.RefusedHeld || w < c/2 || w > c {
		t.Errorf("session held read as %v after %v, want RefusedHeld after %v to %v (SessionLockedWait(3))", r, w, c/2, c)
	}
}
