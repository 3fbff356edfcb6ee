package integration

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"math/rand/v2"
	"os/exec"
	"reflect"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/Azure/go-amqp"

	"github.com/amqpsub/amqpsub/amqpsub"
	"github.com/amqpsub/amqpsub/examples/producer"
)

// Producers in other languages: Qpid JMS (Java, integration/jms-producer)
// and Qpid Proton (Python, integration/pyproducer) publish message groups to
// Artemis; amqpsub consumes them with WorkersByKey and checks group order
// (by the group-sequence the producer set), exactly-once, and the typed
// views of each body.

// jmsProducerJar builds the Java producer once per test binary (build.sh
// caches the jar across runs) and returns the jar's path. Missing Java or
// Maven fail the test: CI has them.
var jmsProducerJar = sync.OnceValues(func() (string, error) {
	if _, err := exec.LookPath("java"); err != nil {
		return "", fmt.Errorf("java not found (install a JDK 17+, e.g. Debian openjdk-17-jdk-headless): %w", err)
	}
	// The first build downloads Qpid JMS and Maven plugins from Maven
	// Central; later ones print the cached path at once.
	ctx, cancel := context.WithTimeout(context.Background(), 8*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, "bash", "jms-producer/build.sh")
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return "", fmt.Errorf("jms-producer/build.sh: %w\n%s", err, stderr.String())
	}
	return strings.TrimSpace(string(out)), nil
})

func jmsProducer(t testing.TB) string {
	t.Helper()
	jar, err := jmsProducerJar()
	if err != nil {
		t.Fatalf("building the JMS producer: %v", err)
	}
	return jar
}

// produce runs a producer program to completion, within a minute.
func produce(t testing.TB, name string, args ...string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, name, args...)
	cmd.WaitDelay = 5 * time.Second
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("%s %s: %v\n%s", name, strings.Join(args, " "), err, out)
	}
	t.Logf("%s", bytes.TrimSpace(out))
}

func produceJMS(t testing.TB, url, queue string, n, groups int, kind string) {
	t.Helper()
	produce(t, "java", "-jar", jmsProducer(t), "--url", url, "--queue", queue,
		"--count", fmt.Sprint(n), "--groups", fmt.Sprint(groups), "--kind", kind)
}

const python = "/usr/bin/python3" // Debian's, with python3-qpid-proton

func producePython(t testing.TB, url, queue string, n, groups int, kind string) {
	t.Helper()
	if out, err := exec.Command(python, "-c", "import proton").CombinedOutput(); err != nil {
		t.Fatalf("%s cannot import proton (install Debian python3-qpid-proton): %v\n%s", python, err, out)
	}
	produce(t, python, "pyproducer/producer.py", "--url", url, "--queue", queue,
		"--count", fmt.Sprint(n), "--groups", fmt.Sprint(groups), "--kind", kind)
}

// seqChecker checks, per group, that the group-sequence numbers the
// producer set (1, 2, 3, ...) arrive in order, once each, on one lane; and
// runs a body check on each delivery.
type seqChecker struct {
	mu         sync.Mutex
	next       map[string]uint32
	laneOf     map[string]int
	seen       map[string]map[uint32]int
	handled    int
	dups       int
	violations int
	problems   []string
}

func newSeqChecker() *seqChecker {
	return &seqChecker{next: map[string]uint32{}, laneOf: map[string]int{}, seen: map[string]map[uint32]int{}}
}

func (c *seqChecker) record(d *amqpsub.Delivery, body func(d *amqpsub.Delivery, group string, seq uint32) error) {
	g := d.GroupID()
	seq, ok := d.GroupSequence()
	var bodyErr error
	if body != nil {
		bodyErr = body(d, g, seq)
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	c.handled++
	if !ok || g == "" {
		c.problem(fmt.Sprintf("message without group-id (%q) or group-sequence (%v)", g, ok))
		return
	}
	if c.seen[g] == nil {
		c.seen[g] = map[uint32]int{}
	}
	if c.seen[g][seq]++; c.seen[g][seq] > 1 {
		c.dups++
	}
	if want := max(c.next[g], 1); seq != want {
		c.violations++
		c.problem(fmt.Sprintf("group %s: sequence %d after %d", g, seq, want-1))
	}
	c.next[g] = seq + 1
	if l, ok := c.laneOf[g]; ok && l != d.Lane() {
		c.problem(fmt.Sprintf("group %s on lanes %d and %d", g, l, d.Lane()))
	}
	c.laneOf[g] = d.Lane()
	if bodyErr != nil {
		c.problem(fmt.Sprintf("%s/%d: %v", g, seq, bodyErr))
	}
}

// problem keeps the first few problems; the counts tell the rest.
func (c *seqChecker) problem(p string) {
	if len(c.problems) < 10 {
		c.problems = append(c.problems, p)
	}
}

func (c *seqChecker) count() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.handled
}

// consumeGroups consumes n messages in the given number of groups from
// queue with WorkersByKey(8) and random handler delays, checks every
// delivery with body, and then that every group arrived complete, in order,
// once, and that nothing is left on the queue.
func consumeGroups(t *testing.T, url, queue string, n, groups int,
	body func(d *amqpsub.Delivery, group string, seq uint32) error) {
	t.Helper()
	check := newSeqChecker()
	s, err := amqpsub.New(amqpsub.Dial(url, nil), queue, amqpsub.HandlerFunc(func(ctx context.Context, d *amqpsub.Delivery) error {
		time.Sleep(time.Duration(rand.IntN(300)) * time.Microsecond) // work, to mix the lanes
		check.record(d, body)
		return nil
	}), amqpsub.WorkersByKey(8), amqpsub.Logger(logger(t)))
	if err != nil {
		t.Fatal(err)
	}
	stop, wait := runSub(t, s)
	waitFor(t, 2*time.Minute, fmt.Sprintf("%d deliveries", n), func() bool { return check.count() >= n })
	stop()
	if err := wait(); err != nil {
		t.Fatalf("Run = %v", err)
	}
	st := s.Stats()
	check.mu.Lock()
	defer check.mu.Unlock()
	t.Logf("%d messages, %d groups: handled %d, duplicates %d, order violations %d; stats %+v",
		n, groups, check.handled, check.dups, check.violations, st)
	for _, p := range check.problems {
		t.Error(p)
	}
	if check.handled != n || check.dups != 0 || check.violations != 0 {
		t.Errorf("handled %d of %d, %d duplicates, %d order violations", check.handled, n, check.dups, check.violations)
	}
	if st.Settled.Accepted != uint64(n) || st.Settled.Modified != 0 || st.Settled.Released != 0 || st.Settled.Rejected != 0 {
		t.Errorf("settlements: %+v, want %d accepted and nothing else", st, n)
	}
	if len(check.seen) != groups {
		t.Errorf("%d groups, want %d", len(check.seen), groups)
	}
	for g, seqs := range check.seen {
		want := n / groups
		if len(seqs) < want || len(seqs) > want+1 {
			t.Errorf("group %s: %d distinct messages, want %d", g, len(seqs), want)
		}
	}
	if left := receiveN(t, rawReceiver(t, dial(t, url), queue, 10), 1, time.Second); len(left) != 0 {
		t.Errorf("%d messages left on the queue", len(left))
	}
}

// javaSerializedString is Java's serialized form of a java.lang.String of
// ASCII text: stream magic and version, TC_STRING, length, bytes.
func javaSerializedString(s string) []byte {
	b := []byte{0xac, 0xed, 0x00, 0x05, 0x74}
	b = binary.BigEndian.AppendUint16(b, uint16(len(s)))
	return append(b, s...)
}

// jmsKinds maps the producer's --kind to the JMS type it sends.
var jmsKinds = map[string]amqpsub.JMSType{
	"text": amqpsub.JMSText, "bytes": amqpsub.JMSBytes, "map": amqpsub.JMSMap,
	"stream": amqpsub.JMSStream, "object": amqpsub.JMSObject,
}

// checkJMS checks what a message from jms-producer exposes: the JMS
// message type, the content type, the group and its sequence, and the body
// through every view: its own gives the value the producer wrote, the
// others an error wrapping ErrBodyKind.
func checkJMS(d *amqpsub.Delivery, group string, seq uint32) error {
	kind, _ := d.ApplicationProperties()["kind"].(string)
	want, known := jmsKinds[kind]
	if !known {
		return fmt.Errorf("application property kind = %q", kind)
	}
	var errs []error
	fail := func(format string, args ...any) { errs = append(errs, fmt.Errorf(format, args...)) }
	if typ, ok := d.JMSMessageType(); !ok || typ != want {
		fail("JMSMessageType = %v, %v, want %v", typ, ok, want)
	}
	if v, ok := d.Annotation("x-opt-jms-dest"); !ok || v != int8(0) {
		fail("x-opt-jms-dest = %#v, %v, want int8(0) (a queue)", v, ok)
	}
	if id, _ := d.MessageID().(string); !strings.HasPrefix(id, "ID:") {
		fail("message-id %#v, want a string ID:...", d.MessageID())
	}
	if _, ok := d.ApplicationProperties()["n"].(int32); !ok {
		fail("application property n = %#v, want an int32", d.ApplicationProperties()["n"])
	}
	wantCT := map[amqpsub.JMSType]string{amqpsub.JMSBytes: amqpsub.ContentTypeOctetStream, amqpsub.JMSObject: amqpsub.ContentTypeJavaSerialized}[want]
	if ct := d.ContentType(); ct != wantCT {
		fail("content-type %q, want %q", ct, wantCT)
	}

	key := fmt.Sprintf("%s/%d", group, seq)
	text, textErr := d.Text()
	m, mapErr := d.Map()
	stream, streamErr := d.Stream()
	java, javaErr := d.JavaSerialized()
	body, bodyErr := d.Body()
	views := map[amqpsub.JMSType]struct {
		name      string
		got, want any
		err       error
	}{
		amqpsub.JMSText: {"Text", text, key, textErr},
		amqpsub.JMSMap: {"Map", m, map[string]any{"key": key, "seq": int32(seq), "big": int64(1) << 40,
			"flag": seq%2 == 0, "half": float64(seq) / 2, "raw": []byte{1, 2, 3}}, mapErr},
		amqpsub.JMSStream: {"Stream", stream, []any{key, int32(seq), true, []byte{1, 2, 3}, 0.5}, streamErr},
		amqpsub.JMSObject: {"JavaSerialized", java, javaSerializedString(key), javaErr},
		amqpsub.JMSBytes:  {"Body", body, []byte(key), bodyErr},
	}
	for typ, v := range views {
		switch {
		case typ == want && v.err != nil:
			fail("%s: %v", v.name, v.err)
		case typ == want && !reflect.DeepEqual(v.got, v.want):
			fail("%s = %#v, want %#v", v.name, v.got, v.want)
		case typ != want && want == amqpsub.JMSObject && typ == amqpsub.JMSBytes:
			// An ObjectMessage is data too: Body gives the same bytes.
			if !bytes.Equal(body, java) || bodyErr != nil {
				fail("Body on an ObjectMessage = %q, %v", body, bodyErr)
			}
		case typ != want && !errors.Is(v.err, amqpsub.ErrBodyKind):
			fail("%s on a %v: %#v, %v; want an error wrapping ErrBodyKind", v.name, want, v.got, v.err)
		}
	}
	return errors.Join(errs...)
}

// 2,000 messages over 20 groups from Qpid JMS, every JMS body type mixed
// within each group: handled in group order (JMSXGroupSeq), once each, and
// each Delivery shows what JMS set.
func TestJMSProducerGroupOrder(t *testing.T) {
	url := artemisURL(t)
	q := queueName(t)
	const n, groups = 2000, 20
	produceJMS(t, url, q, n, groups, "mixed")
	consumeGroups(t, url, q, n, groups, checkJMS)
}

// Each JMS body type on its own queue: the typed view gives what the
// producer wrote, every other view a clear ErrBodyKind error.
func TestJMSBodies(t *testing.T) {
	url := artemisURL(t)
	for _, kind := range []string{"text", "bytes", "map", "stream", "object"} {
		t.Run(kind, func(t *testing.T) {
			q := queueName(t)
			const n, groups = 40, 4
			produceJMS(t, url, q, n, groups, kind)
			consumeGroups(t, url, q, n, groups, checkJMS)
		})
	}
}

// checkPython checks a message from pyproducer: no JMS annotation, and the
// body the producer wrote, through its view.
func checkPython(d *amqpsub.Delivery, group string, seq uint32) error {
	if typ, ok := d.JMSMessageType(); ok {
		return fmt.Errorf("JMSMessageType = %v on a Proton message", typ)
	}
	if _, ok := d.ApplicationProperties()["n"].(int64); !ok {
		return fmt.Errorf("application property n = %#v, want an int64", d.ApplicationProperties()["n"])
	}
	key := fmt.Sprintf("%s/%d", group, seq)
	var got, want any
	var err error
	switch kind, _ := d.ApplicationProperties()["kind"].(string); kind {
	case "text":
		got, err = d.Text()
		want = key
	case "bytes":
		got, err = d.Body()
		want = []byte(key)
	case "map":
		got, err = d.Map()
		want = map[string]any{"key": key, "seq": int64(seq)}
	case "list":
		got, err = d.Stream()
		want = []any{key, int64(seq)}
	default:
		return fmt.Errorf("application property kind = %q", kind)
	}
	if err != nil {
		return err
	}
	if !reflect.DeepEqual(got, want) {
		return fmt.Errorf("body %#v, want %#v", got, want)
	}
	return nil
}

// 2,000 messages over 20 groups from Qpid Proton (Python): handled in group
// order (AMQP group-sequence), once each.
func TestPythonProducerGroupOrder(t *testing.T) {
	url := artemisURL(t)
	q := queueName(t)
	const n, groups = 2000, 20
	producePython(t, url, q, n, groups, "text")
	consumeGroups(t, url, q, n, groups, checkPython)
}

// Proton's other bodies: data, an amqp-value map, an amqp-sequence.
func TestPythonBodies(t *testing.T) {
	url := artemisURL(t)
	for _, kind := range []string{"bytes", "map", "list"} {
		t.Run(kind, func(t *testing.T) {
			q := queueName(t)
			const n, groups = 40, 4
			producePython(t, url, q, n, groups, kind)
			consumeGroups(t, url, q, n, groups, checkPython)
		})
	}
}

// The producer users copy (examples/producer) on Artemis: 3,000 messages
// over 30 groups, every send confirmed, are handled once each, in group
// order, each with the message-id it was given.
func TestProducerExample(t *testing.T) {
	url := artemisURL(t)
	conn := dial(t, url)
	q := queueName(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	const n, groups = 3000, 30
	err := producer.Send(ctx, conn, q, n, func(i int) *amqp.Message {
		g := fmt.Sprintf("g%02d", i%groups)
		m := producer.NewMessage(fmt.Sprintf("%s-%d", q, i), g, fmt.Appendf(nil, "%d", i/groups))
		m.ApplicationProperties = map[string]any{"seq": int64(i / groups)}
		return m
	}, &producer.Options{Window: 64})
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	next := map[string]int64{}
	ids := map[any]bool{}
	var bad []string
	h := amqpsub.HandlerFunc(func(_ context.Context, d *amqpsub.Delivery) error {
		seq, _ := d.ApplicationProperties()["seq"].(int64)
		mu.Lock()
		defer mu.Unlock()
		if seq != next[d.GroupID()] {
			bad = append(bad, fmt.Sprintf("%s: seq %d, want %d", d.GroupID(), seq, next[d.GroupID()]))
		}
		next[d.GroupID()] = seq + 1
		if ids[d.MessageID()] {
			bad = append(bad, fmt.Sprintf("message-id %v twice", d.MessageID()))
		}
		ids[d.MessageID()] = true
		return nil
	})
	s, err := amqpsub.New(amqpsub.Dial(url, nil), q, h, amqpsub.WorkersByKey(8), amqpsub.Logger(logger(t)))
	if err != nil {
		t.Fatal(err)
	}
	stop, wait := runSub(t, s)
	waitProgress(t, func() int64 { return int64(s.Stats().Settled.Accepted) }, n, time.Minute, s.Stats)
	stop()
	if err := wait(); err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(ids) != n || len(bad) > 0 {
		t.Fatalf("%d distinct message-ids of %d; %d faults: %v", len(ids), n, len(bad), bad[:min(len(bad), 10)])
	}
}
