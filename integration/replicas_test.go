package integration

// Replicas scale a queue out: several consumer processes, built from
// examples/replicas, share one Artemis queue. Each replica writes a line per
// handled message to its stdout before the handler returns (so before the
// message is accepted); the test merges the lines of all replicas by their
// wall-clock time and checks, per group: nothing lost, duplicates, which
// replicas handled the group and when, and the order.

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"maps"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/Azure/go-amqp"

	"github.com/amqpsub/amqpsub/amqpsub"
)

// replicaEvent is one handled message, as a replica reported it.
type replicaEvent struct {
	replica string
	group   string // "" for none
	seq     int
	count   uint32 // delivery-count
	first   bool   // first-acquirer
	at      int64  // wall clock (UnixNano) when the handler was called
	index   int    // arrival order at the test, to break ties
}

// replicaStats is the "stats" line a replica prints when it exits cleanly.
type replicaStats struct {
	received, accepted, released, modified, rejected, maxHeld int
}

// replicaLog collects the lines of every replica of a run.
type replicaLog struct {
	mu     sync.Mutex
	events []replicaEvent
	keys   map[msgKey]int // distinct messages handled
	stats  map[string]replicaStats
	held   map[string]int // the last deliveries-held figure of each replica
	// reconnects are the lost links the replicas replaced, in order.
	reconnects []replicaReconnect
}

// replicaReconnect is a replica's "reconnected" line: the broker it
// attached to and when (Unix nanoseconds).
type replicaReconnect struct {
	replica, broker string
	at              int64
}

type msgKey struct {
	group string
	seq   int
}

func (l *replicaLog) add(line string) error {
	f := strings.Fields(line)
	l.mu.Lock()
	defer l.mu.Unlock()
	switch {
	case len(f) == 8 && f[0] == "handled":
		seq, err1 := strconv.Atoi(f[3])
		count, err2 := strconv.ParseUint(f[4], 10, 32)
		first, err3 := strconv.ParseBool(f[5])
		at, err4 := strconv.ParseInt(f[7], 10, 64)
		if err1 != nil || err2 != nil || err3 != nil || err4 != nil {
			return fmt.Errorf("bad event line %q", line)
		}
		g := f[2]
		if g == "-" {
			g = ""
		}
		l.events = append(l.events, replicaEvent{replica: f[1], group: g, seq: seq, count: uint32(count),
			first: first, at: at, index: len(l.events)})
		l.keys[msgKey{g, seq}]++
	case len(f) == 8 && f[0] == "stats":
		var n [6]int
		for i := range n {
			v, err := strconv.Atoi(f[2+i])
			if err != nil {
				return fmt.Errorf("bad stats line %q", line)
			}
			n[i] = v
		}
		l.stats[f[1]] = replicaStats{n[0], n[1], n[2], n[3], n[4], n[5]}
	case len(f) == 3 && f[0] == "held":
		n, err := strconv.Atoi(f[2])
		if err != nil {
			return fmt.Errorf("bad held line %q", line)
		}
		l.held[f[1]] = n
	case len(f) == 2 && f[0] == "ready":
	case len(f) == 4 && f[0] == "reconnected":
		at, err := strconv.ParseInt(f[3], 10, 64)
		if err != nil {
			return fmt.Errorf("bad reconnected line %q", line)
		}
		l.reconnects = append(l.reconnects, replicaReconnect{replica: f[1], broker: f[2], at: at})
	default:
		return fmt.Errorf("unexpected line %q", line)
	}
	return nil
}

// distinct returns how many distinct grouped messages were handled.
func (l *replicaLog) distinct() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	n := len(l.keys)
	if l.keys[msgKey{"", -1}] > 0 {
		n-- // the publisher's barrier
	}
	return n
}

// handledBy returns how many messages replica handled so far.
func (l *replicaLog) handledBy(replica string) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	n := 0
	for _, e := range l.events {
		if e.replica == replica {
			n++
		}
	}
	return n
}

// snapshot returns the events so far, ordered by the time their handler
// was called.
func (l *replicaLog) snapshot() []replicaEvent {
	l.mu.Lock()
	evs := slices.Clone(l.events)
	l.mu.Unlock()
	slices.SortStableFunc(evs, func(a, b replicaEvent) int {
		if a.at != b.at {
			return int(a.at - b.at)
		}
		return a.index - b.index
	})
	return evs
}

// replicaProc is one replica process.
type replicaProc struct {
	id     string
	cmd    *exec.Cmd
	ready  chan struct{}
	exited chan struct{} // closed once stdout is drained and the process waited for
	err    error         // Wait's result, set before exited is closed
	stderr *syncBuffer
}

type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// summary returns the human-readable summary the replica printed at exit.
func (p *replicaProc) summary() string {
	out := p.stderr.String()
	if i := strings.Index(out, "replica "+p.id+":"); i >= 0 {
		return strings.TrimRight(out[i:], "\n")
	}
	return "(no summary)"
}

// replicaRun is a set of replica processes on one queue.
type replicaRun struct {
	t     *testing.T
	bin   string
	url   string
	queue string
	flags []string
	log   *replicaLog
	procs map[string]*replicaProc
}

func newReplicaRun(t *testing.T, bin, url, queue string, flags ...string) *replicaRun {
	r := &replicaRun{t: t, bin: bin, url: url, queue: queue, flags: flags,
		log:   &replicaLog{keys: map[msgKey]int{}, stats: map[string]replicaStats{}, held: map[string]int{}},
		procs: map[string]*replicaProc{}}
	t.Cleanup(r.killAll)
	return r
}

// start starts replica id with the run's flags and extra, and waits until
// its receiver is attached.
func (r *replicaRun) start(id string, extra ...string) *replicaProc {
	r.t.Helper()
	p := r.launch(id, extra...)
	r.waitReady(p)
	return p
}

// startTogether starts the replicas ids at once, and then waits until
// each one's receiver is attached.
func (r *replicaRun) startTogether(ids ...string) {
	r.t.Helper()
	var ps []*replicaProc
	for _, id := range ids {
		ps = append(ps, r.launch(id))
	}
	for _, p := range ps {
		r.waitReady(p)
	}
}

// launch starts replica id without waiting for it.
func (r *replicaRun) launch(id string, extra ...string) *replicaProc {
	r.t.Helper()
	args := append([]string{"-url", r.url, "-queue", r.queue, "-id", id, "-events", "-report", "0"}, r.flags...)
	args = append(args, extra...)
	cmd := exec.Command(r.bin, args...)
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		r.t.Fatal(err)
	}
	p := &replicaProc{id: id, cmd: cmd, ready: make(chan struct{}), exited: make(chan struct{}), stderr: &syncBuffer{}}
	cmd.Stderr = p.stderr
	if err := cmd.Start(); err != nil {
		r.t.Fatalf("start replica %s: %v", id, err)
	}
	r.procs[id] = p
	go func() {
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			line := sc.Text()
			if strings.HasPrefix(line, "ready ") {
				close(p.ready)
			}
			if err := r.log.add(line); err != nil {
				r.t.Errorf("replica %s: %v", id, err)
			}
		}
		p.err = cmd.Wait()
		close(p.exited)
	}()
	return p
}

// waitReady waits until p's receiver is attached.
func (r *replicaRun) waitReady(p *replicaProc) {
	r.t.Helper()
	select {
	case <-p.ready:
	case <-p.exited:
		r.t.Fatalf("replica %s exited before attaching (%v): %s", p.id, p.err, p.stderr)
	case <-time.After(30 * time.Second):
		r.t.Fatalf("replica %s not attached within 30 s: %s", p.id, p.stderr)
	}
}

// stop sends sig to replica id and waits until it has exited.
func (r *replicaRun) stop(id string, sig syscall.Signal) {
	r.t.Helper()
	p := r.procs[id]
	if err := p.cmd.Process.Signal(sig); err != nil {
		r.t.Fatalf("signal %v to replica %s: %v", sig, id, err)
	}
	select {
	case <-p.exited:
	case <-time.After(time.Minute):
		r.t.Fatalf("replica %s still running a minute after %v", id, sig)
	}
	if sig == syscall.SIGTERM && p.err != nil {
		r.t.Fatalf("replica %s after SIGTERM: %v\n%s", id, p.err, p.stderr)
	}
}

// stopAll stops every running replica gracefully.
func (r *replicaRun) stopAll() {
	r.t.Helper()
	for _, id := range slices.Sorted(maps.Keys(r.procs)) {
		select {
		case <-r.procs[id].exited:
		default:
			r.stop(id, syscall.SIGTERM)
		}
	}
}

// killAll kills whatever still runs; it is the cleanup of every run.
func (r *replicaRun) killAll() {
	for id, p := range r.procs {
		select {
		case <-p.exited:
			continue
		default:
		}
		p.cmd.Process.Kill()
		select {
		case <-p.exited:
		case <-time.After(10 * time.Second):
			r.t.Errorf("replica %s (pid %d) survived SIGKILL", id, p.cmd.Process.Pid)
		}
	}
	if r.t.Failed() {
		for _, id := range slices.Sorted(maps.Keys(r.procs)) {
			r.t.Logf("replica %s stderr:\n%s", id, r.procs[id].stderr)
		}
	}
}

// waitHandled waits until n distinct grouped messages were handled.
func (r *replicaRun) waitHandled(n int, within time.Duration) {
	r.t.Helper()
	waitFor(r.t, within, fmt.Sprintf("%d messages handled", n), func() bool { return r.log.distinct() >= n })
}

func (r *replicaRun) logSummaries() {
	for _, id := range slices.Sorted(maps.Keys(r.procs)) {
		r.t.Log(r.procs[id].summary())
	}
}

// groupFigures is what the merged events say about one group.
type groupFigures struct {
	handled    int
	duplicates int      // handlings beyond the first of a message
	violations int      // handlings whose seq is not the previous handling's + 1
	reorders   int      // first handlings whose seq is not the previous first handling's + 1
	runs       []string // replicas in the order they handled the group, consecutive repeats merged
	overlap    bool     // two replicas' handling intervals of the group overlap
}

// figures is the analysis of a run.
type figures struct {
	messages   int
	lost       []msgKey
	duplicates int
	violations int
	reorders   int
	groups     map[string]*groupFigures
	replicas   map[string]int            // messages handled per replica
	groupsOf   map[string]map[string]int // replica → group → messages
}

// analyse merges the events of all replicas and checks them against the
// published messages. The barrier of publishFast (no group, seq -1) is left
// out.
func analyse(evs []replicaEvent, published []msgSpec) *figures {
	f := &figures{messages: len(published), groups: map[string]*groupFigures{},
		replicas: map[string]int{}, groupsOf: map[string]map[string]int{}}
	seen := map[msgKey]int{}
	last := map[string]int{}
	lastFirst := map[string]int{}
	span := map[string]map[string][2]int64{} // group → replica → first, last time
	for _, e := range evs {
		if e.group == "" && e.seq == -1 {
			continue
		}
		g := f.groups[e.group]
		if g == nil {
			g = &groupFigures{}
			f.groups[e.group] = g
			last[e.group], lastFirst[e.group] = -1, -1
			span[e.group] = map[string][2]int64{}
		}
		g.handled++
		f.replicas[e.replica]++
		if f.groupsOf[e.replica] == nil {
			f.groupsOf[e.replica] = map[string]int{}
		}
		f.groupsOf[e.replica][e.group]++
		if n := len(g.runs); n == 0 || g.runs[n-1] != e.replica {
			g.runs = append(g.runs, e.replica)
		}
		s, ok := span[e.group][e.replica]
		if !ok {
			s[0] = e.at
		}
		s[1] = e.at
		span[e.group][e.replica] = s
		k := msgKey{e.group, e.seq}
		seen[k]++
		if seen[k] > 1 {
			g.duplicates++
		} else {
			if e.seq != lastFirst[e.group]+1 {
				g.reorders++
			}
			lastFirst[e.group] = e.seq
		}
		if e.seq != last[e.group]+1 {
			g.violations++
		}
		last[e.group] = e.seq
	}
	for name, g := range f.groups {
		f.duplicates += g.duplicates
		f.violations += g.violations
		f.reorders += g.reorders
		var spans [][2]int64
		for _, s := range span[name] {
			spans = append(spans, s)
		}
		for i := range spans {
			for j := i + 1; j < len(spans); j++ {
				if spans[i][0] <= spans[j][1] && spans[j][0] <= spans[i][1] {
					g.overlap = true
				}
			}
		}
	}
	for _, m := range published {
		if seen[msgKey{m.group, m.seq}] == 0 {
			f.lost = append(f.lost, msgKey{m.group, m.seq})
		}
	}
	return f
}

// perGroup lists the groups with a non-zero figure, as "group:n".
func (f *figures) perGroup(pick func(*groupFigures) int) string {
	var out []string
	for _, name := range slices.Sorted(maps.Keys(f.groups)) {
		if n := pick(f.groups[name]); n != 0 {
			out = append(out, fmt.Sprintf("%s:%d", name, n))
		}
	}
	if len(out) == 0 {
		return "none"
	}
	return strings.Join(out, " ")
}

func (f *figures) log(t *testing.T, scenario string) {
	t.Helper()
	var per []string
	for _, r := range slices.Sorted(maps.Keys(f.replicas)) {
		per = append(per, fmt.Sprintf("%s %d msgs/%d groups", r, f.replicas[r], len(f.groupsOf[r])))
	}
	t.Logf("%s: %d messages, %d replicas (%s); lost %d, duplicates %d, order violations %d (first handlings out of order: %d)",
		scenario, f.messages, len(f.replicas), strings.Join(per, ", "), len(f.lost), f.duplicates, f.violations, f.reorders)
	t.Logf("  per group: duplicates %s", f.perGroup(func(g *groupFigures) int { return g.duplicates }))
	t.Logf("  per group: order violations %s", f.perGroup(func(g *groupFigures) int { return g.violations }))
	t.Logf("  per group: first handlings out of order %s", f.perGroup(func(g *groupFigures) int { return g.reorders }))
}

// Three replica processes on one Artemis queue, and what happens to the
// groups when one stops gracefully, is killed, closes a group, or joins a
// queue with group-rebalance. The figures each scenario logs are in
// docs/brokers.md, "Message groups and replicas".
func TestArtemisReplicas(t *testing.T) {
	url := artemisURL(t)
	bin := buildReplicas(t, t.TempDir())
	conn := dial(t, url)

	// Nothing left on the queue once every replica has stopped.
	assertEmpty := func(t *testing.T, q string) {
		t.Helper()
		if n := queueAttribute(t, conn, q, "messageCount"); n != "0" {
			t.Errorf("%s messages left on queue %s", n, q)
		}
	}

	t.Run("no failures", func(t *testing.T) {
		q := queueName(t)
		run := newReplicaRun(t, bin, url, q, "-lanes", "8", "-work", "1ms")
		for _, id := range []string{"r1", "r2", "r3"} {
			run.start(id)
		}
		const n = 20000
		msgs := groups(n, 100)
		publishFast(t, conn, q, true, msgs)
		run.waitHandled(n, 2*time.Minute)
		run.stopAll()
		run.logSummaries()
		f := analyse(run.log.snapshot(), msgs)
		f.log(t, "no failures")

		if len(f.lost) != 0 || f.duplicates != 0 || f.violations != 0 {
			t.Errorf("lost %d, duplicates %d, order violations %d; want 0, 0, 0", len(f.lost), f.duplicates, f.violations)
		}
		for name, g := range f.groups {
			if len(g.runs) != 1 {
				t.Errorf("group %s handled by %v; want one replica", name, g.runs)
			}
		}
		accepted := 0
		for _, id := range []string{"r1", "r2", "r3"} {
			if len(f.groupsOf[id]) == 0 {
				t.Errorf("replica %s got no group", id)
			}
			st := run.log.stats[id]
			accepted += st.accepted
			if st.released+st.modified+st.rejected != 0 {
				t.Errorf("replica %s settled other than accepted: %+v", id, st)
			}
		}
		if accepted != n+1 { // with the barrier
			t.Errorf("accepted %d in all; want %d, each message once", accepted, n+1)
		}
		assertEmpty(t, q)
	})

	// Artemis hands out a queue in order, and each consumer's walk through
	// it stops at the first message whose group belongs to a consumer with
	// no credit left: with a fixed credit, replicas move through the queue
	// together, at the pace of the slowest. The adaptive credit holds a
	// slow replica's backlog on top of what its lanes start (parked), so
	// that replica seldom runs out of credit; how far the fast ones then
	// get ahead is logged.
	for _, fixed := range []bool{true, false} {
		name := "slow replica"
		var flags []string
		if fixed {
			name += " FixedCredit"
			flags = []string{"-fixed-credit"}
		}
		t.Run(name, func(t *testing.T) {
			q := queueName(t)
			run := newReplicaRun(t, bin, url, q, append([]string{"-lanes", "4"}, flags...)...)
			run.start("fast1", "-work", "0")
			run.start("fast2", "-work", "0")
			run.start("slow", "-work", "20ms")
			const n = 4500
			msgs := groups(n, 60)
			publishFast(t, conn, q, true, msgs)
			run.waitHandled(n, 2*time.Minute)
			run.stopAll()
			run.logSummaries()
			evs := run.log.snapshot()
			f := analyse(evs, msgs)
			f.log(t, name)
			if len(f.lost) != 0 || f.duplicates != 0 || f.violations != 0 {
				t.Errorf("lost %d, duplicates %d, order violations %d; want 0, 0, 0", len(f.lost), f.duplicates, f.violations)
			}
			start, done := int64(0), map[string]int64{}
			for _, e := range evs {
				if e.group == "" {
					continue
				}
				if start == 0 {
					start = e.at
				}
				done[e.replica] = e.at - start
			}
			for _, id := range []string{"fast1", "fast2", "slow"} {
				t.Logf("%s: %d messages, its last one %v after the first of the run; max held %d",
					id, f.replicas[id], time.Duration(done[id]).Round(time.Millisecond), run.log.stats[id].maxHeld)
			}
			if !fixed {
				return
			}
			// Alone, a fast replica would finish its third in a fraction of
			// the slow one's time; held back, it finishes about when the
			// slow one does, less the slow one's last credit's worth.
			for _, id := range []string{"fast1", "fast2"} {
				if done[id] < done["slow"]/2 {
					t.Errorf("%s finished after %v, the slow replica after %v: the fast replicas were not held back",
						id, time.Duration(done[id]), time.Duration(done["slow"]))
				}
			}
		})
	}

	// Stop r2 once a third of the stream is handled. Two lanes and up to
	// 4 ms of work a message keep the replicas behind the publisher, so
	// messages wait in the broker, and r2 holds deliveries when it stops
	// (how many depends on where the lockstep of "slow replica" leaves it).
	handover := func(t *testing.T, sig syscall.Signal) (*replicaRun, *figures, []msgSpec) {
		q := queueName(t)
		run := newReplicaRun(t, bin, url, q, "-lanes", "2", "-work", "4ms")
		run.start("r1")
		run.start("r2", "-report", "50ms")
		run.start("r3")
		const n = 12000
		msgs := groups(n, 100)
		publishFast(t, conn, q, true, msgs)
		run.waitHandled(n/3, 2*time.Minute)
		stoppedAt := run.log.handledBy("r2")
		run.log.mu.Lock()
		held := run.log.held["r2"]
		run.log.mu.Unlock()
		run.stop("r2", sig)
		t.Logf("r2 stopped by %v after handling %d messages; it held %d deliveries at its last report (≤ 50 ms before)", sig, stoppedAt, held)
		run.waitHandled(n, 2*time.Minute)
		run.stopAll()
		run.logSummaries()
		f := analyse(run.log.snapshot(), msgs)
		if len(f.lost) != 0 {
			t.Errorf("%d messages lost, such as %v", len(f.lost), f.lost[:min(5, len(f.lost))])
		}
		// Groups never go back to the stopped replica, and only its groups
		// move: one owner at a time, one handover at most.
		moved := 0
		for name, g := range f.groups {
			switch {
			case len(g.runs) == 1:
			case len(g.runs) == 2 && g.runs[0] == "r2":
				moved++
			default:
				t.Errorf("group %s handled by %v; want one replica, or r2 then one other", name, g.runs)
			}
		}
		t.Logf("%d of r2's %d groups moved to r1 or r3", moved, len(f.groupsOf["r2"]))
		if moved == 0 {
			t.Error("no group moved off r2")
		}
		assertEmpty(t, q)
		return run, f, msgs
	}

	t.Run("graceful handover", func(t *testing.T) {
		run, f, _ := handover(t, syscall.SIGTERM)
		f.log(t, "graceful handover")
		st := run.log.stats["r2"]
		t.Logf("r2 at its stop: %+v", st)
		// r2 settled what it handled and released the rest, which it never
		// handled; Artemis requeues released deliveries in queue order and
		// frees r2's groups only when r2's link closes, after the last
		// settlement. So: no duplicates, and every group in order.
		if f.duplicates != 0 || f.violations != 0 {
			t.Errorf("duplicates %d, order violations %d; want 0 after a graceful stop", f.duplicates, f.violations)
		}
		if st.accepted != run.log.handledBy("r2") {
			t.Errorf("r2 handled %d but accepted %d", run.log.handledBy("r2"), st.accepted)
		}
		redelivered := 0
		for _, e := range run.log.snapshot() {
			if e.replica != "r2" && !e.first {
				redelivered++
			}
		}
		t.Logf("r2 released %d deliveries; r1 and r3 saw %d deliveries with first-acquirer false", st.released, redelivered)
	})

	t.Run("kill -9 handover", func(t *testing.T) {
		run, f, _ := handover(t, syscall.SIGKILL)
		f.log(t, "kill -9 handover")
		const credit = 256
		// Duplicates are deliveries r2 handled whose acceptance never reached
		// the broker: at most what r2 held, its credit.
		if f.duplicates > credit {
			t.Errorf("%d duplicates > r2's credit %d", f.duplicates, credit)
		}
		handledBy := map[msgKey][]replicaEvent{}
		for _, e := range run.log.snapshot() {
			if e.group != "" {
				k := msgKey{e.group, e.seq}
				handledBy[k] = append(handledBy[k], e)
			}
		}
		for k, evs := range handledBy {
			if len(evs) < 2 {
				continue
			}
			// Artemis closes an AMQP consumer as not failed even when its
			// connection died, so the redelivery carries the delivery-count
			// of the first delivery: nothing in it says it is one.
			t.Logf("duplicate %s/%d: handled by %s (delivery-count %d), then by %s (delivery-count %d)",
				k.group, k.seq, evs[0].replica, evs[0].count, evs[1].replica, evs[1].count)
			if len(evs) > 2 || evs[0].replica != "r2" || evs[1].replica == "r2" {
				t.Errorf("message %v handled as %+v; want once by r2, then once elsewhere", k, evs)
			}
		}
		// The unacknowledged tail of each of r2's groups comes back in order,
		// so a group with duplicates steps back once, and first handlings
		// stay in order.
		for name, g := range f.groups {
			want := 0
			if g.duplicates > 0 {
				want = 1
			}
			if g.violations != want || g.reorders != 0 {
				t.Errorf("group %s: %d order violations (%d first handlings out of order) with %d duplicates; want %d (0)",
					name, g.violations, g.reorders, g.duplicates, want)
			}
		}
	})

	// closing builds the messages of groups "c00".. with seqs from..to; the
	// one with seq closeAt carries group-sequence −1, as the AMQP uint it
	// becomes: 0xFFFFFFFF. Group "open" (never closed) gets the same seqs.
	closing := func(groupsN, from, to, closeAt int) ([]msgSpec, []*amqp.Message) {
		var specs []msgSpec
		var msgs []*amqp.Message
		for seq := from; seq <= to; seq++ {
			for g := range groupsN + 1 {
				s := msgSpec{group: fmt.Sprintf("c%02d", g), seq: seq}
				if g == groupsN {
					s.group = "open"
				}
				m := message(s)
				if seq == closeAt && s.group != "open" {
					closing := uint32(0xFFFFFFFF)
					m.Properties.GroupSequence = &closing
				}
				specs = append(specs, s)
				msgs = append(msgs, m)
			}
		}
		return specs, msgs
	}
	// sides splits the replicas that handled each group at seq closeAt.
	sides := func(evs []replicaEvent, closeAt int) (before, after map[string][]string) {
		b, a := map[string]map[string]bool{}, map[string]map[string]bool{}
		for _, e := range evs {
			if e.group == "" {
				continue
			}
			side := b
			if e.seq > closeAt {
				side = a
			}
			if side[e.group] == nil {
				side[e.group] = map[string]bool{}
			}
			side[e.group][e.replica] = true
		}
		before, after = map[string][]string{}, map[string][]string{}
		for g, rs := range b {
			before[g] = slices.Sorted(maps.Keys(rs))
		}
		for g, rs := range a {
			after[g] = slices.Sorted(maps.Keys(rs))
		}
		return before, after
	}

	// A closed group is forgotten by the broker: its next message is
	// assigned afresh, here to a replica that joined after the close.
	t.Run("group close", func(t *testing.T) {
		q := queueName(t)
		run := newReplicaRun(t, bin, url, q, "-lanes", "4", "-work", "1ms")
		for _, id := range []string{"r1", "r2", "r3"} {
			run.start(id)
		}
		const groupsN, closeAt, last = 30, 10, 20
		specs1, msgs1 := closing(groupsN, 0, closeAt, closeAt)
		publishMessages(t, conn, q, true, msgs1)
		run.waitHandled(len(msgs1), time.Minute)
		// Every closed group's binding is gone; the open group's stays.
		if n := queueAttribute(t, conn, q, "groupCount"); n != "1" {
			t.Errorf("after the closes the queue has %s groups; want 1 (the open one)", n)
		}
		run.start("r4")
		specs2, msgs2 := closing(groupsN, closeAt+1, last, -1)
		publishMessages(t, conn, q, true, msgs2)
		run.waitHandled(len(msgs1)+len(msgs2), time.Minute)
		run.stopAll()
		run.logSummaries()
		evs := run.log.snapshot()
		f := analyse(evs, append(specs1, specs2...))
		f.log(t, "group close")
		if len(f.lost) != 0 || f.duplicates != 0 || f.violations != 0 {
			t.Errorf("lost %d, duplicates %d, order violations %d; want 0, 0, 0", len(f.lost), f.duplicates, f.violations)
		}
		before, after := sides(evs, closeAt)
		moved, toR4 := 0, 0
		for g := range f.groups {
			if len(before[g]) != 1 || len(after[g]) != 1 {
				t.Errorf("group %s: up to its close on %v, after on %v; want one replica each", g, before[g], after[g])
				continue
			}
			if g == "open" {
				if before[g][0] != after[g][0] {
					t.Errorf("the open group moved from %s to %s", before[g][0], after[g][0])
				}
				continue
			}
			if before[g][0] != after[g][0] {
				moved++
			}
			if after[g][0] == "r4" {
				toR4++
			}
		}
		t.Logf("after their close, %d of %d groups went to another replica, %d of them to r4, which joined after the close",
			moved, groupsN, toR4)
		if toR4 == 0 {
			t.Error("no closed group went to r4; a closed group's next message should be assigned afresh")
		}
		assertEmpty(t, q)
	})

	// The close as a producer would send it mid-stream: the messages after
	// the close are queued while the owner still works on the ones before,
	// so the group's new owner may start before the old one is done.
	t.Run("group close mid-stream", func(t *testing.T) {
		q := queueName(t)
		run := newReplicaRun(t, bin, url, q, "-lanes", "4", "-work", "2ms")
		for _, id := range []string{"r1", "r2", "r3"} {
			run.start(id)
		}
		const groupsN, closeAt, last = 31, 10, 20
		specs, msgs := closing(groupsN, 0, last, closeAt)
		publishMessages(t, conn, q, true, msgs)
		run.waitHandled(len(msgs), time.Minute)
		run.stopAll()
		run.logSummaries()
		evs := run.log.snapshot()
		f := analyse(evs, specs)
		f.log(t, "group close mid-stream")
		if len(f.lost) != 0 || f.duplicates != 0 {
			t.Errorf("lost %d, duplicates %d; want 0, 0", len(f.lost), f.duplicates)
		}
		before, after := sides(evs, closeAt)
		moved, reordered := 0, 0
		for name, g := range f.groups {
			if len(before[name]) != 1 || len(after[name]) != 1 {
				t.Errorf("group %s: up to its close on %v, after on %v; want one replica each", name, before[name], after[name])
				continue
			}
			if before[name][0] == after[name][0] {
				// One replica, one lane: the close changes nothing.
				if g.violations != 0 {
					t.Errorf("group %s stayed on %s but has %d order violations", name, before[name][0], g.violations)
				}
				continue
			}
			moved++
			if g.violations > 0 {
				reordered++
			}
		}
		t.Logf("after their close, %d of %d groups went to another replica; in %d of those a message after the close was handled before one up to it",
			moved, groupsN, reordered)
		assertEmpty(t, q)
	})

	// A third replica joins two that own every group. Without
	// group-rebalance it gets none of them; with it, groups are reassigned
	// at once; with rebalance and pause-dispatch, only after every delivery
	// in flight is settled. A queue that stops dispatching (messages waiting,
	// none delivering, no progress for a second) fails the test, unless
	// nudge is set: then one more message is sent, which makes Artemis look
	// at the queue again, and the stall is counted.
	join := func(t *testing.T, q string, nudge bool) (run *replicaRun, f *figures, changed, moved, stalls int) {
		run = newReplicaRun(t, bin, url, q, "-lanes", "2", "-work", "4ms")
		run.start("r1")
		run.start("r2")
		const n = 9000
		msgs := groups(n, 60)
		publishFast(t, conn, q, true, msgs)
		run.waitHandled(n/4, 2*time.Minute)
		run.start("r3")
		joinedAt := run.log.distinct()
		deadline := time.Now().Add(2 * time.Minute)
		last, lastAt := -1, time.Now()
		for run.log.distinct() < n {
			if time.Now().After(deadline) {
				t.Fatalf("%d of %d messages handled after 2 minutes", run.log.distinct(), n)
			}
			if h := run.log.distinct(); h != last {
				last, lastAt = h, time.Now()
			} else if time.Since(lastAt) > time.Second {
				waiting, delivering := queueAttribute(t, conn, q, "messageCount"), queueAttribute(t, conn, q, "deliveringCount")
				if delivering == "0" && waiting != "0" {
					if !nudge {
						t.Fatalf("the queue stopped dispatching: %s messages waiting, none delivering, %d of %d handled", waiting, h, n)
					}
					stalls++
					t.Logf("the queue stopped dispatching at %d of %d handled (%s messages waiting, none delivering); nudging it with one message", h, n, waiting)
					publishMessages(t, conn, q, true, nil)
				}
				lastAt = time.Now()
			}
			time.Sleep(10 * time.Millisecond)
		}
		run.stopAll()
		run.logSummaries()
		f = analyse(run.log.snapshot(), msgs)
		if len(f.lost) != 0 || f.duplicates != 0 {
			t.Errorf("lost %d, duplicates %d; want 0, 0", len(f.lost), f.duplicates)
		}
		for _, g := range f.groups {
			if slices.Contains(g.runs, "r3") && g.runs[0] != "r3" {
				moved++
			}
			if len(g.runs) > 1 {
				changed++
			}
		}
		t.Logf("r3 joined after %d of %d messages; it took over %d of 60 groups; %d groups changed replica", joinedAt, n, moved, changed)
		assertEmpty(t, q)
		return run, f, changed, moved, stalls
	}
	rebalanceQueue := func(t *testing.T, prefix string, pause bool) string {
		q := prefix + "." + queueName(t)
		// The queue takes the address settings when it is created (here,
		// by this publish of nothing but a barrier).
		publishMessages(t, conn, q, true, nil)
		got := queueAttribute(t, conn, q, "groupRebalance") + "/" + queueAttribute(t, conn, q, "groupRebalancePauseDispatch")
		if want := fmt.Sprintf("true/%t", pause); got != want {
			t.Skipf("queue %s has group-rebalance/pause-dispatch %s, want %s: the broker at %s runs without the %s.# "+
				"address-setting of integration/artemis/broker.xml; restart it with this broker.xml", q, got, want, url, prefix)
		}
		return q
	}

	t.Run("join without rebalance", func(t *testing.T) {
		run, f, changed, _, _ := join(t, queueName(t), false)
		f.log(t, "join without rebalance")
		if changed != 0 || run.log.handledBy("r3") > 1 { // r3 may get the barrier, which has no group
			t.Errorf("r3 handled %d messages, %d groups changed replica; want none: every group was bound", run.log.handledBy("r3"), changed)
		}
		if f.violations != 0 {
			t.Errorf("%d order violations; want 0", f.violations)
		}
	})

	// Rebalancing forgets every binding when r3 attaches, but r3 can take a
	// group only once its first flow (credit) has arrived, a round trip
	// after the attach; the dispatches to r1 and r2 in between bind groups
	// to them again. So how many groups r3 gets is a race (0 to 26 of 60
	// here), while groups do change replica, and a group whose old owner
	// still holds some of its deliveries runs on two replicas at once.
	t.Run("join with rebalance", func(t *testing.T) {
		_, f, changed, _, _ := join(t, rebalanceQueue(t, "rebalance", false), false)
		f.log(t, "join with rebalance")
		overlapping := 0
		for _, g := range f.groups {
			if g.overlap {
				overlapping++
			}
		}
		t.Logf("groups handled by two replicas at once: %d (%s)", overlapping, f.perGroup(func(g *groupFigures) int {
			if g.overlap {
				return 1
			}
			return 0
		}))
		if changed == 0 {
			t.Error("no group changed replica: the join did not rebalance")
		}
	})

	t.Run("join with rebalance and pause-dispatch", func(t *testing.T) {
		_, f, _, moved, stalls := join(t, rebalanceQueue(t, "rebalance.paused", true), false)
		t.Logf("times the queue stopped dispatching after the join: %d", stalls)
		f.log(t, "join with rebalance and pause-dispatch")
		// Dispatch resumes only when no consumer holds an unsettled
		// delivery: r3's credit has long arrived, and the new owner of a
		// group starts after the old one has settled all it had.
		if moved == 0 {
			t.Error("no group moved to the joining replica")
		}
		if f.violations != 0 {
			t.Errorf("%d order violations; want 0 with pause-dispatch", f.violations)
		}
		for name, g := range f.groups {
			if g.overlap {
				t.Errorf("group %s handled by two replicas at once: %v", name, g.runs)
			}
		}
	})
}

// Three replicas compete on one queue: 6,000 messages, each handled by
// exactly one of them, exactly once.
func TestRabbitMQ4Replicas(t *testing.T) {
	url := rabbit4URL(t)
	for _, kind := range rabbit4Kinds {
		t.Run(kind, func(t *testing.T) {
			q := declareRabbit4(t, kind)
			conn := dial(t, url)
			const n, replicas = 6000, 3
			var mu sync.Mutex
			seen := map[int]int{}
			per := make([]int, replicas)
			var subs []*amqpsub.Subscriber
			var waits []func() error
			var stops []context.CancelFunc
			for i := range replicas {
				s, err := amqpsub.New(amqpsub.Dial(url, nil), q, amqpsub.HandlerFunc(func(ctx context.Context, d *amqpsub.Delivery) error {
					if seqOf(d) == -1 {
						return nil
					}
					time.Sleep(100 * time.Microsecond) // work to share
					mu.Lock()
					seen[seqOf(d)]++
					per[i]++
					mu.Unlock()
					return nil
				}), amqpsub.WithProfile(amqpsub.RabbitMQ4), amqpsub.Workers(4), amqpsub.Logger(logger(t)))
				if err != nil {
					t.Fatal(err)
				}
				stop, wait := runSub(t, s)
				subs, stops, waits = append(subs, s), append(stops, stop), append(waits, wait)
			}
			waitFor(t, 30*time.Second, "the replicas attached", func() bool {
				for _, s := range subs {
					if s.Stats().Links == 0 {
						return false
					}
				}
				return true
			})
			specs := uniqueSeqs(n, 0)
			r4publish(t, conn, q, specs)
			waitFor(t, 2*time.Minute, "6,000 deliveries", func() bool {
				mu.Lock()
				defer mu.Unlock()
				return len(seen) >= n
			})
			for i := range replicas {
				stops[i]()
				if err := waits[i](); err != nil {
					t.Fatalf("replica %d: Run = %v", i, err)
				}
			}
			mu.Lock()
			defer mu.Unlock()
			t.Logf("per replica %v", per)
			dups := 0
			for _, c := range seen {
				dups += c - 1
			}
			if len(seen) != n || dups != 0 {
				t.Fatalf("%d distinct, %d duplicates; want %d and 0", len(seen), dups, n)
			}
			for i, c := range per {
				if c == 0 {
					t.Fatalf("replica %d handled nothing: %v", i, per)
				}
			}
		})
	}
}
