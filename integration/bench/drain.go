package main

import (
	"context"
	"fmt"
	"runtime"
	"runtime/pprof"
	"sync"
	"sync/atomic"
	"time"

	"github.com/Azure/go-amqp"
	"go.uber.org/zap"

	"github.com/amqpsub/amqpsub/amqpsub"
	"github.com/amqpsub/amqpsub/internal/testhook"
	"github.com/amqpsub/amqpsub/internal/wire"
)

// scenario is one way of draining the queue.
type scenario struct {
	name  string // flag value
	title string
	group string // "a" the loop, "b" no-op amqpsub, "c" 1 ms amqpsub; "r", a reference consumer
	// loop: the hand-written go-amqp loop; ref: a reference consumer (a key
	// of refConsumers), run as cmd; otherwise amqpsub with opts.
	loop bool
	ref  string
	// plain: amqpsub over the go-amqp connection the loop uses (the Conn
	// connector), instead of one it dials itself (Dial, with its wire
	// layer), to show what the wire layer is worth.
	plain bool
	// noMerge: amqpsub's Dial with wire.Options.NoMerge, every acceptance
	// a frame of its own, to show what merging them is worth.
	noMerge bool
	cmd     []string // set by prepareRefs
	batch   bool
	opts    func() []amqpsub.Option
	// slow: the handler sleeps 1 ms; lanes is n in WorkersByKey(n), with
	// BalanceKeys if balanced.
	slow     bool
	lanes    int
	balanced bool
	// bound is what one sleep per message lets a 1 ms scenario reach, in
	// msgs/s, given the lanes and the key spread (set by keyNotes), and
	// boundWhy says what sets it.
	bound    float64
	boundWhy string
	sleep    time.Duration // c, as measured before the runs (set by keyNotes)
}

func scenarios(groups int) []scenario {
	keyed := fmt.Sprintf("WorkersByKey(8), %d groups", groups)
	if groups == 0 {
		keyed = "WorkersByKey(8), no group-id"
	}
	list := []scenario{
		{name: "loop", title: "go-amqp loop: Receive + AcceptMessage", group: "a", loop: true},
		{name: "w1", title: "no-op, Workers(1)", group: "b",
			opts: func() []amqpsub.Option { return []amqpsub.Option{amqpsub.Workers(1)} }},
		{name: "w1plain", title: "no-op, Workers(1), Conn over a plain go-amqp connection", group: "b", plain: true,
			opts: func() []amqpsub.Option { return []amqpsub.Option{amqpsub.Workers(1)} }},
		{name: "w8", title: "no-op, Workers(8)", group: "b",
			opts: func() []amqpsub.Option { return []amqpsub.Option{amqpsub.Workers(8)} }},
		{name: "key8", title: "no-op, " + keyed, group: "b",
			opts: func() []amqpsub.Option { return []amqpsub.Option{amqpsub.WorkersByKey(8)} }},
		{name: "keybal8", title: "no-op, " + keyed + ", BalanceKeys", group: "b",
			opts: func() []amqpsub.Option { return []amqpsub.Option{amqpsub.WorkersByKey(8), amqpsub.BalanceKeys()} }},
		{name: "batch", title: "no-op, NewBatch, Batch(100, 10ms)", group: "b", batch: true,
			opts: func() []amqpsub.Option {
				return []amqpsub.Option{amqpsub.Batch(100, 10*time.Millisecond)}
			}},
	}
	// Each no-merge and fixed-credit variant runs right after its
	// counterpart.
	var paired []scenario
	for _, sc := range list {
		paired = append(paired, sc)
		if sc.name == "w1" || sc.name == "key8" || sc.name == "batch" {
			nm := sc
			nm.name += "nomerge"
			nm.title += ", acceptances not merged (wire NoMerge)"
			nm.noMerge = true
			paired = append(paired, nm)
		}
		if sc.group == "b" && !sc.plain {
			fixed := sc
			opts := sc.opts
			fixed.name += "fixed"
			fixed.title += ", FixedCredit()"
			fixed.opts = func() []amqpsub.Option { return append(opts(), amqpsub.FixedCredit()) }
			paired = append(paired, fixed)
		}
	}
	list = paired
	for _, n := range []int{1, 4, 8, 16, 64} {
		list = append(list, scenario{
			name: fmt.Sprintf("slow%d", n), title: fmt.Sprintf("1 ms, WorkersByKey(%d)", n), group: "c",
			slow: true, lanes: n,
			opts: func() []amqpsub.Option { return []amqpsub.Option{amqpsub.WorkersByKey(n)} },
		})
	}
	for _, n := range []int{8, 16, 64} {
		list = append(list, scenario{
			name: fmt.Sprintf("bal%d", n), title: fmt.Sprintf("1 ms, WorkersByKey(%d), BalanceKeys", n), group: "c",
			slow: true, lanes: n, balanced: true,
			opts: func() []amqpsub.Option {
				return []amqpsub.Option{amqpsub.WorkersByKey(n), amqpsub.BalanceKeys()}
			},
		})
	}
	return append(list,
		scenario{name: "jms", title: "Qpid JMS 2.7.0: receive, AUTO_ACKNOWLEDGE, prefetch = credit", group: "r", ref: "jms"},
		scenario{name: "protonc", title: "Proton C receive example: accept + settle each, window = credit", group: "r", ref: "protonc"},
		scenario{name: "pyproton", title: "Proton Python MessagingHandler: accept each, prefetch = credit", group: "r", ref: "pyproton"},
	)
}

// messages returns how many messages the scenario drains (before the
// barrier): N, or for a 1 ms handler at most perLane per lane, so that a run
// at 1,000 msgs/s per lane stays short.
func (s scenario) messages(n, perLane int) int {
	if s.slow && perLane > 0 {
		return min(n, s.lanes*perLane)
	}
	return n
}

// result is one drain.
type result struct {
	msgs      int // drained, barrier included
	elapsed   time.Duration
	client    time.Duration // this process's CPU over the drain
	broker    time.Duration // the broker's CPU over the drain
	brokerOK  bool
	maxHeld   int   // amqpsub only
	overshoot int64 // amqpsub only: deliveries the broker sent past the credit
	// busy is the time the 1 ms handlers spent in time.Sleep, summed over
	// the lanes (1 ms scenarios only).
	busy time.Duration
}

func (r result) rate() float64 { return float64(r.msgs) / r.elapsed.Seconds() }

// laneUse is the share of the drain that n lanes spent in the 1 ms
// handler: 1 when no lane ever waited for work.
func (r result) laneUse(n int) float64 {
	return r.busy.Seconds() / (float64(n) * r.elapsed.Seconds())
}

// errStall is the cause of a drain that made no progress for too long.
type errStall struct {
	after time.Duration
	at    int64
	want  int
}

func (e *errStall) Error() string {
	return fmt.Sprintf("stalled: no progress for %v at %d of %d messages", e.after, e.at, e.want)
}

// watch returns a context that is cancelled when progress has not moved for
// stall, or after limit in all; its cause says which. stop ends the
// watchdog and waits for it.
func watch(parent context.Context, progress *atomic.Int64, want int, stall, limit time.Duration) (ctx context.Context, stop func()) {
	ctx, cancel := context.WithCancelCause(parent)
	tctx, tcancel := context.WithTimeoutCause(ctx, limit,
		fmt.Errorf("drain took longer than %v (-timeout)", limit))
	var wg sync.WaitGroup
	wg.Go(func() {
		tick := time.NewTicker(50 * time.Millisecond)
		defer tick.Stop()
		last, lastAt := progress.Load(), time.Now()
		for {
			select {
			case <-tctx.Done():
				return
			case now := <-tick.C:
				if p := progress.Load(); p != last {
					last, lastAt = p, now
				} else if now.Sub(lastAt) >= stall {
					cancel(&errStall{after: stall, at: p, want: want})
					return
				}
			}
		}
	})
	return tctx, func() {
		tcancel()
		cancel(nil)
		wg.Wait()
	}
}

// cause returns why ctx ended, for an error met after it did.
func cause(ctx context.Context, err error) error {
	if c := context.Cause(ctx); c != nil && ctx.Err() != nil {
		return fmt.Errorf("%w (%v)", c, err)
	}
	return err
}

// runConfig is what every drain needs.
type runConfig struct {
	credit  int
	stall   time.Duration
	timeout time.Duration
	log     *zap.Logger
	profile string // CPU profile file for this drain; "" for none
}

// drain runs one scenario on queue, which holds want messages.
func drain(ctx context.Context, b *broker, queue string, want int, sc scenario, rc runConfig) (result, error) {
	if sc.ref != "" {
		return drainRef(ctx, b, queue, want, sc, rc)
	}
	conn, err := b.dial(ctx)
	if err != nil {
		return result{}, err
	}
	defer conn.Close()
	if rc.profile != "" {
		stop, err := startProfile(rc.profile)
		if err != nil {
			return result{}, err
		}
		defer stop()
	}
	// Garbage from the preload is not the drain's.
	runtime.GC()
	if sc.loop {
		return drainLoop(ctx, b, conn, queue, want, rc)
	}
	connector := amqpsub.Dial(b.url, nil)
	switch {
	case sc.plain:
		connector = amqpsub.Conn(conn)
	case sc.noMerge:
		connector = testhook.DialWire(b.url, wire.Options{NoMerge: true}).(amqpsub.Connector)
	}
	return drainSub(ctx, b, connector, queue, want, sc, rc)
}

// drainLoop is the reference: the best plain go-amqp loop, one goroutine
// receiving and accepting, with manual credit topped up as it settles (in
// chunks of credit/8, as amqpsub does), or on RabbitMQ granted a window at a
// time once the previous window has fully arrived.
func drainLoop(ctx context.Context, b *broker, conn *amqp.Conn, queue string, want int, rc runConfig) (result, error) {
	var progress atomic.Int64
	dctx, stop := watch(ctx, &progress, want, rc.stall, rc.timeout)
	defer stop()

	before := sampleCPU(b.pid)
	start := time.Now()
	sess, err := conn.NewSession(dctx, nil)
	if err != nil {
		return result{}, fmt.Errorf("loop session: %w", err)
	}
	rcv, err := sess.NewReceiver(dctx, b.receiveAddress(queue), &amqp.ReceiverOptions{
		Credit:             -1,
		SourceCapabilities: b.sourceCaps(),
	})
	if err != nil {
		b.closeLink(nil, sess)
		return result{}, fmt.Errorf("loop receiver: %w", err)
	}
	defer b.closeLink(rcv, sess)

	limit := int64(rc.credit)
	chunk := max(1, limit/8)
	var granted, received int64
	for received < int64(want) {
		// Nothing is held between iterations, so the credit to top up is
		// what keeps granted-received at the limit. After an overshoot
		// (received > granted) the grant grows by it, which brings
		// go-amqp's wrapped credit counter back.
		outstanding := granted - received
		if !b.windowed || outstanding <= 0 {
			if w := limit - outstanding; w >= chunk {
				if err := rcv.IssueCredit(uint32(w)); err != nil {
					return result{}, fmt.Errorf("loop issue credit: %w", err)
				}
				granted += w
			}
		}
		msg, err := rcv.Receive(dctx, nil)
		if err != nil {
			return result{}, cause(dctx, fmt.Errorf("loop receive after %d: %w", received, err))
		}
		received++
		if err := rcv.AcceptMessage(dctx, msg); err != nil {
			return result{}, cause(dctx, fmt.Errorf("loop accept: %w", err))
		}
		progress.Store(received)
	}
	elapsed := time.Since(start)
	after := sampleCPU(b.pid)
	return measured(want, elapsed, before, after), nil
}

func measured(n int, elapsed time.Duration, before, after cpuSample) result {
	return result{
		msgs:     n,
		elapsed:  elapsed,
		client:   after.self - before.self,
		broker:   after.broker - before.broker,
		brokerOK: before.brokerOK && after.brokerOK,
	}
}

// drainSub drains with amqpsub through connector: the clock runs from Run
// (session and attach included, as in the loop; with Dial, the connection's
// open too, which the loop's clock leaves out) until every message was
// handled and its acceptance sent.
func drainSub(ctx context.Context, b *broker, connector amqpsub.Connector, queue string, want int, sc scenario, rc runConfig) (result, error) {
	var handled, slept atomic.Int64
	all := make(chan struct{})
	var once sync.Once
	note := func(k int) {
		if handled.Add(int64(k)) >= int64(want) {
			once.Do(func() { close(all) })
		}
	}
	opts := append([]amqpsub.Option{
		amqpsub.Credit(rc.credit),
		amqpsub.WithProfile(b.profile),
		amqpsub.Logger(rc.log),
		amqpsub.GracePeriod(10 * time.Second),
	}, sc.opts()...)
	var s *amqpsub.Subscriber
	var err error
	switch {
	case sc.batch:
		s, err = amqpsub.NewBatch(connector, queue, amqpsub.BatchHandlerFunc(
			func(ctx context.Context, batch []*amqpsub.Delivery) []error {
				note(len(batch))
				return nil
			}), opts...)
	case sc.slow:
		s, err = amqpsub.New(connector, queue, amqpsub.HandlerFunc(
			func(ctx context.Context, d *amqpsub.Delivery) error {
				t0 := time.Now()
				time.Sleep(time.Millisecond)
				slept.Add(int64(time.Since(t0)))
				note(1)
				return nil
			}), opts...)
	default:
		s, err = amqpsub.New(connector, queue, amqpsub.HandlerFunc(
			func(ctx context.Context, d *amqpsub.Delivery) error {
				note(1)
				return nil
			}), opts...)
	}
	if err != nil {
		return result{}, fmt.Errorf("amqpsub: %w", err)
	}

	dctx, stop := watch(ctx, &handled, want, rc.stall, rc.timeout)
	defer stop()

	before := sampleCPU(b.pid)
	start := time.Now()
	runErr := make(chan error, 1)
	var wg sync.WaitGroup
	wg.Go(func() { runErr <- s.Run(context.Background()) })
	defer wg.Wait()
	abort := func(err error) (result, error) {
		st := s.Stats()
		_ = s.Close()
		return result{}, fmt.Errorf("%w; stats %+v", err, st)
	}

	select {
	case <-all:
	case <-dctx.Done():
		return abort(context.Cause(dctx))
	case err := <-runErr:
		runErr <- err
		return abort(fmt.Errorf("the subscriber's Run returned before the queue was drained: %w", err))
	}
	// The handlers are done; wait for the pump to have sent every
	// acceptance.
	for s.Stats().Settled.Accepted < uint64(want) {
		if dctx.Err() != nil {
			return abort(context.Cause(dctx))
		}
		time.Sleep(100 * time.Microsecond)
	}
	elapsed := time.Since(start)
	after := sampleCPU(b.pid)
	st := s.Stats()

	sctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	if err := s.Shutdown(sctx); err != nil {
		return abort(fmt.Errorf("shutdown: %w", err))
	}
	if err := <-runErr; err != nil {
		return result{}, fmt.Errorf("subscriber: %w", err)
	}
	if st.Settled.Accepted != uint64(want) || st.Received != uint64(want) {
		return result{}, fmt.Errorf("received %d, accepted %d, want %d each", st.Received, st.Settled.Accepted, want)
	}
	r := measured(want, elapsed, before, after)
	r.maxHeld, r.overshoot = st.MaxHeld, st.Overshoot
	r.busy = time.Duration(slept.Load())
	return r, nil
}

// startProfile starts a CPU profile into file; stop ends it.
func startProfile(file string) (stop func(), err error) {
	f, err := createFile(file)
	if err != nil {
		return nil, err
	}
	if err := pprof.StartCPUProfile(f); err != nil {
		_ = f.Close()
		return nil, fmt.Errorf("cpu profile: %w", err)
	}
	return func() {
		pprof.StopCPUProfile()
		if err := f.Close(); err != nil {
			logf("cpu profile %s: %v", file, err)
		}
	}, nil
}
