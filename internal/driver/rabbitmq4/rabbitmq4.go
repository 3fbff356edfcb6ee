// Package rabbitmq4 is the driver for RabbitMQ 4.x, whose AMQP 1.0 is
// native. At each attach it asks the broker's management node what type
// the queue is, because RabbitMQ 4 treats returns differently by queue
// type:
//
//   - a quorum queue counts every return (released, and modified with or
//     without delivery-failed) toward its delivery-limit (20 by default) and
//     dead-letters at the limit; modified{delivery-failed} raises the
//     header's delivery-count. It keeps the annotations of a
//     modified{undeliverable-here} on the dead letter;
//   - a classic queue counts nothing (the header's delivery-count stays 0)
//     and has no delivery limit; a rejection's reason reaches nothing.
//
// So on a quorum queue (or one whose type could not be read) a stop
// finishes what is buffered rather than release it (ReturnsCounted), and
// a Reject is sent as modified{delivery-failed, undeliverable-here} with the
// reason in x-opt- annotations; on a classic queue MaxDeliveryCount is
// refused, since nothing would ever reach it. A test source says the
// queue's type itself: see QueueSource.
package rabbitmq4

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"

	"github.com/Azure/go-amqp"
	"go.uber.org/zap"

	"github.com/amqpsub/amqpsub/internal/driver"
)

// The annotations a Reject on a quorum queue puts on the dead letter.
// RabbitMQ takes only keys that start with "x-": any other ends the session.
const (
	AnnotationReason      = "x-opt-dead-letter-reason"
	AnnotationDescription = "x-opt-dead-letter-description"
	AnnotationCondition   = "x-opt-dead-letter-condition"
)

// Driver is RabbitMQ 4's driver; rejectCond is the condition of a Reject.
type Driver struct {
	driver.Plain
	rejectCond amqp.ErrCond
}

// New returns RabbitMQ 4's driver, rejecting with rejectCond.
func New(rejectCond amqp.ErrCond) Driver { return Driver{rejectCond: rejectCond} }

// Facts returns RabbitMQ 4's facts. A quorum queue keeps the reason and
// description (annotations): a code to filter on, as Service Bus gives.
func (d Driver) Facts() driver.Facts {
	return driver.Facts{
		Name:         "rabbitmq4",
		System:       "rabbitmq",
		Retry:        driver.Outcome{Kind: driver.Modify, DeliveryFailed: true},
		Detach:       true,
		RejectCond:   d.rejectCond,
		NamedReasons: true,
	}
}

// Address maps a queue name to RabbitMQ 4's v2 address.
func (Driver) Address(q string) string { return address(q) }

// Claims claims RabbitMQ from major version 4.
func (Driver) Claims(product, version string) bool {
	return strings.EqualFold(product, "rabbitmq") && driver.MajorVersion(version) >= 4
}

// NewPipe returns the pipe part that reads the queue's type at each attach.
func (Driver) NewPipe(env driver.PipeEnv) driver.Pipe { return &pipe{env: env} }

// pipe keeps what the last attach read of the queue.
type pipe struct {
	driver.Base
	env   driver.PipeEnv
	queue atomic.Pointer[queueInfo] // what the last attach read; nil before
	warn  atomic.Bool               // the management node's failure was logged
}

// queueInfo is what RabbitMQ 4's management node says of a queue.
type queueInfo struct {
	// typ is "classic", "quorum" or "stream"; "" when it could not be read.
	typ string
	// limit is the queue's x-delivery-limit argument, 0 when it has none
	// (a quorum queue's default is 20, and a policy may set another).
	limit int64
	// reused: this attach could not read the queue, and goes on with what
	// an earlier one read.
	reused bool
}

// Attached reads the queue's type and delivery limit from the management
// node on l's connection.
func (k *pipe) Attached(ctx context.Context, l driver.Link) (driver.Source, string, error) {
	q, err := readQueue(ctx, l.Conn(), address(k.env.Config().Queue))
	if err != nil {
		if ctx.Err() != nil {
			return nil, "read the queue's type", err
		}
		if !k.warn.Swap(true) {
			k.env.Log().Warn("could not read the queue's type from RabbitMQ's management node; going on with the type an earlier attach read, or else as on a quorum queue, rejecting without the reason",
				zap.Error(err))
		}
		q = queueInfo{}
		if last := k.queue.Load(); last != nil {
			// What an earlier attach read still holds: a queue keeps its
			// type while it exists.
			q = *last
			q.reused = true
		}
	}
	if err := k.use(q); err != nil {
		return nil, "check the queue", err
	}
	return nil, "", nil
}

// use keeps q, what an attach read of the queue, for the settlements and
// the stop, and refuses MaxDeliveryCount on a classic queue.
func (k *pipe) use(q queueInfo) error {
	k.queue.Store(&q)
	if n := k.env.Config().MaxDeliveryCount; q.typ == "classic" && n > 0 {
		return &driver.MismatchError{Detail: fmt.Sprintf("MaxDeliveryCount(%d) on classic queue %q: RabbitMQ counts no "+
			"delivery attempts on a classic queue, so no delivery would ever reach the limit; use a quorum queue "+
			"(its x-delivery-limit dead-letters too), or leave MaxDeliveryCount off and count attempts in the handler (by message-id) to Reject",
			n, k.env.Config().Queue)}
	}
	if q.typ != "" && !q.reused {
		// Once per attach, beside "attached": what a return costs here.
		k.env.Log().Info("queue type read", zap.String("type", q.typ), zap.Int64("delivery_limit", q.limit))
	}
	return nil
}

// QueueSource is a test source that plays a RabbitMQ 4 queue: it says
// what the management node says of a broker's queue, its type ("quorum",
// "classic") and its x-delivery-limit argument (0 when it has none).
type QueueSource interface {
	RabbitMQQueue() (typ string, deliveryLimit int64)
}

// CheckSource: the queue is what the source says, or, from a source
// that plays no RabbitMQ 4 queue, one whose type could not be read.
func (k *pipe) CheckSource(src driver.Source) (string, error) {
	var q queueInfo
	if rs, ok := src.(QueueSource); ok {
		q.typ, q.limit = rs.RabbitMQQueue()
	}
	return "check the queue", k.use(q)
}

// ReturnsCounted: anything but a classic queue may count a release.
func (k *pipe) ReturnsCounted() bool {
	q := k.queue.Load()
	return q == nil || q.typ != "classic"
}

// Outcome sends a Reject on a quorum queue as modified{delivery-failed,
// undeliverable-here} with the reason in annotations, which the queue
// dead-letters keeping them; a rejected outcome's error reaches nothing on
// RabbitMQ.
func (k *pipe) Outcome(o driver.Outcome) driver.Outcome {
	if o.Kind == driver.Reject {
		if q := k.queue.Load(); q != nil && q.typ == "quorum" {
			return QuorumReject(o.Error)
		}
	}
	return o
}

// QuorumReject is the modified outcome that dead-letters on a quorum queue
// with e's reason, description and condition as annotations.
func QuorumReject(e *amqp.Error) driver.Outcome {
	a := amqp.Annotations{}
	if e != nil {
		if e.Description != "" {
			a[AnnotationReason] = e.Description
		}
		if d, ok := e.Info["DeadLetterErrorDescription"].(string); ok && d != "" {
			a[AnnotationDescription] = d
		}
		if e.Condition != "" {
			a[AnnotationCondition] = string(e.Condition)
		}
	}
	return driver.Outcome{Kind: driver.Modify, DeliveryFailed: true, UndeliverableHere: true, Annotations: a}
}

// rabbitManagement is RabbitMQ 4's management node, and the name its link
// pair must have.
const (
	rabbitManagement     = "/management"
	rabbitManagementPair = "management-link-pair"
)

// errNoAnswer: the management node sent something that is not an answer.
var errNoAnswer = errors.New("the management node's answer is not one")

// readQueue asks RabbitMQ 4's management node (an HTTP-like request
// over a pair of links, as RabbitMQ's own AMQP 1.0 clients do) for the
// queue at address (/queues/<name>), on a session of its own on conn (an
// error of the management node ends its session, which must not be the
// receiver's), within ctx, and closes the session again.
//
// The receiving link is attached and given its credit first: the node
// answers on it at once, and ends the session if it has no credit then;
// the credit goes out as soon as the link has it, a round trip (the
// sending link's attach) before the request.
func readQueue(ctx context.Context, conn *amqp.Conn, address string) (queueInfo, error) {
	sess, err := conn.NewSession(ctx, nil)
	if err != nil {
		return queueInfo{}, fmt.Errorf("open a session for %s: %w", rabbitManagement, err)
	}
	defer func() { _ = sess.Close(ctx) }()
	props := map[string]any{"paired": true}
	rcv, err := sess.NewReceiver(ctx, rabbitManagement, &amqp.ReceiverOptions{
		Name:                      rabbitManagementPair,
		Properties:                props,
		TargetAddress:             rabbitManagement,
		SettlementMode:            amqp.ReceiverSettleModeFirst.Ptr(),
		RequestedSenderSettleMode: amqp.SenderSettleModeSettled.Ptr(),
		Credit:                    -1, // manual: go-amqp would send an automatic credit only once Receive is called
	})
	if err != nil {
		return queueInfo{}, fmt.Errorf("attach from %s: %w", rabbitManagement, err)
	}
	if err := rcv.IssueCredit(1); err != nil {
		return queueInfo{}, fmt.Errorf("credit from %s: %w", rabbitManagement, err)
	}
	snd, err := sess.NewSender(ctx, rabbitManagement, &amqp.SenderOptions{
		Name:                        rabbitManagementPair,
		Properties:                  props,
		SourceAddress:               rabbitManagement,
		SettlementMode:              amqp.SenderSettleModeSettled.Ptr(),
		RequestedReceiverSettleMode: amqp.ReceiverSettleModeFirst.Ptr(),
	})
	if err != nil {
		return queueInfo{}, fmt.Errorf("attach to %s: %w", rabbitManagement, err)
	}
	var b [8]byte
	_, _ = rand.Read(b[:])
	id, get, me := hex.EncodeToString(b[:]), "GET", "$me"
	req := &amqp.Message{
		Properties: &amqp.MessageProperties{MessageID: id, To: &address, Subject: &get, ReplyTo: &me},
		Value:      amqp.Null{},
	}
	if err := snd.Send(ctx, req, &amqp.SendOptions{Settled: true}); err != nil {
		return queueInfo{}, fmt.Errorf("send to %s: %w", rabbitManagement, err)
	}
	ans, err := rcv.Receive(ctx, nil)
	if err != nil {
		return queueInfo{}, fmt.Errorf("receive from %s: %w", rabbitManagement, err)
	}
	return parseQueue(ans, id)
}

// parseQueue reads the management node's answer to request id.
func parseQueue(m *amqp.Message, id string) (queueInfo, error) {
	if m.Properties == nil || m.Properties.CorrelationID != id || m.Properties.Subject == nil {
		return queueInfo{}, errNoAnswer
	}
	if code := *m.Properties.Subject; code != "200" {
		return queueInfo{}, fmt.Errorf("the management node answered %s to GET: %v", code, m.Value)
	}
	v, ok := m.Value.(map[string]any)
	if !ok {
		return queueInfo{}, fmt.Errorf("%w: a body of %T", errNoAnswer, m.Value)
	}
	var q queueInfo
	q.typ, _ = v["type"].(string)
	if args, ok := v["arguments"].(map[string]any); ok {
		q.limit = anyInt(args["x-delivery-limit"])
	}
	return q, nil
}

// anyInt returns an AMQP integer of any width as int64, 0 for anything else.
func anyInt(v any) int64 {
	switch n := v.(type) {
	case int8:
		return int64(n)
	case int16:
		return int64(n)
	case int32:
		return int64(n)
	case int64:
		return n
	case uint8:
		return int64(n)
	case uint16:
		return int64(n)
	case uint32:
		return int64(n)
	case uint64:
		if n > 1<<62 {
			return 1 << 62
		}
		return int64(n)
	}
	return 0
}

// address maps a queue name to RabbitMQ 4's v2 address
// /queues/<name>, the name percent-encoded as RFC 3986 says of a path
// segment (everything but the unreserved characters); an address that
// already starts with /queues/ is used as it is.
func address(q string) string {
	if strings.HasPrefix(q, "/queues/") {
		return q
	}
	const hexDigits = "0123456789ABCDEF"
	var b strings.Builder
	b.Grow(len("/queues/") + len(q))
	b.WriteString("/queues/")
	for i := 0; i < len(q); i++ {
		switch c := q[i]; {
		case 'a' <= c && c <= 'z', 'A' <= c && c <= 'Z', '0' <= c && c <= '9', c == '-', c == '.', c == '_', c == '~':
			b.WriteByte(c)
		default:
			b.WriteByte('%')
			b.WriteByte(hexDigits[c>>4])
			b.WriteByte(hexDigits[c&15])
		}
	}
	return b.String()
}
