// Command replicas is one replica of a scaled-out amqpsub consumer: run
// several on the same Artemis queue and the broker's message groups spread
// the group-ids over them, each group on one replica at a time.
//
// A replica consumes with WorkersByKey (the AMQP group-id is the key), works
// a random 0..-work per message, and on SIGTERM or Ctrl-C stops gracefully:
// its buffered deliveries go back to the queue for the other replicas, the
// handlers in progress finish within -grace. At exit it prints a summary to
// stderr: messages handled, groups seen, and per-group order violations (a
// message handled after a later one of its group, in this replica).
//
// Messages carry the group-id and an application property "seq", the
// message's place in its group (int64, from 0). With -publish N the command
// publishes N such messages over -groups group-ids and exits instead.
//
//	go run ./examples/replicas -publish 20000 -queue replicas.demo
//	go run ./examples/replicas -queue replicas.demo -id r1   # in 3 terminals
//
// With -events every handled message is also written to stdout, one line
// each, before the handler returns (so before it is accepted):
//
//	ready ID                                          (once attached)
//	handled ID GROUP SEQ DELIVERY-COUNT FIRST-ACQUIRER LANE UNIX-NANO
//	held ID N                                         (every -report)
//	reconnected ID BROKER UNIX-NANO                   (a lost link replaced)
//	stats ID RECEIVED ACCEPTED RELEASED MODIFIED REJECTED MAX-HELD   (at exit)
//
// GROUP is "-" for a message without a group-id, UNIX-NANO the wall-clock
// time the handler was called. The integration tests run replicas this way.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log"
	"math/rand/v2"
	"os"
	"os/signal"
	"slices"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/Azure/go-amqp"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/amqpsub/amqpsub/amqpsub"
	"github.com/amqpsub/amqpsub/examples/producer"
)

func main() {
	host, _ := os.Hostname()
	cfg := config{}
	flag.StringVar(&cfg.url, "url", "amqp://127.0.0.1:5672", "broker URL, or several separated by commas (amqpsub.DialFailover: a cluster, a primary and its backup)")
	flag.StringVar(&cfg.queue, "queue", "replicas.demo", "queue")
	flag.IntVar(&cfg.lanes, "lanes", 8, "WorkersByKey lanes")
	flag.DurationVar(&cfg.work, "work", time.Millisecond, "each message takes a random 0..work")
	flag.StringVar(&cfg.id, "id", fmt.Sprintf("%s-%d", host, os.Getpid()), "replica id, in the summary and event lines")
	flag.DurationVar(&cfg.grace, "grace", 30*time.Second, "graceful stop: how long handlers in progress may take")
	flag.IntVar(&cfg.credit, "credit", 256, "the most deliveries the broker may send ahead (the adaptive credit's bound)")
	flag.BoolVar(&cfg.fixedCredit, "fixed-credit", false, "hold the whole -credit at all times (amqpsub.FixedCredit) instead of the adaptive credit")
	flag.BoolVar(&cfg.events, "events", false, "write one line per handled message to stdout")
	flag.DurationVar(&cfg.report, "report", 2*time.Second, "print progress to stderr this often (0: never)")
	flag.IntVar(&cfg.publish, "publish", 0, "publish this many messages over -groups group-ids, then exit")
	flag.IntVar(&cfg.groups, "groups", 100, "group-ids to publish over (with -publish)")
	flag.Parse()
	if err := run(cfg); err != nil {
		log.Fatal(err)
	}
}

func run(cfg config) error {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if cfg.publish > 0 {
		return publish(ctx, cfg.url, cfg.queue, cfg.publish, cfg.groups)
	}
	return consume(ctx, cfg, os.Stdout, os.Stderr)
}

type config struct {
	url, queue, id string
	lanes, credit  int
	work, grace    time.Duration
	events         bool
	fixedCredit    bool
	report         time.Duration
	publish        int
	groups         int
}

// groupStat is what one replica saw of one group.
type groupStat struct {
	handled    int
	last       int64 // highest seq handled so far
	violations int   // handled after a later message of the group
}

// tally counts what the replica handled and, with events on, writes each
// handled message out before the handler returns, so that a message the
// broker counts as accepted is always on record, even after a kill -9.
type tally struct {
	id     string
	events io.Writer // nil: no event lines

	mu      sync.Mutex
	handled int
	groups  map[string]*groupStat
	line    []byte
}

func (t *tally) record(d *amqpsub.Delivery, seq int64, at time.Time) error {
	g := d.GroupID()
	t.mu.Lock()
	defer t.mu.Unlock()
	t.handled++
	if g != "" {
		s := t.groups[g]
		if s == nil {
			s = &groupStat{last: -1}
			t.groups[g] = s
		}
		s.handled++
		if seq <= s.last {
			s.violations++
		}
		s.last = max(s.last, seq)
	}
	if t.events == nil {
		return nil
	}
	if g == "" {
		g = "-"
	}
	t.line = fmt.Appendf(t.line[:0], "handled %s %s %d %d %t %d %d\n",
		t.id, g, seq, d.DeliveryCount(), d.FirstAcquirer(), d.Lane(), at.UnixNano())
	// One write per line: os.Stdout is unbuffered, so the line is out of the
	// process before the handler returns.
	if _, err := t.events.Write(t.line); err != nil {
		return fmt.Errorf("write event: %w", err)
	}
	return nil
}

func (t *tally) snapshot() (handled, groups int) {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.handled, len(t.groups)
}

func consume(ctx context.Context, cfg config, stdout, stderr io.Writer) error {
	t := &tally{id: cfg.id, groups: map[string]*groupStat{}}
	if cfg.events {
		t.events = stdout
	}
	handler := amqpsub.HandlerFunc(func(ctx context.Context, d *amqpsub.Delivery) error {
		at := time.Now()
		seq, _ := d.ApplicationProperties()["seq"].(int64)
		if cfg.work > 0 {
			time.Sleep(rand.N(cfg.work + 1)) // the work
		}
		// An error here (stdout gone) retries the delivery: it is not
		// accepted unless it is on record.
		return t.record(d, seq, at)
	})
	logger := zap.New(zapcore.NewCore(
		zapcore.NewConsoleEncoder(zap.NewDevelopmentEncoderConfig()),
		zapcore.Lock(zapcore.AddSync(stderr)), zap.InfoLevel)).With(zap.String("replica", cfg.id))
	defer logger.Sync()
	conn, err := connector(cfg.url)
	if err != nil {
		return err
	}
	opts := []amqpsub.Option{amqpsub.WorkersByKey(cfg.lanes), amqpsub.Credit(cfg.credit), amqpsub.GracePeriod(cfg.grace)}
	if cfg.fixedCredit {
		opts = append(opts, amqpsub.FixedCredit())
	}
	sub, err := amqpsub.New(conn, cfg.queue, handler, append(opts,
		amqpsub.Logger(logger), amqpsub.OnEvent(func(e amqpsub.Event) {
			if cfg.events && e.Kind == amqpsub.EventReconnected {
				// One short write, as the handlers' lines are: a pipe
				// keeps it whole.
				fmt.Fprintf(stdout, "reconnected %s %s %d\n", cfg.id, e.Broker, time.Now().UnixNano())
			}
		}))...)
	if err != nil {
		return err
	}

	var wg sync.WaitGroup
	watchCtx, stopWatch := context.WithCancel(context.Background())
	wg.Go(func() { watch(watchCtx, cfg, sub, t, stdout, stderr) })
	start := time.Now()
	runErr := sub.Run(ctx)
	stopWatch()
	wg.Wait()

	st := sub.Stats()
	if cfg.events {
		fmt.Fprintf(stdout, "stats %s %d %d %d %d %d %d\n", cfg.id,
			st.Received, st.Settled.Accepted, st.Settled.Released, st.Settled.Modified, st.Settled.Rejected, st.MaxHeld)
	}
	summary(stderr, cfg.id, t, st, time.Since(start))
	if runErr != nil {
		return fmt.Errorf("replica %s: %w", cfg.id, runErr)
	}
	return nil
}

// watch says "ready" once the receiver is attached, and reports progress
// every cfg.report until ctx ends.
func watch(ctx context.Context, cfg config, sub *amqpsub.Subscriber, t *tally, stdout, stderr io.Writer) {
	poll := time.NewTicker(10 * time.Millisecond)
	defer poll.Stop()
	for sub.Stats().Links == 0 {
		select {
		case <-ctx.Done():
			return
		case <-poll.C:
		}
	}
	if cfg.events {
		fmt.Fprintf(stdout, "ready %s\n", cfg.id)
	}
	fmt.Fprintf(stderr, "%s: attached to %s\n", cfg.id, cfg.queue)
	if cfg.report <= 0 {
		<-ctx.Done()
		return
	}
	tick := time.NewTicker(cfg.report)
	defer tick.Stop()
	last := 0
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		handled, groups := t.snapshot()
		if cfg.events {
			fmt.Fprintf(stdout, "held %s %d\n", cfg.id, sub.Stats().Held)
		}
		if handled != last {
			fmt.Fprintf(stderr, "%s: handled %d (+%d), groups %d, held %d\n",
				cfg.id, handled, handled-last, groups, sub.Stats().Held)
			last = handled
		}
	}
}

// connector dials url, or with several comma-separated URLs fails over
// between them.
func connector(url string) (amqpsub.Connector, error) {
	if !strings.Contains(url, ",") {
		return amqpsub.Dial(url, nil), nil
	}
	return amqpsub.DialFailover(strings.Split(url, ","), nil)
}

func summary(w io.Writer, id string, t *tally, st amqpsub.Stats, elapsed time.Duration) {
	t.mu.Lock()
	defer t.mu.Unlock()
	names := make([]string, 0, len(t.groups))
	violations := 0
	var bad []string
	for g, s := range t.groups {
		names = append(names, g)
		violations += s.violations
		if s.violations > 0 {
			bad = append(bad, fmt.Sprintf("%s:%d", g, s.violations))
		}
	}
	slices.Sort(names)
	slices.Sort(bad)
	fmt.Fprintf(w, "replica %s: handled %d messages in %v, %d groups, %d order violations\n",
		id, t.handled, elapsed.Round(time.Millisecond), len(names), violations)
	fmt.Fprintf(w, "  groups: %s\n", strings.Join(names, " "))
	if len(bad) > 0 {
		fmt.Fprintf(w, "  violations per group: %s\n", strings.Join(bad, " "))
	}
	fmt.Fprintf(w, "  settled: accepted %d, released %d, modified %d, rejected %d; max held %d\n",
		st.Settled.Accepted, st.Settled.Released, st.Settled.Modified, st.Settled.Rejected, st.MaxHeld)
}

// publish sends n messages round-robin over groups group-ids, each with its
// group-id and its place in the group as application property "seq".
func publish(ctx context.Context, url, queue string, n, groups int) error {
	if groups < 1 {
		return errors.New("-groups must be ≥ 1")
	}
	conn, err := amqp.Dial(ctx, url, nil)
	if err != nil {
		return fmt.Errorf("dial %s: %w", url, err)
	}
	defer conn.Close()
	start := time.Now()
	err = producer.Send(ctx, conn, queue, n,
		func(i int) *amqp.Message {
			g, seq := i%groups, int64(i/groups)
			group := fmt.Sprintf("g%03d", g)
			msg := producer.NewMessage(fmt.Sprintf("%s-%d", group, seq), group, fmt.Appendf(nil, "%s/%d", group, seq))
			msg.ApplicationProperties = map[string]any{"seq": seq}
			return msg
		}, nil)
	if err != nil {
		return err
	}
	fmt.Fprintf(os.Stderr, "published %d messages over %d groups to %s in %v\n",
		n, groups, queue, time.Since(start).Round(time.Millisecond))
	return nil
}
