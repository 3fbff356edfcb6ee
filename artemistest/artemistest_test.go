//go:build unix

package artemistest_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/Azure/go-amqp"
	"go.uber.org/goleak"

	"github.com/amqpsub/amqpsub/artemistest"
)

// These tests run the local-process path (Java 17+; the distribution in
// the cache dir, or Maven to fetch it). The container path is compiled
// (example_test.go) and its probe tested, but no container runs here.

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// sendReceive sends body to queue and receives it back with go-amqp.
func sendReceive(t *testing.T, url, queue, body string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	conn, err := amqp.Dial(ctx, url, nil)
	if err != nil {
		t.Fatalf("dial %s: %v", url, err)
	}
	defer conn.Close()
	sess, err := conn.NewSession(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	snd, err := sess.NewSender(ctx, queue, &amqp.SenderOptions{TargetCapabilities: []string{"queue"}})
	if err != nil {
		t.Fatal(err)
	}
	if err := snd.Send(ctx, amqp.NewMessage([]byte(body)), nil); err != nil {
		t.Fatal(err)
	}
	rcv, err := sess.NewReceiver(ctx, queue, &amqp.ReceiverOptions{SourceCapabilities: []string{"queue"}, Credit: 1})
	if err != nil {
		t.Fatal(err)
	}
	msg, err := rcv.Receive(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := rcv.AcceptMessage(ctx, msg); err != nil {
		t.Fatal(err)
	}
	if got := string(msg.GetData()); got != body {
		t.Fatalf("received %q, want %q", got, body)
	}
}

// checkGone checks what Stop promises: the process is gone, the port
// closed, the instance directory removed.
func checkGone(t *testing.T, pid int, addr, dir string) {
	t.Helper()
	if err := syscall.Kill(pid, 0); !errors.Is(err, syscall.ESRCH) {
		t.Errorf("pid %d after Stop: kill -0 gives %v, want ESRCH", pid, err)
	}
	if c, err := net.DialTimeout("tcp", addr, time.Second); err == nil {
		_ = c.Close()
		t.Errorf("%s still accepts after Stop", addr)
	}
	if _, err := os.Stat(dir); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("%s after Stop: %v, want it removed", dir, err)
	}
}

func TestLocal(t *testing.T) {
	// The options a user is most likely to set, at once: other
	// credentials, a smaller heap, a declared queue, and a broker.xml of
	// one's own (dead letters after the first failed delivery).
	xml := bytes.Replace(artemistest.DefaultBrokerXML(),
		[]byte("<max-delivery-attempts>5</max-delivery-attempts>"),
		[]byte("<max-delivery-attempts>1</max-delivery-attempts>"), 1)
	if bytes.Equal(xml, artemistest.DefaultBrokerXML()) {
		t.Fatal("DefaultBrokerXML has no max-delivery-attempts 5 to replace")
	}
	t0 := time.Now()
	b := artemistest.Start(t,
		artemistest.WithMode(artemistest.Local),
		artemistest.WithCredentials("tester", "s3cret.pw"),
		artemistest.WithHeap("256M"),
		artemistest.WithQueues("DLQ.declared"),
		artemistest.WithBrokerXML(xml),
		artemistest.WithStartTimeout(2*time.Minute),
		artemistest.WithStopTimeout(time.Minute))
	t.Logf("started in %v", time.Since(t0).Round(time.Millisecond))

	if b.Mode() != artemistest.Local {
		t.Errorf("Mode() = %v, want local", b.Mode())
	}
	if want := "amqp://tester:s3cret.pw@127.0.0.1:"; !strings.HasPrefix(b.URL(), want) {
		t.Errorf("URL() = %q, want prefix %q", b.URL(), want)
	}
	if b.User() != "tester" || b.Password() != "s3cret.pw" {
		t.Errorf("User(), Password() = %q, %q", b.User(), b.Password())
	}
	if b.Addr() == b.CoreAddr() {
		t.Errorf("Addr() and CoreAddr() are both %s", b.Addr())
	}
	if b.PID() <= 0 {
		t.Errorf("PID() = %d", b.PID())
	}

	t.Run("WithHeap applies", func(t *testing.T) {
		cmdline, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", b.PID()))
		if err != nil {
			t.Skipf("no /proc: %v", err)
		}
		args := strings.Split(string(cmdline), "\x00")
		last := ""
		for _, a := range args {
			if strings.HasPrefix(a, "-Xmx") {
				last = a
			}
		}
		if last != "-Xmx256M" {
			t.Errorf("the JVM's last -Xmx is %q, want -Xmx256M", last)
		}
	})

	t.Run("send and receive", func(t *testing.T) {
		sendReceive(t, b.URL(), "orders", "hello")
	})

	t.Run("wrong password refused", func(t *testing.T) {
		ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
		defer cancel()
		conn, err := amqp.Dial(ctx, "amqp://tester:wrong@"+b.Addr(), nil)
		if err == nil {
			_ = conn.Close()
			t.Fatal("a wrong password was accepted")
		}
		t.Logf("refused: %v", err)
	})

	t.Run("CORE acceptor speaks AMQP too", func(t *testing.T) {
		sendReceive(t, "amqp://tester:s3cret.pw@"+b.CoreAddr(), "core.queue", "via core")
	})

	t.Run("listens on 127.0.0.1 only", func(t *testing.T) {
		log, err := os.ReadFile(filepath.Join(b.Dir(), "log", "console.log"))
		if err != nil {
			t.Fatal(err)
		}
		for _, addr := range []string{b.Addr(), b.CoreAddr()} {
			if !bytes.Contains(log, []byte("Acceptor at "+addr+" ")) {
				t.Errorf("no acceptor at %s in the console log", addr)
			}
		}
		if n := bytes.Count(log, []byte("AMQ221020")); n != 2 {
			t.Errorf("%d acceptors started, want 2", n)
		}
	})

	t.Run("WithQueues declares", func(t *testing.T) {
		// Under DLQ.# broker.xml creates nothing on attach: a receiver
		// finds DLQ.declared only because WithQueues declared it.
		ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
		defer cancel()
		conn, err := amqp.Dial(ctx, b.URL(), nil)
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		for _, q := range []string{"DLQ.declared", "DLQ.undeclared"} {
			sess, err := conn.NewSession(ctx, nil)
			if err != nil {
				t.Fatal(err)
			}
			rcv, err := sess.NewReceiver(ctx, q, &amqp.ReceiverOptions{SourceCapabilities: []string{"queue"}})
			if q == "DLQ.declared" && err != nil {
				t.Errorf("attach to %s: %v", q, err)
			}
			if q == "DLQ.undeclared" && err == nil {
				t.Errorf("attach to %s succeeded; want amqp:not-found", q)
			}
			if err == nil {
				_ = rcv.Close(ctx)
			}
			_ = sess.Close(ctx)
		}
	})

	t.Run("WithBrokerXML applies", func(t *testing.T) {
		// max-delivery-attempts 1: one failed delivery dead-letters.
		ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
		defer cancel()
		conn, err := amqp.Dial(ctx, b.URL(), nil)
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		sess, err := conn.NewSession(ctx, nil)
		if err != nil {
			t.Fatal(err)
		}
		snd, err := sess.NewSender(ctx, "bxml", &amqp.SenderOptions{TargetCapabilities: []string{"queue"}})
		if err != nil {
			t.Fatal(err)
		}
		if err := snd.Send(ctx, amqp.NewMessage([]byte("poison")), nil); err != nil {
			t.Fatal(err)
		}
		rcv, err := sess.NewReceiver(ctx, "bxml", &amqp.ReceiverOptions{SourceCapabilities: []string{"queue"}, Credit: 1})
		if err != nil {
			t.Fatal(err)
		}
		msg, err := rcv.Receive(ctx, nil)
		if err != nil {
			t.Fatal(err)
		}
		if err := rcv.ModifyMessage(ctx, msg, &amqp.ModifyMessageOptions{DeliveryFailed: true}); err != nil {
			t.Fatal(err)
		}
		dlq, err := sess.NewReceiver(ctx, "DLQ::DLQ.bxml", &amqp.ReceiverOptions{SourceCapabilities: []string{"queue"}, Credit: 1})
		if err != nil {
			t.Fatalf("attach to DLQ::DLQ.bxml (no dead letter, so max-delivery-attempts is not 1?): %v", err)
		}
		dead, err := dlq.Receive(ctx, nil)
		if err != nil {
			t.Fatal(err)
		}
		_ = dlq.AcceptMessage(ctx, dead)
		if string(dead.GetData()) != "poison" {
			t.Errorf("dead letter %q", dead.GetData())
		}
	})

	// Stop, as Start's cleanup will (again: Stop is idempotent).
	pid, addr, dir := b.PID(), b.Addr(), b.Dir()
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	t1 := time.Now()
	if err := b.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	t.Logf("stopped in %v", time.Since(t1).Round(time.Millisecond))
	checkGone(t, pid, addr, dir)
	if err := b.Stop(ctx); err != nil {
		t.Errorf("second Stop: %v", err)
	}
}

// Mode Auto without a Docker engine runs a local process. DOCKER_HOST
// names a socket that does not exist, so this holds on a machine with
// Docker too.
func TestAutoFallsBackToLocal(t *testing.T) {
	t.Setenv("DOCKER_HOST", "unix://"+filepath.Join(t.TempDir(), "no-docker.sock"))
	var logs []string
	var mu sync.Mutex
	b := artemistest.Start(t, artemistest.WithLogf(func(format string, args ...any) {
		mu.Lock()
		defer mu.Unlock()
		logs = append(logs, fmt.Sprintf(format, args...))
		t.Logf(format, args...)
	}))
	if b.Mode() != artemistest.Local {
		t.Fatalf("Mode() = %v, want local", b.Mode())
	}
	mu.Lock()
	said := strings.Join(logs, "\n")
	mu.Unlock()
	if !strings.Contains(said, "no Docker engine") {
		t.Errorf("Run did not say why it runs a local process; it said:\n%s", said)
	}
	sendReceive(t, b.URL(), "auto", "fell back")
	// Start's cleanup stops it; TestLocal checks what Stop leaves.
}

// Mode Container without Docker fails fast with ErrNoDocker, also when
// something listens where DOCKER_HOST points but never answers.
func TestContainerWithoutDocker(t *testing.T) {
	silent := filepath.Join(t.TempDir(), "silent.sock")
	l, err := net.Listen("unix", silent)
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	var held []net.Conn // accepted and never answered
	wg.Go(func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			held = append(held, c)
		}
	})
	defer func() {
		_ = l.Close()
		wg.Wait()
		for _, c := range held {
			_ = c.Close()
		}
	}()

	for _, host := range []string{
		"unix://" + filepath.Join(t.TempDir(), "no-docker.sock"),
		"unix://" + silent,
	} {
		t.Run(filepath.Base(host), func(t *testing.T) {
			t.Setenv("DOCKER_HOST", host)
			t0 := time.Now()
			b, err := artemistest.Run(t.Context(), artemistest.WithMode(artemistest.Container))
			if !errors.Is(err, artemistest.ErrNoDocker) {
				if b != nil {
					_ = b.Stop(t.Context())
				}
				t.Fatalf("Run = %v, want ErrNoDocker", err)
			}
			if d := time.Since(t0); d > 5*time.Second {
				t.Errorf("took %v; the probe is bounded by 2 s", d)
			}
			t.Logf("%v (after %v)", err, time.Since(t0).Round(time.Millisecond))
		})
	}
}

// Two brokers started at once: distinct ports, processes and
// directories, both working.
func TestTwoBrokersInParallel(t *testing.T) {
	ctx, cancel := context.WithTimeout(t.Context(), 3*time.Minute)
	defer cancel()
	var (
		wg      sync.WaitGroup
		brokers [2]*artemistest.Broker
		errs    [2]error
	)
	for i := range brokers {
		wg.Go(func() {
			brokers[i], errs[i] = artemistest.Run(ctx, artemistest.WithMode(artemistest.Local), artemistest.WithLogf(t.Logf))
		})
	}
	wg.Wait()
	for _, b := range brokers {
		if b != nil {
			t.Cleanup(func() {
				ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
				defer cancel()
				if err := b.Stop(ctx); err != nil {
					t.Error(err)
				}
			})
		}
	}
	if err := errors.Join(errs[:]...); err != nil {
		t.Fatal(err)
	}
	a, b := brokers[0], brokers[1]
	seen := map[string]bool{}
	for _, addr := range []string{a.Addr(), a.CoreAddr(), b.Addr(), b.CoreAddr()} {
		if seen[addr] {
			t.Errorf("address %s given twice", addr)
		}
		seen[addr] = true
	}
	if a.PID() == b.PID() || a.Dir() == b.Dir() {
		t.Errorf("same PID (%d, %d) or directory (%s, %s)", a.PID(), b.PID(), a.Dir(), b.Dir())
	}
	sendReceive(t, a.URL(), "parallel", "to a")
	sendReceive(t, b.URL(), "parallel", "to b")
}

func TestInvalidOptions(t *testing.T) {
	for _, tc := range []struct {
		name string
		opt  artemistest.Option
	}{
		{"mode", artemistest.WithMode(artemistest.Mode(7))},
		{"version", artemistest.WithVersion("2.40")},
		{"version path", artemistest.WithVersion("../2.40.0")},
		{"image", artemistest.WithImage("apache/activemq-artemis: 2.40.0")},
		{"empty user", artemistest.WithCredentials("", "x")},
		{"password with space", artemistest.WithCredentials("u", "a b")},
		{"password with @", artemistest.WithCredentials("u", "a@b")},
		{"cache dir", artemistest.WithCacheDir("")},
		{"start timeout", artemistest.WithStartTimeout(0)},
		{"stop timeout", artemistest.WithStopTimeout(-time.Second)},
		{"heap", artemistest.WithHeap("512")},
		{"queue", artemistest.WithQueues("ok", "")},
		{"broker.xml without the port property", artemistest.WithBrokerXML([]byte("<core></core>"))},
		{"logf", artemistest.WithLogf(nil)},
		{"nil", nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b, err := artemistest.Run(t.Context(), tc.opt)
			if !errors.Is(err, artemistest.ErrInvalidOption) {
				if b != nil {
					_ = b.Stop(t.Context())
				}
				t.Fatalf("Run = %v, want ErrInvalidOption", err)
			}
		})
	}
	t.Run("queues and broker.xml with addresses", func(t *testing.T) {
		xml := bytes.Replace(artemistest.DefaultBrokerXML(), []byte("</core>"), []byte("<addresses></addresses></core>"), 1)
		_, err := artemistest.Run(t.Context(), artemistest.WithBrokerXML(xml), artemistest.WithQueues("q"))
		if !errors.Is(err, artemistest.ErrInvalidOption) {
			t.Fatalf("Run = %v, want ErrInvalidOption", err)
		}
	})
}

// fakeTB records what Start reports, and ends the goroutine at Fatal as
// testing does.
type fakeTB struct {
	testing.TB
	mu     sync.Mutex
	fatals []string
}

func (f *fakeTB) Helper()                    {}
func (f *fakeTB) Logf(string, ...any)        {}
func (f *fakeTB) Cleanup(func())             { panic("Start registered a cleanup for a broker it did not start") }
func (f *fakeTB) Fatal(args ...any)          { f.fatalf("%s", fmt.Sprint(args...)) }
func (f *fakeTB) Fatalf(fs string, a ...any) { f.fatalf(fs, a...) }
func (f *fakeTB) fatalf(format string, args ...any) {
	f.mu.Lock()
	f.fatals = append(f.fatals, fmt.Sprintf(format, args...))
	f.mu.Unlock()
	runtime.Goexit()
}

// Start fails the test, saying why, when the broker cannot start.
func TestStartFailsTheTestWithAReason(t *testing.T) {
	t.Setenv("PATH", t.TempDir()) // no java, no mvn
	t.Setenv("JAVA_HOME", "")
	for _, tc := range []struct {
		name string
		opts []artemistest.Option
		want string
	}{
		{"invalid option", []artemistest.Option{artemistest.WithHeap("lots")}, "WithHeap"},
		{"no java", []artemistest.Option{artemistest.WithMode(artemistest.Local)}, "needs Java 17"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := &fakeTB{TB: t}
			done := make(chan struct{})
			go func() {
				defer close(done)
				artemistest.Start(f, tc.opts...)
			}()
			<-done
			f.mu.Lock()
			defer f.mu.Unlock()
			if len(f.fatals) != 1 || !strings.Contains(f.fatals[0], tc.want) {
				t.Fatalf("Start reported %q, want one failure that says %q", f.fatals, tc.want)
			}
			t.Logf("Start said: %s", f.fatals[0])
		})
	}
}
