package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/Azure/go-amqp"

	"github.com/amqpsub/amqpsub/amqpsub"
	"github.com/amqpsub/amqpsub/internal/publish"
)

// broker is one broker under test and what differs between brokers on the
// wire.
type broker struct {
	name string // "artemis", "rabbitmq" (3.10), "rabbitmq4-classic" or "rabbitmq4-quorum"
	url  string
	// queueKind is the kind of queue integration/rabbitmq4.sh declares
	// before the preload, "classic" or "quorum"; "" for the brokers whose
	// queue the preload creates.
	queueKind string
	profile   amqpsub.Profile
	// windowed: grant credit only once the previous window has arrived
	// (RabbitMQ 3.10 sends past its credit and miscounts a flow frame that
	// arrives while transfers are in flight).
	windowed bool
	// detach: the broker answers a link detach. RabbitMQ 3.10 does not, so
	// only its session is closed.
	detach bool
	pid    int    // broker process, for its CPU time; 0 if unknown
	pidErr string // why pid is 0
	label  string // product and version, from the connection's open frame
}

// sendAddress is where the preload sender sends; receiveAddress is what the
// hand-written loop attaches to; amqpsub is given the bare queue name and
// maps it through its profile.
func (b *broker) sendAddress(q string) string {
	if b.queueKind != "" {
		// RabbitMQ 4's v2 address of a queue declared beforehand.
		return "/queues/" + q
	}
	if b.name == "rabbitmq" {
		// Creates the queue; with a durable target terminus it is a durable
		// queue (without, RabbitMQ 3.10 makes it non-durable).
		return "/queue/" + q
	}
	return q
}

func (b *broker) receiveAddress(q string) string {
	if b.queueKind != "" {
		return "/queues/" + q
	}
	if b.name == "rabbitmq" {
		return "/amq/queue/" + q
	}
	return q
}

func (b *broker) sourceCaps() []string {
	if b.name == "artemis" {
		return []string{"queue"}
	}
	return nil
}

func (b *broker) dial(ctx context.Context) (*amqp.Conn, error) {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	c, err := amqp.Dial(ctx, b.url, nil)
	if err != nil {
		return nil, fmt.Errorf("dial %s: %w", b.name, err)
	}
	return c, nil
}

// closeLink closes a receiver (if the broker answers a detach) and its
// session, each within 5 s. Errors are of no interest to a benchmark that
// already has its figures.
func (b *broker) closeLink(rcv *amqp.Receiver, sess *amqp.Session) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if rcv != nil && b.detach {
		_ = rcv.Close(ctx)
	}
	if sess != nil {
		_ = sess.Close(ctx)
	}
}

// describe returns the broker called name (one of brokerNames) at url, with
// what differs on the wire.
func describe(name, url string) (*broker, error) {
	b := &broker{name: name, url: url}
	switch name {
	case "artemis":
		b.profile, b.detach = amqpsub.Artemis, true
	case "rabbitmq":
		b.profile, b.windowed = amqpsub.RabbitMQ3, true
	case "rabbitmq4-classic", "rabbitmq4-quorum":
		// Native AMQP 1.0: credit as on Artemis (the broker keeps to it),
		// and it answers a detach.
		b.profile, b.detach = amqpsub.RabbitMQ4, true
		b.queueKind = strings.TrimPrefix(name, "rabbitmq4-")
	default:
		return nil, fmt.Errorf("unknown broker %q", name)
	}
	return b, nil
}

// newBroker describes the broker at url, finds its process and reads its
// version from the open frame.
func newBroker(ctx context.Context, name, url string, pidFlag int) (*broker, error) {
	b, err := describe(name, url)
	if err != nil {
		return nil, err
	}
	c, err := b.dial(ctx)
	if err != nil {
		return nil, err
	}
	props := c.Properties()
	b.label = strings.TrimSpace(fmt.Sprintf("%v %v", props["product"], props["version"]))
	if b.queueKind != "" {
		b.label += ", " + b.queueKind + " queue"
	}
	_ = c.Close()
	switch {
	case pidFlag > 0:
		b.pid = pidFlag
	case name == "artemis":
		b.pid, err = artemisPID()
	case name == "rabbitmq":
		b.pid, err = beamPID("RabbitMQ", "rabbitmq")
	default:
		b.pid, err = beamPID("RabbitMQ 4", "rabbitmq4", "state")
	}
	if b.pid > 0 {
		if _, _, err2 := procCPU(b.pid); err2 != nil {
			b.pid, err = 0, err2
		}
	}
	if b.pid == 0 {
		if err == nil {
			err = errors.New("not found")
		}
		b.pidErr = err.Error()
	}
	return b, nil
}

// artemisPID asks integration/artemis.sh (AMQPSUB_ARTEMIS_CTL, or the
// script relative to the module root) for the broker's java PID.
func artemisPID() (int, error) {
	ctl := os.Getenv("AMQPSUB_ARTEMIS_CTL")
	if ctl == "" {
		ctl = filepath.Join("integration", "artemis.sh")
	}
	if _, err := os.Stat(ctl); err != nil {
		return 0, fmt.Errorf("artemis.sh not found (set AMQPSUB_ARTEMIS_CTL or -artemis-pid): %w", err)
	}
	out, err := exec.Command("bash", ctl, "pid").Output()
	if err != nil {
		return 0, fmt.Errorf("%s pid: %w", ctl, err)
	}
	pid, err := strconv.Atoi(strings.TrimSpace(string(out)))
	if err != nil {
		return 0, fmt.Errorf("%s pid printed %q: %w", ctl, out, err)
	}
	return pid, nil
}

// beamPIDFile returns the path of the PID file a broker script has the
// Erlang VM write, under $AMQPSUB_CACHE (default ~/.cache/amqpsub):
// rabbitmq/rabbitmq.pid for integration/rabbitmq.sh,
// rabbitmq4/state/rabbitmq.pid for integration/rabbitmq4.sh.
func beamPIDFile(dir ...string) (string, error) {
	cache := os.Getenv("AMQPSUB_CACHE")
	if cache == "" {
		home, err := os.UserHomeDir()
		if err != nil {
			return "", fmt.Errorf("no AMQPSUB_CACHE and no home: %w", err)
		}
		cache = filepath.Join(home, ".cache", "amqpsub")
	}
	return filepath.Join(append(append([]string{cache}, dir...), "rabbitmq.pid")...), nil
}

// beamPID reads the Erlang VM's PID from the file beamPIDFile(dir...)
// names and checks that it is a beam process. integration/rabbitmq4.sh runs
// its VM chrooted but in the host's PID namespace, so the PID it writes is
// the host's.
func beamPID(what string, dir ...string) (int, error) {
	file, err := beamPIDFile(dir...)
	if err != nil {
		return 0, err
	}
	raw, err := os.ReadFile(file)
	if err != nil {
		return 0, fmt.Errorf("read %s PID file (set AMQPSUB_CACHE as for the broker script): %w", what, err)
	}
	pid, err := strconv.Atoi(strings.TrimSpace(string(raw)))
	if err != nil {
		return 0, fmt.Errorf("%s holds %q: %w", file, raw, err)
	}
	cmd, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
	if err != nil {
		return 0, fmt.Errorf("%s PID %d: %w", what, pid, err)
	}
	if !strings.Contains(string(cmd), "beam") {
		return 0, fmt.Errorf("PID %d from %s is not a beam process", pid, file)
	}
	return pid, nil
}

// payload is the kind of message preloaded.
type payload struct {
	name    string // flag value
	title   string
	size    int
	durable bool
}

var payloads = []payload{
	{name: "p100", title: "100 B persistent", size: 100, durable: true},
	{name: "t1k", title: "1 KiB non-persistent", size: 1024, durable: false},
}

// preload sends n+1 messages to queue over links senders, each on its own
// session: pre-settled, except the last of each sender, sent unsettled,
// whose acceptance tells that every message the sender sent before it
// arrived (one link, in order). Message i has group-id
// groups[i%len(groups)], none if groups is empty.
func preload(ctx context.Context, b *broker, queue string, n, links int, p payload, groups []string) (time.Duration, error) {
	conn, err := b.dial(ctx)
	if err != nil {
		return 0, err
	}
	defer conn.Close()
	body := make([]byte, p.size)
	for i := range body {
		body[i] = byte('a' + i%26)
	}
	target := publish.Target{Address: b.sendAddress(queue)}
	switch {
	case b.name == "artemis":
		target.Capabilities = []string{"queue"}
	case b.queueKind == "":
		target.Durability = amqp.DurabilityUnsettledState
	}
	start := time.Now()
	err = publish.Send(ctx, conn, target, links, n+1, func(i int) *amqp.Message {
		m := amqp.NewMessage(body)
		m.Header = &amqp.MessageHeader{Durable: p.durable}
		m.Properties = &amqp.MessageProperties{}
		if len(groups) > 0 {
			m.Properties.GroupID = &groups[i%len(groups)]
		}
		return m
	})
	if err != nil {
		return 0, err
	}
	return time.Since(start), nil
}

// probeEmpty checks that queue is empty: a receiver with credit 1 gets
// nothing within wait. Messages it does get are accepted and counted.
func probeEmpty(ctx context.Context, b *broker, queue string, wait time.Duration) error {
	conn, err := b.dial(ctx)
	if err != nil {
		return err
	}
	defer conn.Close()
	sess, err := conn.NewSession(ctx, nil)
	if err != nil {
		return fmt.Errorf("probe session: %w", err)
	}
	rcv, err := sess.NewReceiver(ctx, b.receiveAddress(queue), &amqp.ReceiverOptions{
		Credit:             1,
		SourceCapabilities: b.sourceCaps(),
	})
	if err != nil {
		b.closeLink(nil, sess)
		return fmt.Errorf("probe receiver: %w", err)
	}
	defer b.closeLink(rcv, sess)
	left := 0
	for {
		rctx, cancel := context.WithTimeout(ctx, wait)
		m, err := rcv.Receive(rctx, nil)
		cancel()
		if err != nil {
			if ctx.Err() != nil {
				return ctx.Err()
			}
			if !errors.Is(err, context.DeadlineExceeded) {
				return fmt.Errorf("probe receive: %w", err)
			}
			break
		}
		left++
		if err := rcv.AcceptMessage(ctx, m); err != nil {
			return fmt.Errorf("probe accept: %w", err)
		}
	}
	if left > 0 {
		return fmt.Errorf("queue %s not empty after the drain: %d messages were left", queue, left)
	}
	return nil
}

// script returns the path of a broker script: $env, or the script relative
// to the module root.
func script(env, name string) (string, error) {
	ctl := os.Getenv(env)
	if ctl == "" {
		ctl = filepath.Join("integration", name)
	}
	if _, err := os.Stat(ctl); err != nil {
		return "", fmt.Errorf("%s not found (set %s): %w", name, env, err)
	}
	return ctl, nil
}

// declareQueue declares the queue the preloads fill where the preload
// cannot: on RabbitMQ 4, whose v2 addresses need an existing queue,
// through `integration/rabbitmq4.sh declare Q classic|quorum`
// (AMQPSUB_RABBITMQ4_CTL), a durable queue that dead-letters to Q.dlq. On
// Artemis and RabbitMQ 3.10 the preload's sender creates it.
func declareQueue(b *broker, queue string) error {
	if b.queueKind == "" {
		return nil
	}
	ctl, err := script("AMQPSUB_RABBITMQ4_CTL", "rabbitmq4.sh")
	if err != nil {
		return err
	}
	out, err := exec.Command("bash", ctl, "declare", queue, b.queueKind).CombinedOutput()
	if err != nil {
		return fmt.Errorf("declare %s queue %s: %w: %s", b.queueKind, queue, err, strings.TrimSpace(string(out)))
	}
	return nil
}

// deleteQueue removes a RabbitMQ queue the preload declared durable,
// through integration/rabbitmq.sh (AMQPSUB_RABBITMQ_CTL), or the RabbitMQ 4
// queue declareQueue made and its Q.dlq, through integration/rabbitmq4.sh.
// Artemis deletes its auto-created queues itself once they are empty and
// unused.
func deleteQueue(b *broker, queue string) error {
	env, name := "AMQPSUB_RABBITMQ_CTL", "rabbitmq.sh"
	switch {
	case b.queueKind != "":
		env, name = "AMQPSUB_RABBITMQ4_CTL", "rabbitmq4.sh"
	case b.name != "rabbitmq":
		return nil
	}
	ctl, err := script(env, name)
	if err != nil {
		return fmt.Errorf("delete queue %s by hand: %w", queue, err)
	}
	out, err := exec.Command("bash", ctl, "delete", queue).CombinedOutput()
	if err != nil {
		return fmt.Errorf("delete queue %s: %w: %s", queue, err, out)
	}
	return nil
}
