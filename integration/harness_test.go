package integration

import (
	"context"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/Azure/go-amqp"

	"github.com/amqpsub/amqpsub/amqpsub"
)

// The harness the scenario tables run on: a target is one broker (and,
// on RabbitMQ 4, one queue type), and a scenario's table names the
// targets it holds for. A row whose broker is not configured skips.

// Target names, as the scenario tables name them.
const (
	onArtemis          = "artemis"
	onRabbitMQ3        = "rabbitmq3"
	onRabbitMQ4Classic = "rabbitmq4/classic"
	onRabbitMQ4Quorum  = "rabbitmq4/quorum"
)

// target is one broker with one kind of queue: where a scenario makes its
// queue, publishes, attaches and finds the dead letters.
type target struct {
	name string
	url  string
	kind string // RabbitMQ 4's queue type; "" elsewhere
	// opts are the subscriber options every scenario passes on this
	// broker: its profile, where it is not the default.
	opts []amqpsub.Option
}

// newTarget returns the target called name, or skips the test when its
// broker is not configured.
func newTarget(t testing.TB, name string) target {
	t.Helper()
	switch name {
	case onArtemis:
		return target{name: name, url: artemisURL(t)}
	case onRabbitMQ3:
		return target{name: name, url: rabbitURL(t), opts: []amqpsub.Option{amqpsub.WithProfile(amqpsub.RabbitMQ3)}}
	case onRabbitMQ4Classic, onRabbitMQ4Quorum:
		return target{name: name, url: rabbit4URL(t), kind: name[len("rabbitmq4/"):],
			opts: []amqpsub.Option{amqpsub.WithProfile(amqpsub.RabbitMQ4)}}
	}
	t.Fatalf("no target %q", name)
	return target{}
}

func (tg target) rabbit4() bool { return tg.kind != "" }

// queue makes a fresh queue and returns the name a subscriber is given:
// Artemis and RabbitMQ 3.10 create it on first use, RabbitMQ 4 declares it
// (and deletes it when the test ends).
func (tg target) queue(t testing.TB) string {
	t.Helper()
	if tg.rabbit4() {
		return declareRabbit4(t, tg.kind)
	}
	return queueName(t)
}

// address is where a plain link reaches queue q.
func (tg target) address(q string) string {
	switch {
	case tg.rabbit4():
		return "/queues/" + q
	case tg.name == onRabbitMQ3:
		return "/queue/" + q
	}
	return q
}

// deadLetterAddress is where a plain link reaches what q dead-lettered.
func (tg target) deadLetterAddress(q string) string {
	if tg.rabbit4() {
		return "/queues/" + q + ".dlq"
	}
	return dlq(q)
}

// publish sends msgs and publishFast's barrier (seq -1) to q.
func (tg target) publish(t testing.TB, conn *amqp.Conn, q string, msgs []msgSpec) {
	t.Helper()
	publishFast(t, conn, tg.address(q), tg.name == onArtemis, msgs)
}

// filled makes a fresh queue and publishes msgs to it (and the barrier);
// it returns the queue and the connection that published, open until the
// test ends.
func (tg target) filled(t testing.TB, msgs []msgSpec) (string, *amqp.Conn) {
	t.Helper()
	q := tg.queue(t)
	conn := dial(t, tg.url)
	tg.publish(t, conn, q, msgs)
	return q, conn
}

// subscriber is amqpsub.New on q with the target's options, then opts, and
// the test's logger.
func (tg target) subscriber(t testing.TB, q string, h amqpsub.Handler, opts ...amqpsub.Option) *amqpsub.Subscriber {
	t.Helper()
	all := append(slices.Clone(tg.opts), opts...)
	s, err := amqpsub.New(amqpsub.Dial(tg.url, nil), q, h, append(all, amqpsub.Logger(logger(t)))...)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// deadLetters takes up to n of what q dead-lettered, waiting until within
// passes for n.
func (tg target) deadLetters(t testing.TB, conn *amqp.Conn, q string, n int, within time.Duration) []*amqp.Message {
	t.Helper()
	return receiveN(t, rawReceiver(t, conn, tg.deadLetterAddress(q), int32(max(n, 1))), n, within)
}

// ready is the count of messages ready in q, as the broker reports it.
func (tg target) ready(t testing.TB, conn *amqp.Conn, q string) int {
	t.Helper()
	switch {
	case tg.rabbit4():
		return rabbit4Count(t, q)
	case tg.name != onArtemis:
		t.Fatalf("no count of ready messages on %s", tg.name)
	}
	v := queueAttribute(t, conn, q, "messageCount")
	n, err := strconv.Atoi(v)
	if err != nil {
		t.Fatalf("messageCount of %s: %q", q, v)
	}
	return n
}

// assertDrained fails the test when q still holds a message: on Artemis
// by its count, on RabbitMQ by taking what comes (a quorum queue's count
// lags by seconds).
func (tg target) assertDrained(t testing.TB, conn *amqp.Conn, q string) {
	t.Helper()
	if tg.name == onArtemis {
		assertQueueEmpty(t, conn, q)
		return
	}
	if left := drainAddress(t, conn, tg.address(q)); len(left) != 0 {
		t.Fatalf("%d messages left in %s", len(left), q)
	}
}

// handled is what a handler saw of one delivery.
type handled struct {
	count         uint32
	firstAcquirer bool
}

// consumeOne publishes one message (seq 7) to a fresh queue q and runs
// handle over it (call counts from 1) until done says the calls are
// complete and the broker has nothing left to deliver, queued or out; it
// returns what the handler saw and the subscriber's stats.
func (tg target) consumeOne(t *testing.T, conn *amqp.Conn, q string, handle func(call int, d *amqpsub.Delivery) error,
	done func(calls int) bool, opts ...amqpsub.Option) ([]handled, amqpsub.Stats) {
	t.Helper()
	tg.publish(t, conn, q, []msgSpec{{seq: 7}})
	var mu sync.Mutex
	var calls []handled
	s := tg.subscriber(t, q, amqpsub.HandlerFunc(func(ctx context.Context, d *amqpsub.Delivery) error {
		if seqOf(d) == -1 {
			return nil // the publisher's barrier
		}
		mu.Lock()
		calls = append(calls, handled{d.DeliveryCount(), d.FirstAcquirer()})
		n := len(calls)
		mu.Unlock()
		return handle(n, d)
	}), opts...)
	stop, wait := runSub(t, s)
	waitFor(t, 30*time.Second, "the handler calls", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return done(len(calls))
	})
	waitFor(t, 30*time.Second, "the queue empty", func() bool { return tg.ready(t, conn, q) == 0 })
	stop()
	if err := wait(); err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	defer mu.Unlock()
	return slices.Clone(calls), s.Stats()
}
