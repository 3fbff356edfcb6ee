// Package producer is a producer to copy: it sends messages to a queue the
// way amqpsub's consumers expect them, every one confirmed by the broker,
// with many in flight at once. examples/orders and examples/replicas use
// it; it needs nothing but go-amqp.
//
// What a message needs (see [NewMessage]):
//   - a message-id of its own: [amqpsub.DeadLetterCopy] makes the copy's
//     duplicate-detection id from it, so that a copy sent twice after a
//     crash is stored once, while two messages that shared an id would be
//     stored as one;
//   - a group-id for what must stay in order: [amqpsub.WorkersByKey] runs a
//     group's deliveries one after another, and Artemis message groups keep
//     a group on one consumer of a queue;
//   - the durable header, so that the broker keeps it across a restart.
//
// What the link needs (see [Send]):
//   - on Artemis the target capability "queue", so that the address names
//     an anycast queue (created on first use when the broker auto-creates
//     queues), and not a multicast address whose messages nobody reads;
//   - on RabbitMQ 4 the address /queues/<name> (the name percent-encoded:
//     see amqpsub.RabbitMQ4): Send uses queue as it is given, and a bare
//     name is RabbitMQ's deprecated address form;
//   - unsettled sends, each confirmed by the broker's disposition: a
//     message counts as sent once the broker accepted it. Send keeps up to
//     Window sends in flight with [amqp.Sender.SendWithReceipt] and waits
//     for the oldest receipt before the next send, so the link is never
//     idle while it waits for an answer, and a message the broker refuses
//     (rejected, released, modified) is an error at once.
package producer

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/Azure/go-amqp"
)

// NewMessage returns a durable message with body, its message-id id and,
// when group is not "", its group-id group.
func NewMessage(id, group string, body []byte) *amqp.Message {
	m := amqp.NewMessage(body)
	m.Header = &amqp.MessageHeader{Durable: true}
	m.Properties = &amqp.MessageProperties{MessageID: id}
	if group != "" {
		m.Properties.GroupID = &group
	}
	return m
}

// Options are what Send is given beside the messages.
type Options struct {
	// Capabilities are the target capabilities of the sender: "queue" on
	// Artemis (the default, nil), none elsewhere (give []string{}).
	Capabilities []string
	// Window is how many sends may wait for the broker's answer at once.
	// Default 0: 128.
	Window int
	// CloseTimeout bounds the close of the sender and its session. Default
	// 0: 5 s.
	CloseTimeout time.Duration
}

// ErrNotAccepted is wrapped by Send's error for a message the broker did not
// accept; the error says the message's index and the broker's outcome.
var ErrNotAccepted = errors.New("producer: the broker did not accept a message")

// Send sends msg(0) … msg(n-1), in that order, to queue (the target
// address, as it is: "/queues/orders" on RabbitMQ 4) on a sender of its
// own on conn, and returns once the broker has accepted every one. It
// returns the first error: a send or a receipt that failed (the link or
// connection is lost), a message the broker did not accept (wrapping
// ErrNotAccepted), or ctx's error. Messages after a failed one may have
// been sent; those before it were accepted. Once every message was
// accepted, Send returns nil even if closing the sender then fails: the
// messages are on the broker, and sending them again would duplicate
// them. ctx bounds the whole call.
func Send(ctx context.Context, conn *amqp.Conn, queue string, n int, msg func(i int) *amqp.Message, opts *Options) error {
	o := Options{Window: 128, CloseTimeout: 5 * time.Second, Capabilities: []string{"queue"}}
	if opts != nil {
		if opts.Capabilities != nil {
			o.Capabilities = opts.Capabilities
		}
		if opts.Window > 0 {
			o.Window = opts.Window
		}
		if opts.CloseTimeout > 0 {
			o.CloseTimeout = opts.CloseTimeout
		}
	}
	sess, err := conn.NewSession(ctx, nil)
	if err != nil {
		return fmt.Errorf("producer: session: %w", err)
	}
	// Closing the session ends the sender too (RabbitMQ 3.10 never answers
	// a link's detach, so the sender is not closed on its own).
	defer func() {
		cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), o.CloseTimeout)
		defer cancel()
		_ = sess.Close(cctx) // see above: after all were accepted, nothing to report
	}()
	snd, err := sess.NewSender(ctx, queue, &amqp.SenderOptions{TargetCapabilities: o.Capabilities})
	if err != nil {
		return fmt.Errorf("producer: sender to %s: %w", queue, err)
	}
	type sent struct {
		i int
		r amqp.SendReceipt
	}
	inFlight := make([]sent, 0, o.Window)
	wait := func(s sent) error {
		state, err := s.r.Wait(ctx)
		if err != nil {
			return fmt.Errorf("producer: message %d to %s: %w", s.i, queue, err)
		}
		if _, ok := state.(*amqp.StateAccepted); !ok {
			return fmt.Errorf("%w: message %d to %s: %T %+v", ErrNotAccepted, s.i, queue, state, state)
		}
		return nil
	}
	for i := range n {
		if len(inFlight) == o.Window {
			if err := wait(inFlight[0]); err != nil {
				return err
			}
			inFlight = append(inFlight[:0], inFlight[1:]...)
		}
		r, err := snd.SendWithReceipt(ctx, msg(i), nil)
		if err != nil {
			return fmt.Errorf("producer: send %d to %s: %w", i, queue, err)
		}
		inFlight = append(inFlight, sent{i, r})
	}
	for _, s := range inFlight {
		if err := wait(s); err != nil {
			return err
		}
	}
	return nil
}
