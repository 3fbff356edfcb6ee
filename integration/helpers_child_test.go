package integration

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/amqpsub/amqpsub/amqpsub"
)

// Helpers for consumers in processes of their own: the test binary run as
// a consumer, and the replica program.

const (
	childEnv       = "AMQPSUB_CHILD"
	childConfigEnv = "AMQPSUB_CHILD_CONFIG"
)

// childConfig is what a consumer child runs.
type childConfig struct {
	URL     string
	Queue   string
	Credit  int
	Workers int
	ByKey   bool
	// Delay is each handler call's work, after the first Warm deliveries,
	// which are handled at once.
	Delay time.Duration
	Warm  int64
	Grace time.Duration
	// Stuck seqs block their handler until its ctx ends.
	Stuck []int
	// Report is the period of the stats lines.
	Report time.Duration
	// Handled prints "h <seq>" for each delivery the handler accepted.
	Handled bool
	// MaxHeldBytes is the subscriber's MaxHeldBytes (0: off).
	MaxHeldBytes int64
	// CheckOrder counts, with Workers(1), the deliveries handled out of
	// seq order (OrderViolations).
	CheckOrder bool
	// FixedCredit holds the whole Credit (amqpsub.FixedCredit).
	FixedCredit bool
}

// childStats is one "s {...}" line of a child.
type childStats struct {
	RSSKiB int64
	// The Go runtime's view: memory obtained from the OS, heap in use.
	GoSysKiB, HeapInuseKiB int64
	Goroutines             int
	Held                   int
	MaxHeld                int
	BytesHeld              int64
	MaxBytesHeld           int64
	OrderViolations        int64
	Received               uint64
	Accepted               uint64
	Released               uint64
	Modified               uint64
	Stale                  uint64
	Handled                int64
	Stuck                  int64
	Final                  bool
	// StopTook is, in the final line, the time from SIGTERM to Run's return.
	StopTook time.Duration
}

// childMain runs a consumer as TestMain's child: it consumes until SIGTERM
// and writes its stats (with its own RSS) every Report to stdout.
func childMain() int {
	var cfg childConfig
	if err := json.Unmarshal([]byte(os.Getenv(childConfigEnv)), &cfg); err != nil {
		fmt.Fprintf(os.Stderr, "child: bad %s: %v\n", childConfigEnv, err)
		return 2
	}
	var outMu sync.Mutex
	out := bufio.NewWriter(os.Stdout)
	var handled, stuck, violations atomic.Int64
	last := -1 // CheckOrder, under Workers(1): one handler at a time
	h := amqpsub.HandlerFunc(func(ctx context.Context, d *amqpsub.Delivery) error {
		seq := seqOf(d)
		if cfg.CheckOrder && seq >= 0 {
			if seq != last+1 {
				violations.Add(1)
			}
			last = seq
		}
		if slices.Contains(cfg.Stuck, seq) {
			stuck.Add(1)
			defer stuck.Add(-1)
			<-ctx.Done()
			return ctx.Err()
		}
		if cfg.Delay > 0 && handled.Load() >= cfg.Warm {
			time.Sleep(cfg.Delay) // the handler's work
		}
		handled.Add(1)
		if cfg.Handled {
			outMu.Lock()
			fmt.Fprintf(out, "h %d\n", seq)
			outMu.Unlock()
		}
		return nil
	})
	log := zap.New(zapcore.NewCore(zapcore.NewConsoleEncoder(zap.NewDevelopmentEncoderConfig()),
		zapcore.Lock(os.Stderr), zap.WarnLevel))
	opts := []amqpsub.Option{amqpsub.Credit(cfg.Credit), amqpsub.GracePeriod(cfg.Grace), amqpsub.Logger(log),
		amqpsub.MaxHeldBytes(cfg.MaxHeldBytes)}
	if cfg.FixedCredit {
		opts = append(opts, amqpsub.FixedCredit())
	}
	if cfg.ByKey {
		opts = append(opts, amqpsub.WorkersByKey(cfg.Workers))
	} else {
		opts = append(opts, amqpsub.Workers(cfg.Workers))
	}
	s, err := amqpsub.New(amqpsub.Dial(cfg.URL, nil), cfg.Queue, h, opts...)
	if err != nil {
		fmt.Fprintf(os.Stderr, "child: %v\n", err)
		return 2
	}
	report := func(final bool, stopTook time.Duration) {
		st := s.Stats()
		var ms runtime.MemStats
		runtime.ReadMemStats(&ms)
		line, _ := json.Marshal(childStats{
			RSSKiB: rssKiB(), GoSysKiB: int64(ms.Sys >> 10), HeapInuseKiB: int64(ms.HeapInuse >> 10),
			Goroutines: runtime.NumGoroutine(), Held: st.Held, MaxHeld: st.MaxHeld, Received: st.Received,
			BytesHeld: st.BytesHeld, MaxBytesHeld: st.MaxBytesHeld, OrderViolations: violations.Load(),
			Accepted: st.Settled.Accepted, Released: st.Settled.Released, Modified: st.Settled.Modified, Stale: st.Stale,
			Handled: handled.Load(), Stuck: stuck.Load(), Final: final, StopTook: stopTook,
		})
		outMu.Lock()
		defer outMu.Unlock()
		fmt.Fprintf(out, "s %s\n", line)
		out.Flush()
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM)
	defer stop()
	rctx, cancelReport := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Go(func() {
		tick := time.NewTicker(cfg.Report)
		defer tick.Stop()
		for {
			select {
			case <-tick.C:
				report(false, 0)
			case <-rctx.Done():
				return
			}
		}
	})
	var sigAt atomic.Int64
	wg.Go(func() {
		select {
		case <-ctx.Done():
			sigAt.Store(time.Now().UnixNano())
		case <-rctx.Done():
		}
	})
	err = s.Run(ctx)
	var stopTook time.Duration
	if at := sigAt.Load(); at != 0 {
		stopTook = time.Duration(time.Now().UnixNano() - at)
	}
	cancelReport()
	wg.Wait()
	report(true, stopTook)
	outMu.Lock()
	fmt.Fprintf(out, "exit %v\n", err)
	out.Flush()
	outMu.Unlock()
	if err != nil {
		return 1
	}
	return 0
}

// rssKiB reads this process's resident set size from /proc.
func rssKiB() int64 {
	b, err := os.ReadFile("/proc/self/status")
	if err != nil {
		return -1
	}
	for line := range strings.Lines(string(b)) {
		if rest, ok := strings.CutPrefix(line, "VmRSS:"); ok {
			f := strings.Fields(rest)
			if len(f) > 0 {
				v, _ := strconv.ParseInt(f[0], 10, 64)
				return v
			}
		}
	}
	return -1
}

// child is a consumer process started by a test.
type child struct {
	cmd    *exec.Cmd
	exited chan struct{}

	mu       sync.Mutex
	stats    []childStats
	handled  map[int]int
	exit     string
	exitedAt time.Time
	waitErr  error
	partial  []byte
	stderr   bytes.Buffer
}

// startChild re-executes the test binary as a consumer (see TestMain). The
// process is killed at the end of the test if it still runs.
func startChild(t *testing.T, cfg childConfig) *child {
	t.Helper()
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	js, _ := json.Marshal(cfg)
	c := &child{exited: make(chan struct{}), handled: map[int]int{}}
	c.cmd = exec.Command(exe, "-test.run=^$")
	// A -race binary sleeps 1 s before it exits (GORACE atexit_sleep_ms,
	// default 1000): not the consumer's time, so the child does not.
	gorace := strings.TrimSpace(os.Getenv("GORACE") + " atexit_sleep_ms=0")
	c.cmd.Env = append(os.Environ(), childEnv+"=consumer", childConfigEnv+"="+string(js), "GORACE="+gorace)
	c.cmd.Stdout = writerFunc(c.onStdout)
	c.cmd.Stderr = writerFunc(func(p []byte) (int, error) {
		c.mu.Lock()
		defer c.mu.Unlock()
		return c.stderr.Write(p)
	})
	if err := c.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() {
		err := c.cmd.Wait()
		c.mu.Lock()
		c.exitedAt, c.waitErr = time.Now(), err
		c.mu.Unlock()
		close(c.exited)
	}()
	t.Cleanup(func() {
		select {
		case <-c.exited:
		default:
			c.cmd.Process.Kill()
			<-c.exited
		}
		if t.Failed() {
			c.mu.Lock()
			t.Logf("child stderr (tail):\n%s", tail(c.stderr.String(), 4000))
			c.mu.Unlock()
		}
	})
	return c
}

type writerFunc func(p []byte) (int, error)

func (f writerFunc) Write(p []byte) (int, error) { return f(p) }

func tail(s string, n int) string {
	if len(s) > n {
		return "…" + s[len(s)-n:]
	}
	return s
}

func (c *child) onStdout(p []byte) (int, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.partial = append(c.partial, p...)
	for {
		i := bytes.IndexByte(c.partial, '\n')
		if i < 0 {
			break
		}
		line := string(c.partial[:i])
		c.partial = c.partial[i+1:]
		switch {
		case strings.HasPrefix(line, "h "):
			seq, _ := strconv.Atoi(line[2:])
			c.handled[seq]++
		case strings.HasPrefix(line, "s "):
			var st childStats
			if err := json.Unmarshal([]byte(line[2:]), &st); err == nil {
				c.stats = append(c.stats, st)
			}
		case strings.HasPrefix(line, "exit "):
			c.exit = line[5:]
		}
	}
	return len(p), nil
}

// last returns the child's latest stats line.
func (c *child) last() childStats {
	c.mu.Lock()
	defer c.mu.Unlock()
	if len(c.stats) == 0 {
		return childStats{}
	}
	return c.stats[len(c.stats)-1]
}

func (c *child) nstats() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.stats)
}

// statsSince returns the stats lines from the i-th on.
func (c *child) statsSince(i int) []childStats {
	c.mu.Lock()
	defer c.mu.Unlock()
	return slices.Clone(c.stats[min(i, len(c.stats)):])
}

func (c *child) running() bool {
	select {
	case <-c.exited:
		return false
	default:
		return true
	}
}

// sigterm sends SIGTERM and waits until the process exited, at most within;
// it returns how long that took.
func (c *child) sigterm(t *testing.T, within time.Duration) time.Duration {
	t.Helper()
	at := time.Now()
	if err := c.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	select {
	case <-c.exited:
	case <-time.After(within):
		t.Fatalf("the consumer did not exit within %v of SIGTERM", within)
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.waitErr != nil || c.exit != "<nil>" {
		t.Fatalf("the consumer exited with %v (Run returned %q)", c.waitErr, c.exit)
	}
	return c.exitedAt.Sub(at)
}

// buildReplicas builds examples/replicas into dir.
func buildReplicas(t *testing.T, dir string) string {
	t.Helper()
	gobin, err := exec.LookPath("go")
	if err != nil {
		t.Fatalf("the replica tests build examples/replicas and need the go command: %v", err)
	}
	bin := filepath.Join(dir, "replicas")
	out, err := exec.Command(gobin, "build", "-o", bin, "github.com/amqpsub/amqpsub/examples/replicas").CombinedOutput()
	if err != nil {
		t.Fatalf("go build examples/replicas: %v\n%s", err, out)
	}
	return bin
}
