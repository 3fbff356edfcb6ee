package artemistest

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
)

// The local-process path: the distribution from Maven Central, unpacked
// once into the cache dir, a fresh instance per broker in a temporary
// directory, `bin/artemis run` as a child process in its own process
// group, stopped by PID.

// killWait bounds the wait for a process to exit after SIGKILL.
const killWait = 10 * time.Second

// readyPoll is how often Run looks whether a starting broker is ready.
const readyPoll = 100 * time.Millisecond

// errPortTaken: another process bound one of the broker's ports between
// freePorts and the broker's bind. Run then starts again on other ports.
var errPortTaken = errors.New("artemistest: a port was taken before the broker bound it")

// localBroker is one `artemis run` process. It owns the goroutine that
// waits for the process; stop and kill end the process and wait for that
// goroutine (exited).
type localBroker struct {
	logf    func(string, ...any)
	root    string // temporary directory holding the instance; stop removes it
	inst    string
	logPath string
	ports   []int // AMQP, CORE; held (see freePorts) until release
	cmd     *exec.Cmd
	exited  chan struct{} // closed by the waiting goroutine once cmd.Wait returned
}

func runLocal(ctx context.Context, c *config) (*Broker, error) {
	if runtime.GOOS == "windows" {
		return nil, fmt.Errorf("artemistest: mode Local: %w on Windows (bin/artemis is a shell script); use mode Container", errors.ErrUnsupported)
	}
	if err := checkJava(); err != nil {
		return nil, err
	}
	home, err := ensureDist(ctx, c)
	if err != nil {
		return nil, err
	}
	root, err := os.MkdirTemp("", "artemistest-")
	if err != nil {
		return nil, fmt.Errorf("artemistest: %w", err)
	}
	inst := filepath.Join(root, "broker")
	if err := createInstance(ctx, c, home, inst); err != nil {
		_ = os.RemoveAll(root)
		return nil, err
	}
	t0 := time.Now()
	for attempt := 1; ; attempt++ {
		lb, err := startLocal(c, root, inst)
		if err == nil {
			err = lb.waitReady(ctx, c.startTimeout)
			if err == nil {
				c.logf("artemistest: Artemis %s (pid %d, %s) accepts AMQP on 127.0.0.1:%d after %v",
					c.version, lb.pid(), inst, lb.ports[0], time.Since(t0).Round(10*time.Millisecond))
				return &Broker{host: "127.0.0.1", port: lb.ports[0], corePort: lb.ports[1], be: lb}, nil
			}
			if kerr := lb.kill(); kerr != nil {
				err = errors.Join(err, kerr)
			}
		}
		if errors.Is(err, errPortTaken) && attempt < 3 {
			c.logf("artemistest: %v; starting again on other ports", err)
			continue
		}
		_ = os.RemoveAll(root)
		return nil, err
	}
}

// checkJava fails early, with a clear message, where bin/artemis would
// fail with a shell error.
func checkJava() error {
	if jh := os.Getenv("JAVA_HOME"); jh != "" {
		if _, err := os.Stat(filepath.Join(jh, "bin", "java")); err == nil { //nolint:gosec // G703: only looks whether java is there
			return nil
		}
	}
	if _, err := exec.LookPath("java"); err != nil {
		return fmt.Errorf("artemistest: mode Local needs Java 17 or later (java is not on PATH, nor in JAVA_HOME): %w", err)
	}
	return nil
}

// ensureDist returns the unpacked distribution in the cache dir, and
// downloads and unpacks it first if it is not there. The lock file is the
// one integration/artemis.sh takes, so the script and any number of test
// processes download and unpack once between them.
func ensureDist(ctx context.Context, c *config) (string, error) {
	name := "apache-artemis-" + c.version
	home := filepath.Join(c.cacheDir, name)
	if isExecutable(filepath.Join(home, "bin", "artemis")) {
		return home, nil
	}
	if err := os.MkdirAll(c.cacheDir, 0o750); err != nil {
		return "", fmt.Errorf("artemistest: cache dir: %w", err)
	}
	unlock, err := lockFile(ctx, filepath.Join(c.cacheDir, ".artemis.lock"))
	if err != nil {
		return "", err
	}
	defer unlock()
	if isExecutable(filepath.Join(home, "bin", "artemis")) {
		return home, nil // another process unpacked it while we waited
	}
	tarball := filepath.Join(c.cacheDir, name+"-bin.tar.gz")
	if fi, err := os.Stat(tarball); err != nil || fi.Size() == 0 {
		c.logf("artemistest: downloading Artemis %s with Maven into %s (once)", c.version, c.cacheDir)
		if err := mavenDownload(ctx, c, tarball); err != nil {
			return "", err
		}
	}
	c.logf("artemistest: unpacking %s", tarball)
	tmp, err := os.MkdirTemp(c.cacheDir, ".unpack-")
	if err != nil {
		return "", fmt.Errorf("artemistest: %w", err)
	}
	defer func() { _ = os.RemoveAll(tmp) }()
	if err := untarGz(ctx, tarball, tmp); err != nil {
		return "", fmt.Errorf("artemistest: unpacking %s: %w", tarball, err)
	}
	if !isExecutable(filepath.Join(tmp, name, "bin", "artemis")) {
		return "", fmt.Errorf("artemistest: %s has no %s/bin/artemis", tarball, name)
	}
	if err := os.RemoveAll(home); err != nil { // a partial copy of an older run
		return "", fmt.Errorf("artemistest: %w", err)
	}
	if err := os.Rename(filepath.Join(tmp, name), home); err != nil {
		return "", fmt.Errorf("artemistest: %w", err)
	}
	return home, nil
}

func isExecutable(path string) bool {
	fi, err := os.Stat(path)
	return err == nil && fi.Mode().IsRegular() && fi.Mode().Perm()&0o111 != 0
}

// mavenDownload fetches the distribution with `mvn dependency:copy`, as
// the repository's broker scripts (integration/*.sh) do, so that Maven's
// settings (mirrors, proxies) apply.
func mavenDownload(ctx context.Context, c *config, tarball string) error {
	gav := "org.apache.activemq:apache-artemis:" + c.version + ":tar.gz:bin"
	mvn, err := exec.LookPath("mvn")
	if err != nil {
		return fmt.Errorf("artemistest: Artemis %s is not in %s yet, and Maven (mvn), which downloads it once, is not on PATH (or put %s there): %w",
			c.version, c.cacheDir, filepath.Base(tarball), err)
	}
	tmp, err := os.MkdirTemp(c.cacheDir, ".download-")
	if err != nil {
		return fmt.Errorf("artemistest: %w", err)
	}
	defer func() { _ = os.RemoveAll(tmp) }()
	out := filepath.Join(tmp, "out")
	cmd := exec.CommandContext(ctx, mvn, "-B", "-q", "-Dstyle.color=never", "dependency:copy", //nolint:gosec // G204: mvn from PATH, with a checked version number
		"-Dartifact="+gav, "-DoutputDirectory="+out)
	cmd.Dir = tmp
	cmd.SysProcAttr = sysProcAttr()
	cmd.WaitDelay = 5 * time.Second
	if b, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("artemistest: mvn dependency:copy -Dartifact=%s: %w\n%s", gav, err, lastLines(b, 40))
	}
	got := filepath.Join(out, "apache-artemis-"+c.version+"-bin.tar.gz")
	if err := os.Rename(got, tarball); err != nil {
		return fmt.Errorf("artemistest: after mvn dependency:copy: %w", err)
	}
	return nil
}

// untarGz unpacks a .tar.gz into dest: directories, regular files and
// symbolic links, none of which may point outside dest.
func untarGz(ctx context.Context, src, dest string) error {
	f, err := os.Open(src) //nolint:gosec // G304: our own cached download
	if err != nil {
		return err
	}
	defer func() { _ = f.Close() }()
	gz, err := gzip.NewReader(f)
	if err != nil {
		return err
	}
	tr := tar.NewReader(gz)
	for {
		if err := ctx.Err(); err != nil {
			return err
		}
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return err
		}
		name := filepath.FromSlash(h.Name)
		if !filepath.IsLocal(name) {
			return fmt.Errorf("entry %q leaves the directory", h.Name)
		}
		target := filepath.Join(dest, name)
		switch h.Typeflag {
		case tar.TypeDir:
			if err := os.MkdirAll(target, 0o750); err != nil {
				return err
			}
		case tar.TypeReg:
			if err := writeEntry(tr, target, h); err != nil {
				return err
			}
		case tar.TypeSymlink:
			link := filepath.FromSlash(h.Linkname)
			if filepath.IsAbs(link) || !filepath.IsLocal(filepath.Join(filepath.Dir(name), link)) {
				return fmt.Errorf("link %q points outside the directory", h.Name)
			}
			if err := os.MkdirAll(filepath.Dir(target), 0o750); err != nil {
				return err
			}
			if err := os.Symlink(h.Linkname, target); err != nil {
				return err
			}
		}
	}
}

func writeEntry(r io.Reader, target string, h *tar.Header) error {
	if err := os.MkdirAll(filepath.Dir(target), 0o750); err != nil {
		return err
	}
	// The archive's modes: bin/artemis must stay executable.
	w, err := os.OpenFile(target, os.O_CREATE|os.O_WRONLY|os.O_TRUNC, h.FileInfo().Mode().Perm()) //nolint:gosec // G302,G304: a path checked with filepath.IsLocal, the distribution's own modes
	if err != nil {
		return err
	}
	if _, err := io.CopyN(w, r, h.Size); err != nil {
		_ = w.Close()
		return err
	}
	return w.Close()
}

// createInstance runs `artemis create` into inst, then puts our
// broker.xml in its etc/. --require-login writes a login.config with the
// properties login module only, so a wrong password is refused.
func createInstance(ctx context.Context, c *config, home, inst string) error {
	cmd := exec.CommandContext(ctx, filepath.Join(home, "bin", "artemis"), "create", //nolint:gosec // G204: the distribution's own script, with checked options
		"--silent", "--host", "127.0.0.1", "--no-web", "--no-autotune",
		"--require-login", "--user", c.user, "--password", c.password, inst)
	cmd.Env = brokerEnv("")
	cmd.SysProcAttr = sysProcAttr()
	cmd.WaitDelay = 5 * time.Second
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("artemistest: artemis create: %w\n%s", err, lastLines(out, 40))
	}
	if err := os.WriteFile(filepath.Join(inst, "etc", "broker.xml"), renderBrokerXML(c), 0o600); err != nil {
		return fmt.Errorf("artemistest: %w", err)
	}
	return nil
}

// brokerEnv is the environment of bin/artemis: ours, without what would
// make it use another installation or other JVM options, plus
// JAVA_ARGS_APPEND (which bin/artemis puts after the profile's options).
func brokerEnv(javaArgsAppend string) []string {
	var env []string
	for _, kv := range os.Environ() {
		k, _, _ := strings.Cut(kv, "=")
		switch k {
		case "JAVA_ARGS", "JAVA_ARGS_APPEND", "DEBUG_ARGS", "ARTEMIS_CLUSTER_PROPS",
			"ARTEMIS_HOME", "ARTEMIS_INSTANCE", "ARTEMIS_INSTANCE_URI", "ARTEMIS_INSTANCE_ETC_URI",
			"ARTEMIS_DATA_DIR", "ARTEMIS_ETC_DIR", "ARTEMIS_OOME_DUMP":
			continue
		}
		env = append(env, kv)
	}
	if javaArgsAppend != "" {
		env = append(env, "JAVA_ARGS_APPEND="+javaArgsAppend)
	}
	return env
}

// startLocal starts `bin/artemis run` (which execs java, so the child is
// the JVM itself) on two free ports, writing its output to
// log/console.log.
func startLocal(c *config, root, inst string) (*localBroker, error) {
	ports, err := freePorts(2)
	if err != nil {
		return nil, err
	}
	lb := &localBroker{logf: c.logf, root: root, inst: inst, logPath: filepath.Join(inst, "log", "console.log"), ports: ports}
	if err := os.MkdirAll(filepath.Dir(lb.logPath), 0o750); err != nil {
		releasePorts(ports)
		return nil, fmt.Errorf("artemistest: %w", err)
	}
	out, err := os.OpenFile(lb.logPath, os.O_CREATE|os.O_WRONLY|os.O_TRUNC, 0o600)
	if err != nil {
		releasePorts(ports)
		return nil, fmt.Errorf("artemistest: %w", err)
	}
	// The child gets its own descriptor; ours closes on return.
	defer func() { _ = out.Close() }()
	cmd := exec.Command(filepath.Join(inst, "bin", "artemis"), "run") //nolint:gosec // G204: the instance's own script
	cmd.Dir = inst
	cmd.Env = brokerEnv(fmt.Sprintf("%s -Damqpsub.host=127.0.0.1 -Damqpsub.port=%d -Damqpsub.coreport=%d",
		jvmMemoryArgs(c.heap), ports[0], ports[1]))
	cmd.Stdout, cmd.Stderr = out, out // an *os.File: no copying goroutines
	// Its own process group, so that a Ctrl-C meant for `go test` does not
	// stop the broker under the tests' feet: their cleanup stops it.
	cmd.SysProcAttr = sysProcAttr()
	if err := cmd.Start(); err != nil {
		releasePorts(ports)
		return nil, fmt.Errorf("artemistest: starting %s run: %w", cmd.Path, err)
	}
	lb.cmd = cmd
	lb.exited = make(chan struct{})
	go func() {
		_ = cmd.Wait() // the exit status is in cmd.ProcessState
		close(lb.exited)
	}()
	return lb, nil
}

// waitReady waits until the broker says it is active, has logged its
// AMQP acceptor on our port, and that port accepts a connection: the log
// proves the port is this broker's, not another process's.
func (lb *localBroker) waitReady(ctx context.Context, timeout time.Duration) error {
	deadline := time.NewTimer(timeout)
	defer deadline.Stop()
	tick := time.NewTicker(readyPoll)
	defer tick.Stop()
	acceptor := []byte(fmt.Sprintf(":%d for protocols", lb.ports[0]))
	addr := net.JoinHostPort("127.0.0.1", strconv.Itoa(lb.ports[0]))
	for {
		if lb.ready(acceptor, addr) {
			return nil
		}
		select {
		case <-lb.exited:
			if log, _ := os.ReadFile(lb.logPath); bytes.Contains(log, []byte("AMQ229230")) || bytes.Contains(log, []byte("Address already in use")) {
				return fmt.Errorf("%w (ports %v)", errPortTaken, lb.ports)
			}
			return fmt.Errorf("artemistest: the broker exited during start-up (%v); its last output lines:\n%s", lb.cmd.ProcessState, lb.logTail(60))
		case <-ctx.Done():
			return fmt.Errorf("artemistest: waiting for the broker to start: %w; its last output lines:\n%s", ctx.Err(), lb.logTail(60))
		case <-deadline.C:
			return fmt.Errorf("artemistest: the broker did not accept AMQP on %s within %v (WithStartTimeout); its last output lines:\n%s", addr, timeout, lb.logTail(60))
		case <-tick.C:
		}
	}
}

func (lb *localBroker) ready(acceptor []byte, addr string) bool {
	log, err := os.ReadFile(lb.logPath)
	if err != nil || !bytes.Contains(log, []byte("AMQ221007")) || !bytes.Contains(log, acceptor) {
		return false
	}
	conn, err := net.DialTimeout("tcp", addr, time.Second)
	if err != nil {
		return false
	}
	_ = conn.Close()
	return true
}

func (lb *localBroker) pid() int    { return lb.cmd.Process.Pid }
func (lb *localBroker) dir() string { return lb.inst }

func (lb *localBroker) logTail(n int) string {
	b, err := os.ReadFile(lb.logPath)
	if err != nil {
		return fmt.Sprintf("(no output: %v)", err)
	}
	return lastLines(b, n)
}

// kill ends the process with SIGKILL and waits for it; the files stay.
func (lb *localBroker) kill() error {
	defer lb.release()
	select {
	case <-lb.exited:
		return nil
	default:
	}
	// Signal through os.Process: it cannot hit another process that
	// took the PID after ours was reaped.
	_ = lb.cmd.Process.Kill()
	t := time.NewTimer(killWait)
	defer t.Stop()
	select {
	case <-lb.exited:
		return nil
	case <-t.C:
		return fmt.Errorf("artemistest: the broker (pid %d) is still there %v after SIGKILL", lb.pid(), killWait)
	}
}

func (lb *localBroker) stop(ctx context.Context) error {
	select {
	case <-lb.exited: // it ended by itself, or a test killed it
	default:
		_ = lb.cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-lb.exited:
		case <-ctx.Done():
			lb.logf("artemistest: the broker (pid %d) did not stop after SIGTERM (%v); sending SIGKILL", lb.pid(), ctx.Err())
			if err := lb.kill(); err != nil {
				return err
			}
		}
	}
	lb.release()
	if err := os.RemoveAll(lb.root); err != nil {
		return fmt.Errorf("artemistest: removing the broker's files: %w", err)
	}
	return nil
}

// lastLines returns the last n lines of b.
func lastLines(b []byte, n int) string {
	s := strings.TrimRight(string(b), "\n")
	lines := strings.Split(s, "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

// Ports handed to brokers of this process that are still running, so that
// two brokers starting at once never get the same one (the kernel may hand
// out a port again once freePorts has closed its listener).
var (
	portsMu   sync.Mutex
	portsHeld = map[int]bool{}
)

// freePorts finds n distinct free ports on 127.0.0.1 by listening on port
// 0; the caller must releasePorts them once its broker has stopped.
func freePorts(n int) ([]int, error) {
	portsMu.Lock()
	defer portsMu.Unlock()
	var ports []int
	for tries := 0; len(ports) < n; tries++ {
		if tries == 100 {
			return nil, errors.New("artemistest: no free port found on 127.0.0.1")
		}
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return nil, fmt.Errorf("artemistest: finding a free port: %w", err)
		}
		defer func() { _ = l.Close() }() // held until all n are found, so they differ
		p := l.Addr().(*net.TCPAddr).Port
		if !portsHeld[p] {
			ports = append(ports, p)
		}
	}
	for _, p := range ports {
		portsHeld[p] = true
	}
	return ports, nil
}

func releasePorts(ports []int) {
	portsMu.Lock()
	defer portsMu.Unlock()
	for _, p := range ports {
		delete(portsHeld, p)
	}
}

// release gives the broker's ports back once; a second call must not
// free ports that another broker has been given meanwhile.
func (lb *localBroker) release() {
	if ports := lb.ports; ports != nil {
		lb.ports = nil
		releasePorts(ports)
	}
}
