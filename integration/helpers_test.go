package integration

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/Azure/go-amqp"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"

	"github.com/amqpsub/amqpsub/amqpsub"
	"github.com/amqpsub/amqpsub/internal/publish"
)

const startHint = "start one with `bash integration/artemis.sh start` (and `bash integration/rabbitmq.sh start`), " +
	"then set AMQPSUB_ARTEMIS_URL=amqp://127.0.0.1:5672 (AMQPSUB_RABBITMQ_URL=amqp://guest:guest@127.0.0.1:5682); `make test` does both"

// artemisURL returns the Artemis URL or skips the test.
func artemisURL(t testing.TB) string {
	t.Helper()
	u := os.Getenv("AMQPSUB_ARTEMIS_URL")
	if u == "" {
		t.Skip("no Artemis configured (AMQPSUB_ARTEMIS_URL is empty): " + startHint)
	}
	return u
}

// rabbitURL returns the RabbitMQ URL or skips the test.
func rabbitURL(t testing.TB) string {
	t.Helper()
	u := os.Getenv("AMQPSUB_RABBITMQ_URL")
	if u == "" {
		t.Skip("no RabbitMQ configured (AMQPSUB_RABBITMQ_URL is empty): " + startHint)
	}
	return u
}

// rabbit4URL returns the URL of the RabbitMQ 4 broker of
// integration/rabbitmq4.sh or skips the test.
func rabbit4URL(t testing.TB) string {
	t.Helper()
	u := os.Getenv("AMQPSUB_RABBITMQ4_URL")
	if u == "" {
		t.Skip("no RabbitMQ 4 configured (AMQPSUB_RABBITMQ4_URL is empty): start it with " +
			"`bash integration/rabbitmq4.sh start`, then set AMQPSUB_RABBITMQ4_URL=amqp://guest:guest@127.0.0.1:5692 " +
			"and AMQPSUB_RABBITMQ4_CTL=$PWD/integration/rabbitmq4.sh; `make test` does both")
	}
	return u
}

// rabbit4Ctl returns the path of integration/rabbitmq4.sh
// (AMQPSUB_RABBITMQ4_CTL) or skips the test.
func rabbit4Ctl(t testing.TB) string {
	t.Helper()
	ctl := os.Getenv("AMQPSUB_RABBITMQ4_CTL")
	if ctl == "" {
		t.Skip("AMQPSUB_RABBITMQ4_CTL is empty: set it to the path of integration/rabbitmq4.sh; `make test` does")
	}
	return ctl
}

// rabbit4 runs `rabbitmq4.sh ARGS...` and returns its standard output,
// trimmed; it fails the test if the script fails.
func rabbit4(t testing.TB, args ...string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, "bash", append([]string{rabbit4Ctl(t)}, args...)...)
	var stderr strings.Builder
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("rabbitmq4.sh %s: %v: %s", strings.Join(args, " "), err, stderr.String())
	}
	return strings.TrimSpace(string(out))
}

// rabbit4Unsafe is what rabbitmq4.sh refuses in a queue name.
var rabbit4Unsafe = regexp.MustCompile(`[^A-Za-z0-9._:-]`)

// declareRabbit4 declares a fresh durable queue of kind "classic" or
// "quorum" on RabbitMQ 4 with `rabbitmq4.sh declare`: its dead letters go
// to the classic queue NAME.dlq, declared with it (a quorum queue keeps the
// broker's delivery-limit, 20). Both are deleted when the test ends. Attach
// to "/queues/"+NAME.
func declareRabbit4(t testing.TB, kind string) string {
	t.Helper()
	name := rabbit4Unsafe.ReplaceAllString(queueName(t), "_")
	rabbit4(t, "declare", name, kind)
	t.Cleanup(func() { rabbit4(t, "delete", name) })
	return name
}

// rabbit4Count returns the number of messages ready in queue on RabbitMQ 4.
func rabbit4Count(t testing.TB, queue string) int {
	t.Helper()
	out := rabbit4(t, "count", queue)
	n, err := strconv.Atoi(out)
	if err != nil {
		t.Fatalf("rabbitmq4.sh count %s: not a number: %q", queue, out)
	}
	return n
}

var queueSeq atomic.Int64

// queueName returns a queue name no other test or run uses.
func queueName(t testing.TB) string {
	name := strings.NewReplacer("/", ".", " ", "_").Replace(t.Name())
	return fmt.Sprintf("it.%s.%d.%d", name, time.Now().UnixNano(), queueSeq.Add(1))
}

func logger(t testing.TB) *zap.Logger {
	return zaptest.NewLogger(t, zaptest.Level(zap.WarnLevel))
}

func dial(t testing.TB, url string) *amqp.Conn {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, err := amqp.Dial(ctx, url, nil)
	if err != nil {
		t.Fatalf("dial %s: %v", url, err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// msgSpec is one message to publish.
type msgSpec struct {
	group string // "" for none
	seq   int
	body  []byte
}

// publishFast sends msgs pre-settled, which is far faster than waiting for
// each disposition, then sends one unsettled message with seq -1 whose
// acceptance tells that all before it arrived (one link, in order).
func publishFast(t testing.TB, conn *amqp.Conn, address string, artemis bool, msgs []msgSpec) {
	t.Helper()
	ms := make([]*amqp.Message, len(msgs))
	for i, m := range msgs {
		ms[i] = message(m)
	}
	publishMessages(t, conn, address, artemis, ms)
}

// publishMessages is publishFast for messages built by the caller (with a
// group-sequence, say).
func publishMessages(t testing.TB, conn *amqp.Conn, address string, artemis bool, msgs []*amqp.Message) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	target := publish.Target{Address: address}
	if artemis {
		target.Capabilities = []string{"queue"}
	}
	barrier := message(msgSpec{seq: -1})
	err := publish.Send(ctx, conn, target, 1, len(msgs)+1, func(i int) *amqp.Message {
		if i == len(msgs) {
			return barrier
		}
		return msgs[i]
	})
	if err != nil {
		t.Fatal(err)
	}
}

// waitProgress waits until done() reaches want, failing the test when it
// makes no progress for 10 s (a stall) or takes longer than within.
func waitProgress(t testing.TB, done func() int64, want int64, within time.Duration, stats func() amqpsub.Stats) {
	t.Helper()
	deadline := time.Now().Add(within)
	last, lastAt := int64(-1), time.Now()
	for done() < want {
		if h := done(); h != last {
			last, lastAt = h, time.Now()
		} else if time.Since(lastAt) > 10*time.Second {
			t.Fatalf("stalled at %d of %d: %+v", h, want, stats())
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d of %d after %v: %+v", done(), want, within, stats())
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func closeSession(s *amqp.Session) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	s.Close(ctx)
}

func message(m msgSpec) *amqp.Message {
	msg := amqp.NewMessage(m.body)
	if m.body == nil {
		msg = amqp.NewMessage([]byte(fmt.Sprintf("%s/%d", m.group, m.seq)))
	}
	msg.Header = &amqp.MessageHeader{Durable: true}
	msg.Properties = &amqp.MessageProperties{}
	if m.group != "" {
		g := m.group
		msg.Properties.GroupID = &g
	}
	msg.ApplicationProperties = map[string]any{"seq": int64(m.seq)}
	return msg
}

func seqOf(d *amqpsub.Delivery) int {
	v, _ := d.ApplicationProperties()["seq"].(int64)
	return int(v)
}

func groups(n, groups int) []msgSpec {
	out := make([]msgSpec, n)
	next := make([]int, groups)
	for i := range out {
		g := i % groups
		out[i] = msgSpec{group: fmt.Sprintf("g%03d", g), seq: next[g]}
		next[g]++
	}
	return out
}

// runSub runs s until the test ends; it returns a wait func giving Run's
// result.
func runSub(t testing.TB, s *amqpsub.Subscriber) (stop context.CancelFunc, wait func() error) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	errc := make(chan error, 1)
	go func() { errc <- s.Run(ctx) }()
	var once sync.Once
	var res error
	wait = func() error {
		once.Do(func() {
			select {
			case res = <-errc:
			case <-time.After(2 * time.Minute):
				res = errors.New("Run did not return within 2 minutes")
			}
		})
		return res
	}
	t.Cleanup(func() { cancel(); wait() })
	return cancel, wait
}

// waitFor polls cond until it holds or the deadline passes. It waits on a
// real broker's progress, which no fake clock can stand in for; every wait is
// bounded and fails the test when it runs out.
func waitFor(t testing.TB, within time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(within)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", within, what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// rawReceiver attaches a plain go-amqp receiver (auto credit) to address.
func rawReceiver(t testing.TB, conn *amqp.Conn, address string, credit int32) *amqp.Receiver {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	sess, err := conn.NewSession(ctx, nil)
	if err != nil {
		t.Fatalf("session: %v", err)
	}
	r, err := sess.NewReceiver(ctx, address, &amqp.ReceiverOptions{Credit: credit, SourceCapabilities: []string{"queue"}})
	if err != nil {
		t.Fatalf("receiver on %s: %v", address, err)
	}
	t.Cleanup(func() { closeSession(sess) })
	return r
}

// receiveN takes up to n messages from r, accepting each, until within
// passes.
func receiveN(t testing.TB, r *amqp.Receiver, n int, within time.Duration) []*amqp.Message {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), within)
	defer cancel()
	var out []*amqp.Message
	for len(out) < n {
		m, err := r.Receive(ctx, nil)
		if err != nil {
			break
		}
		if err := r.AcceptMessage(ctx, m); err != nil {
			t.Fatalf("accept: %v", err)
		}
		out = append(out, m)
	}
	return out
}

// dlq is the address of queue's dead letters under our broker.xml.
func dlq(queue string) string { return "DLQ::DLQ." + queue }
