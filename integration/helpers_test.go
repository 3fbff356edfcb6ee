package integration

import (
	"context"
	"errors"
	"fmt"
	"net"
	neturl "net/url"
	"os"
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
	return dialWith(t, url, nil)
}

// dialWith connects to url with opts and closes the connection when the
// test ends.
func dialWith(t testing.TB, url string, opts *amqp.ConnOptions) *amqp.Conn {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, err := amqp.Dial(ctx, url, opts)
	if err != nil {
		t.Fatalf("dial %s: %v", redactURL(url), err)
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

// uniqueSeqs returns n messages with seq 0..n-1 spread over groups group-ids.
func uniqueSeqs(n, groups int) []msgSpec {
	out := make([]msgSpec, n)
	for i := range out {
		out[i] = msgSpec{seq: i}
		if groups > 0 {
			out[i].group = fmt.Sprintf("g%03d", i%groups)
		}
	}
	return out
}

// tally counts, per seq, how often a handler saw it.
type tally struct {
	counts   []atomic.Int32
	firstAt  []atomic.Int64 // unix ns of each seq's first handling
	total    atomic.Int64
	distinct atomic.Int64
	mark     atomic.Int64 // unix ns
	first    atomic.Int64 // unix ns of the first delivery handled at or after mark
}

func newTally(n int) *tally {
	return &tally{counts: make([]atomic.Int32, n), firstAt: make([]atomic.Int64, n)}
}

func (c *tally) record(seq int) {
	if seq < 0 || seq >= len(c.counts) {
		return // the publisher's barrier
	}
	now := time.Now().UnixNano()
	if c.counts[seq].Add(1) == 1 {
		c.distinct.Add(1)
		c.firstAt[seq].Store(now)
	}
	c.total.Add(1)
	if m := c.mark.Load(); m != 0 && now >= m {
		c.first.CompareAndSwap(0, now)
	}
}

// setMark starts looking for the first delivery handled from now on.
func (c *tally) setMark() {
	c.first.Store(0)
	c.mark.Store(time.Now().UnixNano())
}

func (c *tally) firstSinceMark() (time.Time, bool) {
	f := c.first.Load()
	return time.Unix(0, f), f != 0
}

func (c *tally) all() bool { return c.distinct.Load() == int64(len(c.counts)) }

func (c *tally) duplicates() int64 { return c.total.Load() - c.distinct.Load() }

// firstHandledIn counts the seqs first handled in [from, to).
func (c *tally) firstHandledIn(from, to time.Time) int {
	n := 0
	for i := range c.firstAt {
		if at := c.firstAt[i].Load(); at >= from.UnixNano() && at < to.UnixNano() {
			n++
		}
	}
	return n
}

func (c *tally) missing(max int) []int {
	var out []int
	for i := range c.counts {
		if c.counts[i].Load() == 0 && len(out) < max {
			out = append(out, i)
		}
	}
	return out
}

// waitAll waits until every seq was handled; on timeout it names some that
// were not.
func (c *tally) waitAll(t testing.TB, within time.Duration) {
	t.Helper()
	deadline := time.Now().Add(within)
	for !c.all() {
		if time.Now().After(deadline) {
			t.Fatalf("after %v, %d of %d messages handled; never handled: %v…", within, c.distinct.Load(), len(c.counts), c.missing(10))
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func (c *tally) handler() amqpsub.Handler {
	return amqpsub.HandlerFunc(func(ctx context.Context, d *amqpsub.Delivery) error {
		c.record(seqOf(d))
		return nil
	})
}

func assertQueueEmpty(t testing.TB, conn *amqp.Conn, q string) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		n := queueAttribute(t, conn, q, "messageCount")
		if n == "0" {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s messages left on %s: a message was accepted twice or not at all", n, q)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// closedPort returns a 127.0.0.1 address nothing listens on.
func closedPort(t testing.TB) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	return addr
}

// slack is what a real broker and a real clock add to a bound that synctest
// checks exactly in the unit tests.
const slack = 750 * time.Millisecond

// dialPlain connects with SASL PLAIN and the user and password of rawURL.
func dialPlain(t testing.TB, rawURL string) *amqp.Conn {
	t.Helper()
	pu, err := neturl.Parse(rawURL)
	if err != nil {
		t.Fatalf("parse %s: %v", redactURL(rawURL), err)
	}
	pass, _ := pu.User.Password()
	return dialWith(t, rawURL, &amqp.ConnOptions{SASLType: amqp.SASLTypePlain(pu.User.Username(), pass)})
}

// rawSender attaches a plain go-amqp sender to address on a session of its
// own, with the target capabilities caps (Artemis: "queue").
func rawSender(t testing.TB, conn *amqp.Conn, address string, caps ...string) *amqp.Sender {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	sess, err := conn.NewSession(ctx, nil)
	if err != nil {
		t.Fatalf("session: %v", err)
	}
	t.Cleanup(func() { closeSession(sess) })
	s, err := sess.NewSender(ctx, address, &amqp.SenderOptions{TargetCapabilities: caps})
	if err != nil {
		t.Fatalf("sender to %s: %v", address, err)
	}
	return s
}

// sendBody sends one durable message with body and waits for the broker
// to accept it.
func sendBody(t testing.TB, s *amqp.Sender, body string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	m := amqp.NewMessage([]byte(body))
	m.Header = &amqp.MessageHeader{Durable: true}
	if err := s.Send(ctx, m, nil); err != nil {
		t.Fatalf("send %q: %v", body, err)
	}
}

func dialWithin(url string, d time.Duration) (*amqp.Conn, error) {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	defer cancel()
	c, err := amqp.Dial(ctx, url, nil)
	if err != nil {
		return nil, fmt.Errorf("dial %s: %w", url, err)
	}
	return c, nil
}

// redactURL is url without its password, as amqpsub names a broker.
func redactURL(raw string) string {
	u, err := neturl.Parse(raw)
	if err != nil || u.User == nil {
		return raw
	}
	u.User = neturl.User(u.User.Username())
	return u.String()
}

// drainAddress takes (accepting) everything a receiver on address gets,
// until nothing comes for a second.
func drainAddress(t testing.TB, conn *amqp.Conn, address string) []*amqp.Message {
	t.Helper()
	r := rawReceiver(t, conn, address, 256)
	var out []*amqp.Message
	for {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		m, err := r.Receive(ctx, nil)
		cancel()
		if err != nil {
			return out
		}
		if err := r.AcceptMessage(context.Background(), m); err != nil {
			t.Fatalf("accept: %v", err)
		}
		out = append(out, m)
	}
}
