package amqpsub

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"testing/synctest"
	"time"

	"github.com/amqpsub/amqpsub/internal/wire"
)

// The order of a DialFailover pass, its per-address timeout, and where it
// stops, with a scripted dial in place of the network: each address
// answers ("ok"), refuses at once ("refused"), never answers ("silent") or
// refuses the credentials ("fatal").
func TestFailoverPass(t *testing.T) {
	const timeout = 3 * time.Second
	refused := errors.New("connection refused")
	authRefused := &wire.SASLError{Code: wire.SASLAuth}
	for _, tc := range []struct {
		name   string
		script []string
		from   int
		noWrap bool          // the first attach's passes
		tried  string        // the indices dialed, in order
		got    int           // the index connected to; -1 for none
		took   time.Duration // how long the pass took
		text   []string      // in the error
	}{
		{name: "the first answers", script: []string{"ok", "ok", "ok"}, tried: "[0]", got: 0},
		{name: "after a loss on the first, the second", script: []string{"ok", "ok", "ok"}, from: 1, tried: "[1]", got: 1},
		{name: "after a loss on the last, the first", script: []string{"ok", "ok", "ok"}, from: 3, tried: "[0]", got: 0},
		{name: "a refusal moves on at once", script: []string{"refused", "ok", "ok"}, tried: "[0 1]", got: 1},
		{name: "round the end of the list", script: []string{"ok", "refused", "refused"}, from: 1, tried: "[1 2 0]", got: 0},
		{name: "each silent address has its own timeout", script: []string{"silent", "silent", "ok"},
			tried: "[0 1 2]", got: 2, took: 2 * timeout},
		{name: "none answers", script: []string{"refused", "silent", "refused"}, from: 1, tried: "[1 2 0]", got: -1, took: timeout,
			text: []string{"amqp://h1:5672: context deadline exceeded", "amqp://h2:5672: connection refused", "amqp://alice@h0:5672: connection refused"}},
		{name: "a fatal error ends the pass", script: []string{"refused", "fatal", "ok"}, tried: "[0 1]", got: -1,
			text: []string{"amqp://alice@h0:5672: connection refused; amqp://h1:5672: sasl: authentication refused", "(1 more not tried)"}},
		{name: "on the first attach, no wrap round to the addresses tried", script: []string{"ok", "refused", "refused"}, from: 1, noWrap: true,
			tried: "[1 2]", got: -1, text: []string{"amqp://h1:5672: connection refused; amqp://h2:5672: connection refused"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				urls := make([]string, len(tc.script))
				for i := range urls {
					urls[i] = fmt.Sprintf("amqp://h%d:5672", i)
				}
				urls[0] = "amqp://alice:s3cr3t@h0:5672"
				c, err := DialFailover(urls, nil)
				if err != nil {
					t.Fatal(err)
				}
				f := c.(*failover)
				var tried []int
				f.dial = func(ctx context.Context, i int, _ connectRequest) (*connection, error) {
					tried = append(tried, i)
					if dl, ok := ctx.Deadline(); !ok || dl != time.Now().Add(timeout) {
						t.Errorf("address %d: deadline %v, want DialTimeout from now", i, dl)
					}
					switch tc.script[i] {
					case "ok":
						return &connection{owned: true}, nil
					case "refused":
						return nil, refused
					case "fatal":
						return nil, authRefused
					}
					<-ctx.Done()
					return nil, ctx.Err()
				}
				start := time.Now()
				conn, by, err := f.pass(context.Background(), connectRequest{from: tc.from, noWrap: tc.noWrap, timeout: timeout, fatal: IsFatal})
				if got := fmt.Sprint(tried); got != tc.tried {
					t.Errorf("tried %s, want %s", got, tc.tried)
				}
				if d := time.Since(start); d != tc.took {
					t.Errorf("the pass took %v, want %v", d, tc.took)
				}
				if tc.got < 0 {
					if err == nil {
						t.Fatalf("connected to %s", conn.addr)
					}
					for _, want := range tc.text {
						if !strings.Contains(err.Error(), want) {
							t.Errorf("error %q does not say %q", err, want)
						}
					}
					if strings.Contains(err.Error(), "s3cr3t") {
						t.Errorf("error %q holds the password", err)
					}
					// Every cause is wrapped; a fatal one still reads as fatal.
					if !errors.Is(err, refused) || IsFatal(err) != strings.Contains(strings.Join(tc.script, " "), "fatal") {
						t.Errorf("errors.Is(refused) %v, IsFatal %v: %v", errors.Is(err, refused), IsFatal(err), err)
					}
					return
				}
				if err != nil {
					t.Fatal(err)
				}
				if conn.index != tc.got || conn.addr != f.addrs[tc.got].String() {
					t.Errorf("connected to %d (%s), want %d", conn.index, conn.addr, tc.got)
				}
				// The session and link get what is left of the DialTimeout
				// of the address that answered.
				if want := time.Now().Add(timeout); by != want {
					t.Errorf("by %v, want %v", by, want)
				}
			})
		})
	}
}

// A pass ends when its ctx does (Run stopping), the addresses after the one
// in hand untried.
func TestFailoverPassEndsWithItsContext(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		c, _ := DialFailover([]string{"amqp://h0", "amqp://h1", "amqp://h2"}, nil)
		f := c.(*failover)
		var tried []int
		f.dial = func(ctx context.Context, i int, _ connectRequest) (*connection, error) {
			tried = append(tried, i)
			<-ctx.Done()
			return nil, ctx.Err()
		}
		ctx, cancel := context.WithTimeout(context.Background(), 1500*time.Millisecond)
		defer cancel()
		_, _, err := f.pass(ctx, connectRequest{timeout: time.Second})
		if fmt.Sprint(tried) != "[0 1]" || !errors.Is(err, context.Canceled) && !errors.Is(err, context.DeadlineExceeded) ||
			!strings.Contains(err.Error(), "(1 more not tried)") {
			t.Fatalf("tried %v: %v", tried, err)
		}
	})
}
