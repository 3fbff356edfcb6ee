package amqpsub_test

import (
	"context"
	"errors"
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/Azure/go-amqp"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/amqpsub/amqpsub/amqpsub"
	"github.com/amqpsub/amqpsub/amqpsubtest"
	"github.com/amqpsub/amqpsub/internal/fake"
)

// logLine is a log line as docs/logging.md lists it, or as the code writes
// it.
type logLine struct {
	level   string   // debug, info, warn, error
	limited bool     // written through a loglimit.Logger
	fields  []string // sorted; queue (on every line) left out
	where   string
}

// documented returns the lines of docs/logging.md's tables, by message.
func documented(t *testing.T) map[string]logLine {
	t.Helper()
	b, err := os.ReadFile("../docs/logging.md")
	if err != nil {
		t.Fatal(err)
	}
	lines := map[string]logLine{}
	for n, row := range strings.Split(string(b), "\n") {
		cells := strings.Split(row, "|")
		if len(cells) < 5 || !strings.HasPrefix(row, "| ") {
			continue
		}
		cells = cells[1 : len(cells)-1]
		level, limit, _ := strings.Cut(strings.TrimSpace(cells[0]), ",")
		msg := strings.TrimSpace(cells[1])
		if !slices.Contains([]string{"debug", "info", "warn", "error"}, level) ||
			len(msg) < 2 || msg[0] != '`' || msg[len(msg)-1] != '`' {
			continue // another table's row
		}
		msg = msg[1 : len(msg)-1]
		l := logLine{level: level, limited: strings.TrimSpace(limit) == "limited", where: fmt.Sprintf("docs/logging.md:%d", n+1)}
		for f := range strings.SplitSeq(cells[2], ",") {
			if f = strings.Trim(strings.TrimSpace(f), "`"); f != "" {
				l.fields = append(l.fields, f)
			}
		}
		slices.Sort(l.fields)
		if old, dup := lines[msg]; dup {
			t.Errorf("%s: %q listed twice (also %s)", l.where, msg, old.where)
		}
		lines[msg] = l
	}
	if len(lines) < 20 {
		t.Fatalf("only %d lines found in docs/logging.md's tables", len(lines))
	}
	return lines
}

// written returns the log lines the library's code writes, by message: the
// calls Debug, Info, Warn and Error with a constant message, found in the
// non-test Go files. Their fields are read off the call: zap.X("name", …),
// zap.Error (error), and the spread s.fields(d, err, more...) (the
// delivery's fields). Anything else fails the test, so that every line
// stays readable here.
func written(t *testing.T) map[string]logLine {
	t.Helper()
	lines := map[string]logLine{}
	fset := token.NewFileSet()
	for _, root := range []string{"../amqpsub", "../internal", "../amqpsubtest"} {
		err := filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
			if err != nil || d.IsDir() || !strings.HasSuffix(path, ".go") || strings.HasSuffix(path, "_test.go") {
				return err
			}
			f, err := parser.ParseFile(fset, path, nil, 0)
			if err != nil {
				return err
			}
			ast.Inspect(f, func(n ast.Node) bool {
				call, ok := n.(*ast.CallExpr)
				if !ok {
					return true
				}
				sel, ok := call.Fun.(*ast.SelectorExpr)
				if !ok || len(call.Args) == 0 || isIdent(sel.X, "zap") {
					return true
				}
				// zap's methods are exported: req.fatal(err) is no log line.
				level := strings.ToLower(sel.Sel.Name)
				switch sel.Sel.Name {
				case "Debug", "Info", "Warn", "Error":
				case "DPanic", "Panic", "Fatal":
					t.Errorf("%s: %s: the library never panics or exits through its logger", fset.Position(call.Pos()), sel.Sel.Name)
					return true
				default:
					return true
				}
				where := fset.Position(call.Pos()).String()
				lit, ok := call.Args[0].(*ast.BasicLit)
				if !ok || lit.Kind != token.STRING {
					t.Errorf("%s: a log message must be constant text", where)
					return true
				}
				msg, _ := strconv.Unquote(lit.Value)
				l := logLine{level: level, limited: isIdent(lastName(sel.X), "limited"), where: where}
				for _, a := range call.Args[1:] {
					names, ok := fieldNames(a)
					if !ok {
						t.Errorf("%s: %q: a field this test cannot read: use zap.X(\"name\", …) or s.fields", where, msg)
					}
					l.fields = append(l.fields, names...)
				}
				if l.limited {
					l.fields = append(l.fields, "suppressed")
				}
				slices.Sort(l.fields)
				if old, dup := lines[msg]; dup {
					t.Errorf("%s: the message %q is also written at %s: give each line its own", where, msg, old.where)
				}
				lines[msg] = l
				return true
			})
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	return lines
}

func isIdent(e ast.Expr, name string) bool {
	id, ok := e.(*ast.Ident)
	return ok && id.Name == name
}

// lastName returns the last name of a selector chain (limited in
// p.s.limited), or e itself.
func lastName(e ast.Expr) ast.Expr {
	if sel, ok := e.(*ast.SelectorExpr); ok {
		return sel.Sel
	}
	return e
}

// fieldNames returns the names of the fields a log call's argument adds.
func fieldNames(a ast.Expr) ([]string, bool) {
	call, ok := a.(*ast.CallExpr)
	if !ok {
		return nil, false
	}
	sel, ok := call.Fun.(*ast.SelectorExpr)
	if !ok {
		return nil, false
	}
	switch {
	case isIdent(sel.X, "zap") && sel.Sel.Name == "Error":
		return []string{"error"}, true
	case isIdent(sel.X, "zap") && len(call.Args) > 0:
		lit, ok := call.Args[0].(*ast.BasicLit)
		if !ok || lit.Kind != token.STRING {
			return nil, false
		}
		name, _ := strconv.Unquote(lit.Value)
		return []string{name}, true
	case sel.Sel.Name == "fields" && len(call.Args) >= 2:
		names := []string{"message_id", "group_id", "delivery_count", "lane"}
		if !isIdent(call.Args[1], "nil") {
			names = append(names, "error")
		}
		for _, m := range call.Args[2:] {
			more, ok := fieldNames(m)
			if !ok {
				return nil, false
			}
			names = append(names, more...)
		}
		return names, true
	}
	return nil, false
}

// Every log line the code writes is in docs/logging.md with its level and
// fields, and every line there is written.
func TestLogLinesDocumented(t *testing.T) {
	doc, code := documented(t), written(t)
	for msg, c := range code {
		d, ok := doc[msg]
		switch {
		case !ok:
			t.Errorf("%s: %s %q is not in docs/logging.md", c.where, c.level, msg)
		case d.level != c.level || d.limited != c.limited:
			t.Errorf("%s: %q is %s (limited %v), docs/logging.md says %s (limited %v)", c.where, msg, c.level, c.limited, d.level, d.limited)
		case !slices.Equal(d.fields, c.fields):
			t.Errorf("%s: %q has fields %v, %s says %v", c.where, msg, c.fields, d.where, d.fields)
		}
	}
	for msg, d := range doc {
		if _, ok := code[msg]; !ok {
			t.Errorf("%s: %q is not written anywhere", d.where, msg)
		}
	}
}

// checkEntries checks logged entries against the doc: each message is
// listed, at its level (a limited line also at debug), with listed fields
// only, and carries queue.
func checkEntries(t *testing.T, doc map[string]logLine, entries []observer.LoggedEntry) {
	t.Helper()
	for _, e := range entries {
		d, ok := doc[e.Message]
		if !ok {
			t.Errorf("%s %q: not in docs/logging.md", e.Level, e.Message)
			continue
		}
		if e.Level.String() != d.level && (!d.limited || e.Level != zapcore.DebugLevel) {
			t.Errorf("%q logged at %s, docs/logging.md says %s", e.Message, e.Level, d.level)
		}
		fields := e.ContextMap()
		if fields["queue"] != "orders" {
			t.Errorf("%q: queue=%v", e.Message, fields["queue"])
		}
		for k := range fields {
			switch {
			case k == "queue":
			case (k == "errorVerbose" || k == "errorCauses") && slices.Contains(d.fields, "error"):
			case !slices.Contains(d.fields, k):
				t.Errorf("%q has field %s, not in docs/logging.md (%v)", e.Message, k, d.fields)
			}
		}
	}
}

// aboveDebug returns the entries above debug level.
func aboveDebug(entries []observer.LoggedEntry) []observer.LoggedEntry {
	var out []observer.LoggedEntry
	for _, e := range entries {
		if e.Level > zapcore.DebugLevel {
			out = append(out, e)
		}
	}
	return out
}

// deliveryLogs runs a subscriber over n messages on an amqpsubtest queue:
// every tenth rejected, failing on every delivery (retried in the lane,
// then by the broker, then poison), panicking on every delivery, released
// once, retried once, or too large; the rest accepted. It returns every
// entry logged, at debug and above.
func deliveryLogs(t *testing.T, n int) ([]observer.LoggedEntry, amqpsub.Stats) {
	var entries []observer.LoggedEntry
	var st amqpsub.Stats
	synctest.Test(t, func(t *testing.T) {
		core, logs := observer.New(zapcore.DebugLevel)
		q := amqpsubtest.NewQueue(amqpsubtest.MaxDeliveryAttempts(5))
		for i := range n {
			body := strconv.Itoa(i)
			if i%10 == 6 {
				body += strings.Repeat(" ", 100) // past MaxMessageSize
			}
			q.Publish(amqpsubtest.Message(fmt.Sprintf("g%d", i%7), body))
		}
		var seen sync.Map
		h := amqpsub.HandlerFunc(func(_ context.Context, d *amqpsub.Delivery) error {
			body, err := d.Body()
			if err != nil {
				return err
			}
			i, err := strconv.Atoi(string(body))
			if err != nil {
				return err
			}
			_, again := seen.LoadOrStore(i, true)
			switch i % 10 {
			case 1:
				return amqpsub.Reject("malformed order")
			case 2:
				return errors.New("store down")
			case 3:
				panic("handler bug")
			case 4:
				if !again {
					return amqpsub.Release()
				}
			case 5:
				if !again {
					return amqpsub.Retry(errors.New("timeout"))
				}
			}
			return nil
		})
		sub, err := amqpsub.New(q.Connector(), "orders", h, amqpsub.Logger(zap.New(core)), amqpsub.WorkersByKey(4),
			amqpsub.LocalRetry(amqpsub.RetryPolicy{Attempts: 1, Initial: time.Millisecond}),
			amqpsub.MaxDeliveryCount(2), amqpsub.MaxMessageSize(64))
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithTimeout(context.Background(), time.Hour) // fake time
		defer cancel()
		if err := q.Drain(ctx, sub); err != nil {
			t.Fatal(err)
		}
		entries, st = logs.AllUntimed(), sub.Stats()
	})
	return entries, st
}

// The lines above debug do not grow with the deliveries: a run of 1,000
// deliveries with failures of every kind logs the same lines above debug as
// a run of 100, a handful, while debug has a line for each failure and
// Stats counts every one.
func TestLogsDoNotGrowWithDeliveries(t *testing.T) {
	doc := documented(t)
	var above [2][]string
	for i, n := range []int{100, 1000} {
		entries, st := deliveryLogs(t, n)
		checkEntries(t, doc, entries)
		for _, e := range aboveDebug(entries) {
			above[i] = append(above[i], e.Level.String()+" "+e.Message)
		}
		slices.Sort(above[i])
		failures := 0
		for _, e := range entries {
			if e.Message == "handler failed; the delivery goes back to the broker as a failed attempt" {
				failures++
			}
		}
		// Per delivery: a tenth fail 3 times at the broker, a tenth retry once.
		if failures < n/10*3 || st.Results.Panics < uint64(n/10*3) || st.Results.Poisoned < uint64(n/10*2) || st.Results.Oversize != uint64(n/10) {
			t.Errorf("%d deliveries: %d failures at debug; stats %v", n, failures, st)
		}
		t.Logf("%d messages: %d entries, %d above debug: %q", n, len(entries), len(above[i]), above[i])
	}
	if !slices.Equal(above[0], above[1]) {
		t.Errorf("above debug, 100 messages logged %q\n1,000 logged %q", above[0], above[1])
	}
	// Each limited line twice: its first, and its count at the stop.
	want := []string{
		"error handler panicked; retrying the delivery",
		"error handler panicked; retrying the delivery",
		"info attached",
		"info stopped",
		"info stopping",
		"warn delivery count past MaxDeliveryCount; dead-lettering it unhandled",
		"warn delivery count past MaxDeliveryCount; dead-lettering it unhandled",
		"warn message larger than MaxMessageSize; dead-lettering it unhandled",
		"warn message larger than MaxMessageSize; dead-lettering it unhandled",
	}
	if !slices.Equal(above[1], want) {
		t.Errorf("above debug: %q, want %q", above[1], want)
	}
}

// lifecycle returns the messages of the entries above debug, in order.
func lifecycle(entries []observer.LoggedEntry) []string {
	var out []string
	for _, e := range aboveDebug(entries) {
		out = append(out, e.Message)
	}
	return out
}

// find returns the entries of msg.
func find(entries []observer.LoggedEntry, msg string) []map[string]any {
	var out []map[string]any
	for _, e := range entries {
		if e.Message == msg {
			out = append(out, e.ContextMap())
		}
	}
	return out
}

// A lost link, failed reconnects, a reconnect and a stop: one line each,
// with the documented fields.
func TestLifecycleLogLines(t *testing.T) {
	doc := documented(t)
	accept := amqpsub.HandlerFunc(func(context.Context, *amqpsub.Delivery) error { return nil })
	publish := func(q *amqpsubtest.Queue, n int) {
		for i := range n {
			q.Publish(amqpsubtest.Message("g", strconv.Itoa(i)))
		}
	}

	t.Run("reconnect", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			core, logs := observer.New(zapcore.DebugLevel)
			q := amqpsubtest.NewQueue()
			publish(q, 10)
			sub, _ := amqpsub.New(q.Connector(), "orders", accept, amqpsub.Logger(zap.New(core)),
				amqpsub.Backoff(time.Millisecond, 10*time.Millisecond), amqpsub.Credit(8))
			ctx, cancel := context.WithCancel(context.Background())
			errc := make(chan error, 1)
			go func() { errc <- sub.Run(ctx) }()
			if err := q.Wait(ctx); err != nil {
				t.Fatal(err)
			}
			refused := errors.New("broker restarting")
			q.RefuseAttach(refused)
			q.LoseLinks(nil)
			for logs.FilterMessage("reconnect failed; trying again").Len() < 3 {
				time.Sleep(time.Millisecond)
			}
			q.RefuseAttach(nil)
			publish(q, 10)
			if err := q.Wait(ctx); err != nil {
				t.Fatal(err)
			}
			cancel()
			if err := <-errc; err != nil {
				t.Fatal(err)
			}
			entries := logs.AllUntimed()
			checkEntries(t, doc, entries)
			failed := find(entries, "reconnect failed; trying again")
			got := strings.Join(lifecycle(entries), " | ")
			want := "attached | link lost | " + strings.Repeat("reconnect failed; trying again | ", len(failed)) +
				"attached | reconnected | stopping | stopped"
			if got != want {
				t.Fatalf("lines above debug:\n%s\nwant\n%s", got, want)
			}
			for i, f := range failed {
				if f["attempt"] != int64(i+1) || f["error"] != refused.Error() || f["wait"] == nil {
					t.Errorf("reconnect failure %d: %v", i+1, f)
				}
			}
			a := find(entries, "attached")[0]
			if a["broker"] != "amqpsubtest" || a["address"] != "orders" || a["credit"] != int64(8) || a["profile"] != "artemis" {
				t.Errorf("attached: %v", a)
			}
			r := find(entries, "reconnected")[0]
			if r["attempt"] != int64(len(failed)+1) || !strings.Contains(r["error"].(string), "link lost") {
				t.Errorf("reconnected: %v", r)
			}
			if l := find(entries, "link lost")[0]; !strings.Contains(l["error"].(string), "link lost") {
				t.Errorf("link lost: %v", l)
			}
			if s := find(entries, "stopping")[0]; s["reason"] != "context" || s["grace"] != 30*time.Second {
				t.Errorf("stopping: %v", s)
			}
			s := find(entries, "stopped")[0]
			if st, ok := s["stats"].(map[string]any); !ok || st["accepted"] != uint64(20) || st["reconnects"] != uint64(1) {
				t.Errorf("stopped: %v", s)
			}
			if _, ok := s["error"]; ok {
				t.Errorf("stopped after a clean stop: %v", s)
			}
		})
	})

	t.Run("fatal", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			core, logs := observer.New(zapcore.DebugLevel)
			q := amqpsubtest.NewQueue()
			publish(q, 5)
			sub, _ := amqpsub.New(q.Connector(), "orders", accept, amqpsub.Logger(zap.New(core)),
				amqpsub.Backoff(time.Millisecond, time.Millisecond))
			errc := make(chan error, 1)
			go func() { errc <- sub.Run(context.Background()) }()
			if err := q.Wait(t.Context()); err != nil {
				t.Fatal(err)
			}
			q.RefuseAttach(&amqp.Error{Condition: amqp.ErrCondUnauthorizedAccess, Description: "token expired"})
			q.LoseLinks(nil)
			if err := <-errc; !errors.Is(err, amqpsub.ErrLinkLost) {
				t.Fatalf("Run = %v, want ErrLinkLost", err)
			}
			entries := logs.AllUntimed()
			checkEntries(t, doc, entries)
			if got := strings.Join(lifecycle(entries), " | "); got != "attached | link lost | stopping after a fatal error | stopped" {
				t.Fatalf("lines above debug: %s", got)
			}
			if f := find(entries, "stopping after a fatal error")[0]; !strings.Contains(f["error"].(string), "token expired") {
				t.Errorf("fatal: %v", f)
			}
			if s := find(entries, "stopped")[0]; !strings.Contains(s["error"].(string), "token expired") {
				t.Errorf("stopped: %v", s)
			}
		})
	})

	t.Run("abandoned", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			core, logs := observer.New(zapcore.DebugLevel)
			q := amqpsubtest.NewQueue()
			publish(q, 5)
			release, in := make(chan struct{}), make(chan struct{}, 5)
			stuck := amqpsub.HandlerFunc(func(context.Context, *amqpsub.Delivery) error {
				in <- struct{}{}
				<-release // ignores its ctx
				return nil
			})
			sub, _ := amqpsub.New(q.Connector(), "orders", stuck, amqpsub.Logger(zap.New(core)), amqpsub.Workers(2),
				amqpsub.GracePeriod(time.Second), amqpsub.CloseTimeout(time.Second))
			errc := make(chan error, 1)
			go func() { errc <- sub.Run(context.Background()) }()
			<-in
			<-in
			go func() { _ = sub.Shutdown(context.Background()) }()
			if err := <-errc; !errors.Is(err, amqpsub.ErrAbandoned) {
				t.Fatalf("Run = %v, want ErrAbandoned", err)
			}
			close(release)
			synctest.Wait()
			entries := logs.AllUntimed()
			checkEntries(t, doc, entries)
			want := "attached | stopping | grace period over; cancelling the handlers still running, the broker redelivers what they hold | " +
				"handlers abandoned: they did not return after their context was cancelled; the broker redelivers their deliveries | stopped"
			if got := strings.Join(lifecycle(entries), " | "); got != want {
				t.Fatalf("lines above debug:\n%s\nwant\n%s", got, want)
			}
			if a := find(entries, "handlers abandoned: they did not return after their context was cancelled; the broker redelivers their deliveries")[0]; a["count"] != int64(2) {
				t.Errorf("abandoned: %v", a)
			}
			if s := find(entries, "stopping")[0]; s["reason"] != "shutdown" {
				t.Errorf("stopping: %v", s)
			}
			if n, m := len(find(entries, "handler abandoned")), len(find(entries, "result of an abandoned handler ignored")); n != 2 || m != 2 {
				t.Errorf("at debug: %d handlers abandoned, %d results ignored; want 2 each", n, m)
			}
		})
	})

	// The fake source sends past its credit, as RabbitMQ 3.10 does; the
	// connector's address holds a password, which no line may show.
	t.Run("overshoot and close", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			core, logs := observer.New(zapcore.DebugLevel)
			src := fake.New(true, fake.Messages(40, "a", "b")...)
			src.Overshoot(3)
			// The handler holds its delivery until the stop, so that no
			// credit is granted back before the source has sent its 4 and
			// the 3 past them: the overshoot is seen, whatever the order
			// the goroutines run in.
			hold := amqpsub.HandlerFunc(func(ctx context.Context, _ *amqpsub.Delivery) error {
				<-ctx.Done()
				return ctx.Err()
			})
			sub, _ := amqpsub.New(amqpsub.SourceFor(amqpsub.Dial("amqp://app:s3cret@127.0.0.1:1", nil), src), "orders", hold,
				amqpsub.Logger(zap.New(core)), amqpsub.Credit(4))
			errc := make(chan error, 1)
			go func() { errc <- sub.Run(context.Background()) }()
			synctest.Wait()
			_ = sub.Close()
			if err := <-errc; err != nil {
				t.Fatal(err)
			}
			entries := logs.AllUntimed()
			checkEntries(t, doc, entries)
			want := "attached | broker sent past the credit it was given; granting in windows from now on | stopping | stopped"
			if got := strings.Join(lifecycle(entries), " | "); got != want {
				t.Fatalf("lines above debug:\n%s\nwant\n%s", got, want)
			}
			if o := find(entries, "broker sent past the credit it was given; granting in windows from now on")[0]; o["credit"] != int64(4) {
				t.Errorf("overshoot: %v", o)
			}
			if s := find(entries, "stopping")[0]; s["reason"] != "close" || s["grace"] != time.Duration(0) {
				t.Errorf("stopping: %v", s)
			}
			if a := find(entries, "attached")[0]; a["broker"] != "amqp://app@127.0.0.1:1" {
				t.Errorf("attached: %v", a)
			}
			for _, e := range entries {
				if text := e.Message + fmt.Sprint(e.ContextMap()); strings.Contains(text, "s3cret") {
					t.Errorf("the password is in %s", text)
				}
			}
		})
	})
}

// A connection closed with a context that had already ended (a stop past
// its bound) has its socket closed at once, and "connection close took
// too long" is not said of it: the close took no time at all.
func TestLateCloseIsNotTooLong(t *testing.T) {
	p := newPeer(t, false)
	core, logs := observer.New(zapcore.DebugLevel)
	sub, err := amqpsub.New(amqpsub.Dial("amqp://"+p.addr(), nil), "orders",
		amqpsub.HandlerFunc(func(context.Context, *amqpsub.Delivery) error { return nil }), amqpsub.Logger(zap.New(core)))
	if err != nil {
		t.Fatal(err)
	}
	for range 5 {
		if err := amqpsub.AttachAndCloseLate(t.Context(), sub); err != nil {
			t.Fatal(err)
		}
	}
	if n := logs.FilterMessage("connection close took too long; closing its socket").Len(); n != 0 {
		t.Fatalf("%d closes whose context had ended logged as taking too long, want 0", n)
	}
	if n := p.accepted.Load(); n != 5 {
		t.Fatalf("%d connections, want 5", n)
	}
}

// A close that used up CloseTimeout on a peer that stopped answering did
// take too long, and says so (TestLateCloseIsNotTooLong is the other side:
// a close whose time had run out before it began).
func TestFrozenCloseSaysTooLong(t *testing.T) {
	p := newPeer(t, false)
	core, logs := observer.New(zapcore.DebugLevel)
	sub, err := amqpsub.New(amqpsub.Dial("amqp://"+p.addr(), nil), "orders",
		amqpsub.HandlerFunc(func(context.Context, *amqpsub.Delivery) error { return nil }),
		amqpsub.Logger(zap.New(core)), amqpsub.CloseTimeout(300*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(t.Context())
	errc := make(chan error, 1)
	go func() { errc <- sub.Run(ctx) }()
	<-p.attached
	p.mute.Store(true)
	cancel()
	if err := <-errc; err != nil {
		t.Fatalf("Run: %v", err)
	}
	if n := logs.FilterMessage("connection close took too long; closing its socket").Len(); n != 1 {
		t.Fatalf("%d lines say the close took too long, want 1", n)
	}
}

// Locks lost in a burst give one warning, the rest at debug; the count of
// those is said at the stop, where no later warning would carry it: every
// lost-lock line is counted by a line at its level.
func TestLostLockCountSaidAtTheStop(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		core, logs := observer.New(zapcore.DebugLevel)
		q := amqpsubtest.NewQueue(amqpsubtest.WithProfile(amqpsub.AzureServiceBus), amqpsubtest.LockDuration(5*time.Second))
		for i := range 20 {
			q.Publish(amqpsubtest.Message("", strconv.Itoa(i)))
		}
		// First deliveries outlive MaxLockRenewal, losing their locks all
		// at once; the redeliveries are handled.
		sub, err := amqpsub.New(q.Connector(), "orders", amqpsub.HandlerFunc(func(ctx context.Context, d *amqpsub.Delivery) error {
			if d.DeliveryCount() == 0 {
				<-ctx.Done()
			}
			return nil
		}), amqpsub.Logger(zap.New(core)), amqpsub.Workers(20), amqpsub.MaxLockRenewal(10*time.Second))
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithTimeout(context.Background(), time.Hour) // fake time
		defer cancel()
		if err := q.Drain(ctx, sub); err != nil {
			t.Fatal(err)
		}
		const msg = "message lock lost; the service delivers the message again"
		var atLevel, atDebug, counted int64
		for _, e := range logs.FilterMessage(msg).All() {
			if e.Level == zapcore.DebugLevel {
				atDebug++
				continue
			}
			atLevel++
			n, _ := e.ContextMap()["suppressed"].(int64)
			counted += n
		}
		st := sub.Stats()
		t.Logf("locks lost %d: %d warnings counting %d more, %d at debug", st.Locks.Lost, atLevel, counted, atDebug)
		if st.Locks.Lost < 20 || atDebug < 19 {
			t.Fatalf("%d locks lost, %d lines at debug: want 20 and 19 at least", st.Locks.Lost, atDebug)
		}
		if counted != atDebug {
			t.Fatalf("the warnings count %d lost locks written at debug, want all %d", counted, atDebug)
		}
		checkEntries(t, documented(t), logs.All())
	})
}
