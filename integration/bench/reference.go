package main

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
)

// The reference consumers: what a user would pick instead of amqpsub in
// another ecosystem, each run as a child process on the same queue and
// preload as the go-amqp loop, with the harness's credit as its credit
// window or prefetch, accepting each message on its own.
//
// Each prints on stdout one line per event, "<event> <monotonic ns>
// <messages so far>": start once its connection is open, before its session
// and link open (where drainLoop starts its clock); first; progress every
// 1,000 messages; last once the last message was accepted. The drain's
// elapsed time is last − start by the child's own clock, so JVM and
// interpreter start-up is left out; its client CPU is the child's
// (/proc/<pid>/stat) between reading the start and the last line.

// refConsumer describes one reference consumer.
type refConsumer struct {
	// prepare builds or finds the program and returns the command that
	// runs it and a line for the report saying what it is.
	prepare func(ctx context.Context) (cmd []string, about string, err error)
	// args returns the arguments that drain want messages from address on
	// b with the given credit window; the child gets b's URL in
	// $AMQPSUB_URL, not on its command line.
	args func(b *broker, address string, want, credit int, stall time.Duration) ([]string, error)
}

var refConsumers = map[string]refConsumer{
	"jms":      {prepare: prepareJMS, args: argsJMS},
	"protonc":  {prepare: prepareProtonC, args: argsProtonC},
	"pyproton": {prepare: preparePyProton, args: argsPyProton},
}

// refOnRabbit is why "all" runs the reference consumers on Artemis only.
const refOnRabbit = "they are the yardstick for Artemis; on RabbitMQ 3.10 Proton C's receive example " +
	"loses its last acceptances (it closes its link, session and connection in the write that carries " +
	"its last ranged disposition; RabbitMQ drops that disposition and requeues those messages, which " +
	"the probe then finds). Name them in -scenarios to run them there (jms and pyproton drained RabbitMQ " +
	"correctly when tried)."

// refOnRabbit4 is why "all" leaves them out on RabbitMQ 4 as well.
const refOnRabbit4 = "they are the yardstick for Artemis, and would add minutes to each queue's runs. " +
	"Name them in -scenarios to run them there (jms and pyproton drained a classic and a quorum queue " +
	"correctly when tried; protonc, whose example connects without SASL, was not tried)."

const prereqHint = "`bash integration/prereqs.sh bench` installs what the reference consumers need; " +
	"or leave jms, protonc and pyproton out of -scenarios"

// prepareRefs builds every reference consumer among chosen, once, and sets
// its command. It fails on the first one that cannot run, before any queue
// is touched.
func prepareRefs(ctx context.Context, chosen []scenario, limit time.Duration) (about []string, err error) {
	for i, sc := range chosen {
		if sc.ref == "" {
			continue
		}
		pctx, cancel := context.WithTimeout(ctx, limit)
		cmd, line, err := refConsumers[sc.ref].prepare(pctx)
		cancel()
		if err != nil {
			return nil, fmt.Errorf("scenario %s: %w\n%s", sc.name, err, prereqHint)
		}
		chosen[i].cmd = cmd
		about = append(about, fmt.Sprintf("%s: %s", sc.name, line))
	}
	return about, nil
}

// moduleFile returns the path of a file of this repository, relative to the
// working directory, which must be the module root (as for `make bench`).
func moduleFile(rel string) (string, error) {
	abs, err := filepath.Abs(rel)
	if err != nil {
		return "", err
	}
	if _, err := os.Stat(abs); err != nil {
		return "", fmt.Errorf("%s not found: run the bench from the module root: %w", rel, err)
	}
	return abs, nil
}

// build runs a build script that prints the path of what it built; its
// stderr (progress, errors) goes to ours.
func build(ctx context.Context, script string) (string, error) {
	path, err := moduleFile(script)
	if err != nil {
		return "", err
	}
	cmd := exec.CommandContext(ctx, "bash", path)
	cmd.Stderr = os.Stderr
	cmd.WaitDelay = 5 * time.Second
	out, err := cmd.Output()
	if err != nil {
		return "", fmt.Errorf("%s: %w", script, cause(ctx, err))
	}
	return strings.TrimSpace(string(out)), nil
}

// firstLine runs a command and returns the first line of its output, or
// "unknown".
func firstLine(ctx context.Context, name string, args ...string) string {
	out, err := exec.CommandContext(ctx, name, args...).CombinedOutput()
	line, _, _ := strings.Cut(strings.TrimSpace(string(out)), "\n")
	if err != nil || line == "" {
		return "unknown"
	}
	return line
}

func debVersion(ctx context.Context, pkg string) string {
	return firstLine(ctx, "dpkg-query", "-W", "-f=${Version}", pkg)
}

func prepareJMS(ctx context.Context) ([]string, string, error) {
	java, err := exec.LookPath("java")
	if err != nil {
		return nil, "", fmt.Errorf("java not found (Java 17+ runs the JMS consumer): %w", err)
	}
	jar, err := build(ctx, "integration/jms-consumer/build.sh")
	if err != nil {
		return nil, "", err
	}
	return []string{java, "-jar", jar},
		fmt.Sprintf("Qpid JMS 2.7.0 (integration/jms-consumer), AUTO_ACKNOWLEDGE, %s, default JVM options",
			firstLine(ctx, java, "-version")), nil
}

func argsJMS(b *broker, address string, want, credit int, stall time.Duration) ([]string, error) {
	return []string{"--queue", address, "--count", strconv.Itoa(want), "--prefetch", strconv.Itoa(credit),
		"--ack", "auto", "--stall", strconv.Itoa(stallSeconds(stall))}, nil
}

func prepareProtonC(ctx context.Context) ([]string, string, error) {
	bin, err := build(ctx, "integration/bench/protonc/build.sh")
	if err != nil {
		return nil, "", err
	}
	return []string{bin}, fmt.Sprintf("Proton C's receive example (libqpid-proton11 %s), with integration/bench/protonc/receive.c.patch, gcc -O2",
		debVersion(ctx, "libqpid-proton11")), nil
}

// argsProtonC: the example takes host, port, address, count and (patched)
// the window. It connects without SASL, so a user and password in the URL
// are not used: Artemis with anonymous login allowed takes it, as does
// RabbitMQ's AMQP 1.0 plugin, as its amqp1_0.default_user (guest, as
// integration/rabbitmq.sh configures it).
func argsProtonC(b *broker, address string, want, credit int, _ time.Duration) ([]string, error) {
	u, err := url.Parse(b.url)
	if err != nil {
		return nil, fmt.Errorf("protonc: broker URL: %w", err)
	}
	if u.Scheme != "amqp" {
		return nil, fmt.Errorf("protonc: the receive example speaks plain amqp only, not %s", u.Scheme)
	}
	port := u.Port()
	if port == "" {
		port = "5672"
	}
	return []string{u.Hostname(), port, address, strconv.Itoa(want), strconv.Itoa(credit)}, nil
}

const debianPython = "/usr/bin/python3"

func preparePyProton(ctx context.Context) ([]string, string, error) {
	script, err := moduleFile("integration/bench/pyproton/receive.py")
	if err != nil {
		return nil, "", err
	}
	// Debian's python, whose dist-packages hold proton, not one earlier on
	// PATH.
	out, err := exec.CommandContext(ctx, debianPython, "-c",
		"import proton, sys; print('%d.%d.%d' % proton.VERSION, sys.version.split()[0])").CombinedOutput()
	if err != nil {
		return nil, "", fmt.Errorf("%s cannot import proton (Debian python3-qpid-proton): %w: %s",
			debianPython, err, bytes.TrimSpace(out))
	}
	f := strings.Fields(string(out))
	if len(f) != 2 {
		return nil, "", fmt.Errorf("%s printed %q", debianPython, out)
	}
	return []string{debianPython, script}, fmt.Sprintf("Proton Python %s (python3-qpid-proton %s) on Python %s, integration/bench/pyproton/receive.py",
		f[0], debVersion(ctx, "python3-qpid-proton"), f[1]), nil
}

func argsPyProton(b *broker, address string, want, credit int, stall time.Duration) ([]string, error) {
	return []string{"--queue", address, "--count", strconv.Itoa(want), "--window", strconv.Itoa(credit),
		"--stall", strconv.Itoa(stallSeconds(stall))}, nil
}

// stallSeconds is -stall in whole seconds, at least 1, for the children's
// own bound (the harness kills them at -stall anyway).
func stallSeconds(d time.Duration) int { return max(1, int((d+time.Second-1)/time.Second)) }

// tail keeps the last max bytes written to it: a child's stderr, for the
// error that ends its drain.
type tail struct {
	mu  sync.Mutex
	max int
	buf []byte
}

func (t *tail) Write(p []byte) (int, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.buf = append(t.buf, p...)
	if over := len(t.buf) - t.max; over > 0 {
		t.buf = append(t.buf[:0], t.buf[over:]...)
	}
	return len(p), nil
}

func (t *tail) String() string {
	t.mu.Lock()
	defer t.mu.Unlock()
	return strings.TrimSpace(string(t.buf))
}

// refEvent is one line of a reference consumer's stdout.
type refEvent struct {
	name string
	ns   int64 // the child's monotonic clock
	n    int   // messages so far
}

func parseRefEvent(line string) (refEvent, bool) {
	f := strings.Fields(line)
	if len(f) != 3 {
		return refEvent{}, false
	}
	switch f[0] {
	case "start", "first", "progress", "last":
	default:
		return refEvent{}, false
	}
	ns, err1 := strconv.ParseInt(f[1], 10, 64)
	n, err2 := strconv.Atoi(f[2])
	if err1 != nil || err2 != nil {
		return refEvent{}, false
	}
	return refEvent{name: f[0], ns: ns, n: n}, true
}

// drainRef runs a reference consumer on queue, which holds want messages.
// The child runs in its own process group, which is killed when the drain
// stalls (-stall), takes too long (-timeout) or is interrupted; it must exit
// 0 having printed "last" with want messages.
func drainRef(ctx context.Context, b *broker, queue string, want int, sc scenario, rc runConfig) (res result, err error) {
	if len(sc.cmd) == 0 {
		return result{}, fmt.Errorf("%s: not prepared", sc.name)
	}
	args, err := refConsumers[sc.ref].args(b, b.receiveAddress(queue), want, rc.credit, rc.stall)
	if err != nil {
		return result{}, err
	}
	var progress atomic.Int64
	dctx, stop := watch(ctx, &progress, want, rc.stall, rc.timeout)
	defer stop()

	cmd := exec.CommandContext(dctx, sc.cmd[0], append(sc.cmd[1:len(sc.cmd):len(sc.cmd)], args...)...)
	cmd.Env = append(os.Environ(), "AMQPSUB_URL="+b.url)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	cmd.Cancel = func() error { return syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL) }
	cmd.WaitDelay = 5 * time.Second
	stderr := &tail{max: 4096}
	cmd.Stderr = stderr
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return result{}, fmt.Errorf("%s: %w", sc.name, err)
	}
	if err := cmd.Start(); err != nil {
		return result{}, fmt.Errorf("%s: start: %w", sc.name, err)
	}
	pid := cmd.Process.Pid
	// Every exit path waits for the child; one that has not, kills it
	// first.
	waited := false
	kill := func() error {
		if waited {
			return nil
		}
		_ = cmd.Cancel()
		waited = true
		return cmd.Wait()
	}
	defer func() { _ = kill() }()
	fail := func(err error) (result, error) {
		msg := fmt.Sprintf("%s (pid %d): %v", sc.name, pid, cause(dctx, err))
		if werr := kill(); werr != nil {
			msg += fmt.Sprintf("; killed: %v", werr)
		}
		if s := stderr.String(); s != "" {
			msg += "; stderr: " + s
		}
		return result{}, errors.New(msg)
	}

	var start, first, last refEvent
	var before, after cpuSample
	var childBefore, childAfter time.Duration
	sc2 := bufio.NewScanner(stdout)
	for sc2.Scan() {
		ev, ok := parseRefEvent(sc2.Text())
		if !ok {
			continue
		}
		switch ev.name {
		case "start":
			before = sampleCPU(b.pid)
			u, k, err := procCPU(pid)
			if err != nil {
				return fail(err)
			}
			childBefore, start = u+k, ev
		case "first":
			first = ev
		case "last":
			after = sampleCPU(b.pid)
			u, k, err := procCPU(pid)
			if err != nil {
				return fail(err)
			}
			childAfter, last = u+k, ev
		}
		progress.Store(int64(ev.n))
	}
	if err := sc2.Err(); err != nil {
		return fail(fmt.Errorf("stdout: %w", err))
	}
	werr := cmd.Wait()
	waited = true
	switch {
	case dctx.Err() != nil:
		return fail(errors.New("killed"))
	case werr != nil:
		return fail(fmt.Errorf("after %d of %d messages: %w", progress.Load(), want, werr))
	case start.name == "" || last.name == "":
		return fail(fmt.Errorf("exited 0 without a start and a last line (%d of %d messages)", progress.Load(), want))
	case last.n != want:
		return fail(fmt.Errorf("last line says %d messages, want %d", last.n, want))
	}
	res = measured(want, time.Duration(last.ns-start.ns), before, after)
	res.client = childAfter - childBefore
	if first.name != "" {
		logf("%s: first message %v after start", sc.name, time.Duration(first.ns-start.ns).Round(time.Millisecond))
	}
	return res, nil
}
