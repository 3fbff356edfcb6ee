// Command bench measures amqpsub against a hand-written go-amqp loop on real
// brokers (docs/performance.md).
//
// For each broker (Artemis, RabbitMQ 3.10, RabbitMQ 4 on a classic queue
// and on a quorum queue) and payload it preloads a queue, then drains it with each
// scenario in turn: (a) the best plain go-amqp loop, the reference; (b)
// amqpsub with a no-op handler under Workers(1), Workers(8),
// WorkersByKey(8) (hash lanes and BalanceKeys) and NewBatch, each also with
// FixedCredit; (c) amqpsub with a 1 ms handler under
// WorkersByKey(n) for n = 1, 4, 8, 16, 64, and with BalanceKeys for n = 8,
// 16, 64; (r) reference consumers from other
// ecosystems, what a user would pick instead: a Qpid JMS
// consumer, Proton C's receive example and a Proton Python receiver, each a
// child process with the same credit, accepting each message (see
// reference.go). Runs are interleaved (every scenario once, then again), so
// the ratio to (a) compares runs taken close together. It prints a Markdown
// table per broker and payload: msgs/s (median, min–max), the ratio to (a)
// in the same run, the CPU of the client (this process, or the child) and of
// the broker over each drain, and the most deliveries amqpsub held.
//
// Every drain is bounded: no progress for -stall, or longer than -timeout,
// fails the run (a reference consumer's process group is killed); after each
// drain a probe checks that the queue is empty.
//
// "all" includes the reference consumers on Artemis, not on RabbitMQ 3.10
// or 4 (name them in -scenarios to run them there: see refOnRabbit and
// refOnRabbit4). They need
// Java, Maven, gcc and Debian's Proton packages (`bash
// integration/prereqs.sh bench`, which `make bench` runs); they are built
// before any queue is touched, and a missing prerequisite stops the bench
// there, saying what to install.
//
//	go run ./integration/bench -n 10000 -runs 1            # quick
//	go run ./integration/bench -brokers artemis -scenarios loop,w1,key8
//	go run ./integration/bench -brokers artemis -scenarios loop,jms,protonc,pyproton
//	go run ./integration/bench -brokers rabbitmq4-classic,rabbitmq4-quorum -payloads p100 -scenarios loop,w1,w8,key8,batch
//	go run ./integration/bench -brokers artemis -payloads p100 -out docs/runs   # keep the result (runfile.go)
//	make bench                                             # the full set on every broker
package main

import (
	"context"
	"flag"
	"fmt"
	"math/rand"
	"net/url"
	"os"
	"os/signal"
	"path/filepath"
	"runtime"
	"runtime/debug"
	"slices"
	"strings"
	"syscall"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
)

// brokerNames are the brokers -brokers takes, in the order they run by
// default. The two RabbitMQ 4 ones are one broker (-rabbitmq4) with a
// queue of each kind.
var brokerNames = []string{"artemis", "rabbitmq", "rabbitmq4-classic", "rabbitmq4-quorum"}

type options struct {
	artemisURL, rabbitURL string
	rabbit4URL            string
	brokers               []string
	scenarios             []string
	allScenarios          bool // -scenarios all
	payloads              []string
	n, runs, credit       int
	groups, perLane       int
	zipf                  float64
	preloadLinks          int
	stall, timeout, probe time.Duration
	out, profileDir       string
	artemisPID, rabbitPID int
	rabbit4PID            int
	verbose               bool
}

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		os.Exit(1)
	}
}

func envOr(key, def string) string {
	if v := os.Getenv(key); v != "" {
		return v
	}
	return def
}

func list(s string) []string {
	var out []string
	for f := range strings.SplitSeq(s, ",") {
		if f = strings.TrimSpace(f); f != "" {
			out = append(out, f)
		}
	}
	return out
}

func parseFlags() (*options, error) {
	o := &options{}
	var brokers, scens, pays string
	flag.StringVar(&o.artemisURL, "artemis", envOr("AMQPSUB_ARTEMIS_URL", "amqp://127.0.0.1:5672"), "Artemis URL (default $AMQPSUB_ARTEMIS_URL)")
	flag.StringVar(&o.rabbitURL, "rabbitmq", envOr("AMQPSUB_RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5682"), "RabbitMQ 3.10 URL (default $AMQPSUB_RABBITMQ_URL)")
	flag.StringVar(&o.rabbit4URL, "rabbitmq4", envOr("AMQPSUB_RABBITMQ4_URL", "amqp://guest:guest@127.0.0.1:5692"), "RabbitMQ 4 URL, for rabbitmq4-classic and rabbitmq4-quorum (default $AMQPSUB_RABBITMQ4_URL)")
	flag.StringVar(&brokers, "brokers", strings.Join(brokerNames, ","), "brokers to run, in order: "+strings.Join(brokerNames, ", ")+
		" (RabbitMQ 4 on a classic and on a quorum queue, each declared with $AMQPSUB_RABBITMQ4_CTL or integration/rabbitmq4.sh)")
	flag.StringVar(&scens, "scenarios", "all", "scenarios to run: all, or a list of loop, w1, w1plain, w8, key8, keybal8, batch (each of these but w1plain also as w1fixed..., with FixedCredit), slow1, slow4, slow8, slow16, slow64, bal8, bal16, bal64, w1nomerge, key8nomerge, batchnomerge, jms, protonc, pyproton")
	flag.StringVar(&pays, "payloads", "p100,t1k", "payloads: p100 (100 B persistent), t1k (1 KiB non-persistent)")
	flag.IntVar(&o.n, "n", 100000, "messages preloaded per drain (plus one barrier)")
	flag.IntVar(&o.runs, "runs", 3, "runs of every scenario; the table shows the median")
	flag.IntVar(&o.credit, "credit", 256, "credit of the loop and of amqpsub, prefetch or window of the reference consumers")
	flag.IntVar(&o.groups, "groups", 100, "group-ids the messages spread over, round robin; 0 sends none")
	flag.Float64Var(&o.zipf, "zipf", 0, "0: groups round robin; s > 1: each message's group drawn from a Zipf distribution with exponent s over -groups (the same sequence every run)")
	flag.IntVar(&o.preloadLinks, "preload-links", 4, "senders that preload in parallel, each ending with an unsettled barrier")
	flag.IntVar(&o.perLane, "slow-per-lane", 5000, "1 ms scenarios drain at most this many messages per lane (0: -n)")
	flag.DurationVar(&o.stall, "stall", 20*time.Second, "a drain with no progress for this long fails")
	flag.DurationVar(&o.timeout, "timeout", 10*time.Minute, "a drain taking longer fails")
	flag.DurationVar(&o.probe, "probe", time.Second, "the queue counts as empty after a drain when a receiver gets nothing for this long")
	flag.StringVar(&o.out, "out", "", "also write the report, with the command, commit and machine, as a result file YYYY-MM-DD-<commit>-<what>.md in this directory (docs/runs)")
	flag.StringVar(&o.profileDir, "profile-dir", "", "write a CPU profile of each drain into this directory")
	flag.IntVar(&o.artemisPID, "artemis-pid", 0, "Artemis PID for its CPU (default: from $AMQPSUB_ARTEMIS_CTL pid)")
	flag.IntVar(&o.rabbitPID, "rabbitmq-pid", 0, "RabbitMQ beam PID for its CPU (default: from the PID file rabbitmq.sh has it write)")
	flag.IntVar(&o.rabbit4PID, "rabbitmq4-pid", 0, "RabbitMQ 4 beam PID for its CPU (default: from the PID file rabbitmq4.sh has it write, under $AMQPSUB_CACHE/rabbitmq4/state)")
	flag.BoolVar(&o.verbose, "v", false, "log amqpsub's warnings to stderr")
	flag.Parse()
	if flag.NArg() > 0 {
		return nil, fmt.Errorf("unexpected arguments %q", flag.Args())
	}
	o.brokers = list(brokers)
	for _, b := range o.brokers {
		if !slices.Contains(brokerNames, b) {
			return nil, fmt.Errorf("-brokers: unknown broker %q (want %s)", b, strings.Join(brokerNames, ", "))
		}
	}
	all := scenarios(o.groups)
	if scens == "all" {
		o.allScenarios = true
		for _, s := range all {
			o.scenarios = append(o.scenarios, s.name)
		}
	} else {
		o.scenarios = list(scens)
		for _, name := range o.scenarios {
			if !slices.ContainsFunc(all, func(s scenario) bool { return s.name == name }) {
				return nil, fmt.Errorf("-scenarios: unknown scenario %q", name)
			}
		}
	}
	o.payloads = list(pays)
	for _, p := range o.payloads {
		if !slices.ContainsFunc(payloads, func(q payload) bool { return q.name == p }) {
			return nil, fmt.Errorf("-payloads: unknown payload %q", p)
		}
	}
	switch {
	case o.n < 1, o.runs < 1, o.credit < 1, o.preloadLinks < 1, o.groups < 0, o.perLane < 0:
		return nil, fmt.Errorf("-n, -runs, -credit and -preload-links must be ≥ 1, -groups and -slow-per-lane ≥ 0")
	case o.zipf != 0 && (o.zipf <= 1 || o.groups < 2):
		return nil, fmt.Errorf("-zipf must be 0 or > 1, with -groups ≥ 2")
	case o.stall <= 0, o.timeout <= 0, o.probe <= 0:
		return nil, fmt.Errorf("-stall, -timeout and -probe must be > 0")
	}
	return o, nil
}

func logf(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "%s "+format+"\n", append([]any{time.Now().Format("15:04:05")}, args...)...)
}

func createFile(name string) (*os.File, error) {
	if err := os.MkdirAll(filepath.Dir(name), 0o755); err != nil {
		return nil, fmt.Errorf("create %s: %w", name, err)
	}
	f, err := os.Create(name)
	if err != nil {
		return nil, fmt.Errorf("create %s: %w", name, err)
	}
	return f, nil
}

// redact drops the password from a broker URL.
func redact(raw string) string {
	u, err := url.Parse(raw)
	if err != nil {
		return "(unparsable URL)"
	}
	if u.User != nil {
		u.User = url.User(u.User.Username())
	}
	return u.String()
}

// goAMQPVersion returns the go-amqp version built in.
func goAMQPVersion() string {
	if info, ok := debug.ReadBuildInfo(); ok {
		for _, d := range info.Deps {
			if d.Path == "github.com/Azure/go-amqp" {
				return d.Version
			}
		}
	}
	return "unknown"
}

// groupSequence returns the group-ids of the messages, message i taking
// element i%len: the groups in turn, or, with s > 1, 20,000 draws from a
// Zipf distribution (P(rank k) ∝ k^-s) with a fixed seed.
func groupSequence(groups int, s float64) []string {
	if s == 0 || groups == 0 {
		seq := make([]string, groups)
		for i := range seq {
			seq[i] = groupName(i)
		}
		return seq
	}
	z := rand.NewZipf(rand.New(rand.NewSource(1)), s, 1, uint64(groups-1))
	seq := make([]string, 20000)
	for i := range seq {
		seq[i] = groupName(int(z.Uint64()))
	}
	return seq
}

// sleepCost measures what time.Sleep(time.Millisecond) really takes here,
// which bounds a lane running the 1 ms handler.
func sleepCost() time.Duration {
	const n = 200
	start := time.Now()
	for range n {
		time.Sleep(time.Millisecond)
	}
	return time.Since(start) / n
}

// report collects the output, printing each part as it comes.
type report struct{ strings.Builder }

func (r *report) add(s string) {
	fmt.Print(s)
	r.WriteString(s)
}

func run() error {
	o, err := parseFlags()
	if err != nil {
		flag.Usage()
		return err
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()

	log := zap.NewNop()
	if o.verbose {
		cfg := zap.NewDevelopmentConfig()
		cfg.Level = zap.NewAtomicLevelAt(zapcore.WarnLevel)
		if log, err = cfg.Build(); err != nil {
			return fmt.Errorf("logger: %w", err)
		}
	}

	rec := runRecord{args: os.Args[1:], rev: currentRevision(), machine: currentMachine(),
		date: time.Now(), what: runSlug(o)}
	rep := &report{}
	err = bench(ctx, o, log, rep, rec.rev)
	if o.out != "" {
		// The tables measured so far go out even when a drain failed; the
		// report says so.
		rec.body = rep.String()
		path, ferr := writeRunFile(o.out, rec)
		if ferr != nil && err == nil {
			err = fmt.Errorf("-out: %w", ferr)
		}
		if ferr == nil {
			logf("wrote %s", path)
		}
	}
	return err
}

func bench(ctx context.Context, o *options, log *zap.Logger, rep *report, rev revision) error {
	sleep := sleepCost()
	load := loadAvg()
	rep.add(fmt.Sprintf("## Broker benchmark, %s\n\n", time.Now().UTC().Format("2006-01-02 15:04 MST")))
	rep.add(fmt.Sprintf("- machine: %d CPUs (%s), %s %s/%s; load average at start %s\n",
		runtime.NumCPU(), cpuModel(), runtime.Version(), runtime.GOOS, runtime.GOARCH, load))
	rep.add(fmt.Sprintf("- amqpsub %s, go-amqp %s; `-n %d -runs %d -credit %d -groups %d -zipf %g -slow-per-lane %d`\n",
		rev, goAMQPVersion(), o.n, o.runs, o.credit, o.groups, o.zipf, o.perLane))
	rep.add(fmt.Sprintf("- time.Sleep(time.Millisecond) takes %v here (mean of 200)\n", sleep.Round(time.Microsecond)))

	all := scenarios(o.groups)
	var chosen []scenario
	for _, s := range all {
		if slices.Contains(o.scenarios, s.name) {
			chosen = append(chosen, s)
		}
	}
	if o.allScenarios && !slices.Contains(o.brokers, "artemis") {
		chosen = slices.DeleteFunc(chosen, func(s scenario) bool { return s.ref != "" })
	}
	about, err := prepareRefs(ctx, chosen, o.timeout)
	if err != nil {
		return err
	}
	for _, line := range about {
		rep.add(fmt.Sprintf("- reference consumer %s\n", line))
	}
	groups := groupSequence(o.groups, o.zipf)
	if notes := keyNotes(chosen, groups, sleep); notes != "" {
		rep.add("\nHow far the lanes and the key spread let the 1 ms scenarios go, one sleep (c) per message:\n\n" + notes)
	}
	rep.add("\n")
	for _, name := range o.brokers {
		addr, pid := o.artemisURL, o.artemisPID
		switch name {
		case "rabbitmq":
			addr, pid = o.rabbitURL, o.rabbitPID
		case "rabbitmq4-classic", "rabbitmq4-quorum":
			addr, pid = o.rabbit4URL, o.rabbit4PID
		}
		b, err := newBroker(ctx, name, addr, pid)
		if err != nil {
			return err
		}
		use := chosen
		if o.allScenarios && name != "artemis" {
			use = slices.DeleteFunc(slices.Clone(chosen), func(s scenario) bool { return s.ref != "" })
			if len(use) < len(chosen) {
				why := refOnRabbit
				if b.queueKind != "" {
					why = refOnRabbit4
				}
				rep.add(fmt.Sprintf("On %s, \"all\" leaves the reference consumers out: %s\n\n", b.label, why))
			}
		}
		// A reference consumer that cannot run against this broker fails
		// before a queue is preloaded.
		for _, s := range use {
			if s.ref != "" {
				if _, err := refConsumers[s.ref].args(b, "q", 1, o.credit, o.stall); err != nil {
					return fmt.Errorf("%s on %s: %w", s.name, name, err)
				}
			}
		}
		for _, pname := range o.payloads {
			i := slices.IndexFunc(payloads, func(p payload) bool { return p.name == pname })
			if err := benchPayload(ctx, o, log, rep, b, payloads[i], use, groups); err != nil {
				return err
			}
		}
	}
	return nil
}

func benchPayload(ctx context.Context, o *options, log *zap.Logger, rep *report, b *broker, p payload,
	chosen []scenario, groups []string) (err error) {
	queue := fmt.Sprintf("bench.%s.%s.%d", b.name, p.name, time.Now().UnixNano())
	set := make([]*series, len(chosen))
	var loop *series
	for i, sc := range chosen {
		set[i] = &series{sc: sc}
		if sc.loop {
			loop = set[i]
		}
	}
	loadBefore := loadAvg()
	// The table goes out even when a drain fails, with what was measured.
	defer func() {
		rep.add(fmt.Sprintf("### %s, %s: %s\n\n", b.label, p.title, redact(b.url)))
		pidNote := fmt.Sprintf("broker PID %d", b.pid)
		if b.pid == 0 {
			pidNote = "broker CPU unknown: " + b.pidErr
		}
		rep.add(fmt.Sprintf("Queue `%s`, %s; load average %s before, %s after.\n\n", queue, pidNote, loadBefore, loadAvg()))
		rep.add(table(set, loop, o.credit))
		if err != nil {
			rep.add(fmt.Sprintf("\n**Stopped by an error:** %v\n", err))
		}
		rep.add("\n")
		if derr := deleteQueue(b, queue); derr != nil {
			logf("%v", derr)
		}
	}()

	// RabbitMQ 4's queue is declared once, before the first preload, and
	// deleted (above) after the last drain.
	if err := declareQueue(b, queue); err != nil {
		return err
	}
	for r := 1; r <= o.runs; r++ {
		for _, s := range set {
			n := s.sc.messages(o.n, o.perLane)
			tag := fmt.Sprintf("%s %s run %d/%d %s", b.name, p.name, r, o.runs, s.sc.name)
			took, err := preload(ctx, b, queue, n, o.preloadLinks, p, groups)
			if err != nil {
				return fmt.Errorf("%s: %w", tag, err)
			}
			logf("%s: preloaded %d in %v (%s msgs/s)", tag, n+1, took.Round(time.Millisecond), num(float64(n+1)/took.Seconds()))
			rc := runConfig{credit: o.credit, stall: o.stall, timeout: o.timeout, log: log}
			if o.profileDir != "" {
				rc.profile = filepath.Join(o.profileDir, fmt.Sprintf("%s-%s-%s-run%d.cpu.pprof", b.name, p.name, s.sc.name, r))
			}
			res, err := drain(ctx, b, queue, n+1, s.sc, rc)
			if err != nil {
				return fmt.Errorf("%s: %w", tag, err)
			}
			if err := probeEmpty(ctx, b, queue, o.probe); err != nil {
				return fmt.Errorf("%s: %w", tag, err)
			}
			s.runs = append(s.runs, res)
			logf("%s: drained %d in %v: %s msgs/s, client %.2f cores, broker %.2f cores, max held %d, overshoot %d",
				tag, res.msgs, res.elapsed.Round(time.Millisecond), num(res.rate()),
				res.client.Seconds()/res.elapsed.Seconds(), res.broker.Seconds()/res.elapsed.Seconds(),
				res.maxHeld, res.overshoot)
			if s.sc.slow {
				logf("%s: handler mean %v, lanes busy %.0f%%", tag,
					(res.busy / time.Duration(res.msgs)).Round(time.Microsecond), 100*res.laneUse(s.sc.lanes))
			}
		}
		if loop != nil && len(loop.runs) == r {
			ref := loop.runs[r-1].rate()
			for _, s := range set {
				if s != loop && len(s.runs) == r {
					s.ratios = append(s.ratios, s.runs[r-1].rate()/ref)
				}
			}
		}
	}
	return nil
}
