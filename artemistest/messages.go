package artemistest

import (
	"context"
	"fmt"

	"github.com/Azure/go-amqp"

	"github.com/amqpsub/amqpsub/examples/producer"
)

// Publish sends msg(0) … msg(n-1), in that order, to queue on a connection
// of its own, and returns once the broker has accepted every one (see
// package examples/producer, which it uses: capability "queue", so that
// queue names an anycast queue, created on first use by the default
// broker.xml). A message msg returns should have a message-id of its own
// (producer.NewMessage makes one). ctx bounds the call.
func (b *Broker) Publish(ctx context.Context, queue string, n int, msg func(i int) *amqp.Message) error {
	conn, err := amqp.Dial(ctx, b.URL(), nil)
	if err != nil {
		return fmt.Errorf("artemistest: connect to %s: %w", b.Addr(), err)
	}
	defer func() { _ = conn.Close() }()
	if err := producer.Send(ctx, conn, queue, n, msg, nil); err != nil {
		return fmt.Errorf("artemistest: publish to %s: %w", queue, err)
	}
	return nil
}

// Receive takes n messages from queue, accepting each, and returns them in
// the order they came. queue is a queue's name, or a fully qualified one
// (address::queue), such as a dead-letter queue, "DLQ::DLQ.orders" for
// queue orders with the default broker.xml. It waits within ctx: when ctx
// ends first it returns what it took, and an error wrapping ctx's. A queue
// that does not exist is an error (amqp:not-found) for a fully qualified
// name; a plain name is created on first use, and waited on. n of 0 takes
// nothing. The link's credit is n, at most 1,000: above that the broker
// may send a few messages past the n-th, which go back to the queue,
// untouched, when Receive returns.
func (b *Broker) Receive(ctx context.Context, queue string, n int) ([]*amqp.Message, error) {
	conn, err := amqp.Dial(ctx, b.URL(), nil)
	if err != nil {
		return nil, fmt.Errorf("artemistest: connect to %s: %w", b.Addr(), err)
	}
	defer func() { _ = conn.Close() }()
	sess, err := conn.NewSession(ctx, nil)
	if err != nil {
		return nil, fmt.Errorf("artemistest: session: %w", err)
	}
	rcv, err := sess.NewReceiver(ctx, queue, &amqp.ReceiverOptions{SourceCapabilities: []string{"queue"}, Credit: int32(min(max(n, 1), 1000))})
	if err != nil {
		return nil, fmt.Errorf("artemistest: receiver on %s: %w", queue, err)
	}
	out := make([]*amqp.Message, 0, n)
	for len(out) < n {
		m, err := rcv.Receive(ctx, nil)
		if err != nil {
			return out, fmt.Errorf("artemistest: %d of %d messages from %s: %w", len(out), n, queue, err)
		}
		if err := rcv.AcceptMessage(ctx, m); err != nil {
			return out, fmt.Errorf("artemistest: accept a message of %s: %w", queue, err)
		}
		out = append(out, m)
	}
	return out, nil
}
