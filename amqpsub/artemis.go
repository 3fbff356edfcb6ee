package amqpsub

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"

	"github.com/Azure/go-amqp"
	"github.com/cespare/xxhash/v2"

	"github.com/amqpsub/amqpsub/internal/driver/artemis"
)

// Artemis is for Apache ActiveMQ Artemis. The link asks for source
// capability "queue", so an address names an anycast queue (created if
// the broker auto-creates queues) rather than a throwaway subscription.
// Retry is settled as modified{delivery-failed}: Artemis counts it and
// dead-letters at max-delivery-attempts.
var Artemis = newProfile(artemis.New(RejectCondition))

func init() { known = append(known, Artemis) }

// DeadLetterCopy makes a [Reject] (and a [MaxDeliveryCount] or [MaxMessageSize]
// rejection: the copy then carries the whole oversized body back) keep its
// reason on brokers that drop it, such as Artemis: instead of settling the
// delivery as rejected, the subscriber sends a copy of the message to
// address, with application properties DeadLetterReason and
// DeadLetterErrorDescription, waits until the broker has taken the copy,
// and then accepts the original. If the copy cannot be sent, the delivery
// is rejected as without this option, and the broker dead-letters it
// without the reason; that is logged, reported as
// [EventDeadLetterCopyFailed] and counted in
// [Stats.DeadLetterCopyFailures]. "{queue}" in address stands for the
// queue's name.
//
// The subscriber attaches its sender to address as it first attaches to
// the queue, before any delivery: an address the broker refuses (a
// dead-letter queue that does not exist) fails that first attach as a
// missing queue does, so Run returns the broker's amqp:not-found at once
// (or, with [WaitForQueue], waits until the address exists) instead of
// losing the reasons of the first rejections. At a reconnect a refusal is
// logged and the subscriber goes on; each copy then tries the address
// again. A copy can still fail later: the queue deleted under a running
// subscriber (the broker refuses each copy), or the connection lost during
// the copy (the delivery is then not settled at all, and comes back).
//
// On Artemis, attaching to the address creates the queue if the broker
// auto-creates queues there (auto-create-queues, on for every address in
// the stock broker.xml): with auto-create-dead-letter-resources and no
// address setting that turns auto-creation off for DLQ.#, the attach
// makes DLQ.{queue} without the filter the broker itself would give it,
// and it then takes a share of other queues' dead letters. Turn
// auto-creation off for the dead-letter addresses (as
// integration/artemis/broker.xml does), or create the queue ahead with its
// filter.
//
// A copied rejection settles as accepted on the wire, and a [Recorder] and
// [Delivery.OnSettled] hear [OutcomeAccepted]: each copy is reported as
// [EventDeadLetterCopied] and counted in [Stats.DeadLetterCopies], and
// [Delivery.DeadLetterCopied] tells it apart once settled. The contrib
// adapters count copies and failures, and name the settle span of a copy
// "dead_letter_copy".
//
// On Artemis, address is the fully qualified name (address::queue) of the
// queue's dead-letter queue: "DLQ::DLQ.{queue}" with
// auto-create-dead-letter-resources (as in integration/artemis/broker.xml),
// "DLQ::DLQ" with the stock broker.xml. The stock broker has that queue
// from the start. With auto-creation the broker makes DLQ.{queue} only at
// its own first dead letter, so the subscriber's attach would fail until
// then: create the queue ahead (docs/brokers.md has the recipe; in tests,
// artemistest.WithDeadLetterQueues declares it).
//
// The copy carries what Artemis itself adds to a dead letter
// (_AMQ_ORIG_ADDRESS, _AMQ_ORIG_QUEUE, and the annotations
// x-opt-ORIG-ADDRESS and x-opt-ORIG-QUEUE), which the auto-created queue's
// filter and the broker's retry-from-DLQ operations need, and loses its
// time-to-live.
//
// It carries a duplicate-detection id (_AMQ_DUPL_ID) made of the
// message-id and a hash of the body (and of an earlier copy's id, for a
// message retried from the dead-letter queue), so a copy sent twice (the
// original redelivered after a crash between the two steps) is stored
// once, while messages that merely share a message-id each keep theirs.
// But two messages with the same message-id and the same body (a producer
// that sent one message twice) make the same id: Artemis stores the second
// copy as a duplicate, that is not at all, and the original is accepted,
// so the second is in neither queue ([Stats.DeadLetterCopies] counts it
// all the same). Producers that may send a message twice should give each
// send a message-id of its own. A message without a message-id gets no
// such id: after such a crash its copy may be stored twice.
//
// The two steps are not one transaction: go-amqp has no AMQP
// transactions. New refuses it, with an error wrapping
// [ErrInvalidOption], for the [RabbitMQ4] and [RabbitMQ3] profiles
// (RabbitMQ dead-letters through the queue's dead-letter exchange, and has
// no duplicate detection to make the copy safe; a RabbitMQ 4 quorum queue
// keeps the reason: see RabbitMQ4) and for Service Bus, which keeps the
// reason itself. Default: off.
func DeadLetterCopy(address string) Option {
	return optionFunc(func(c *config) {
		if address == "" {
			c.invalid("DeadLetterCopy(\"\"): the address is empty")
			return
		}
		c.deadLetterCopy = address
	})
}

// deadLetterAddress is DeadLetterCopy's address for the subscriber's queue.
func (s *Subscriber) deadLetterAddress() string {
	return strings.ReplaceAll(s.cfg.deadLetterCopy, "{queue}", s.queue)
}

// deadLetterSender attaches a sender to DeadLetterCopy's address on sess.
func (s *Subscriber) deadLetterSender(ctx context.Context, sess *amqp.Session) (*amqp.Sender, error) {
	addr := s.deadLetterAddress()
	snd, err := sess.NewSender(ctx, addr, &amqp.SenderOptions{TargetCapabilities: s.cfg.profile.f.SourceCaps})
	if err != nil {
		return nil, fmt.Errorf("attach to dead-letter address %q: %w", addr, err)
	}
	return snd, nil
}

// deadLetterNote is what DeadLetterCopy did with one delivery
// ([Delivery.DeadLetterCopied]).
type deadLetterNote struct {
	address string
	err     error // nil: the broker took the copy
}

// DeadLetterCopied reports what [DeadLetterCopy] did with a rejected
// delivery: address is the dead-letter address it sent the copy to, and
// err is nil when the broker took the copy (the delivery is then settled
// as accepted) or why it did not (the delivery is then rejected without
// its reason, as [EventDeadLetterCopyFailed] reports). address is "" when
// no copy was sent: the option is off, the delivery was not rejected, its
// lock or link was lost first, or its settlement is not yet decided. It
// is decided after the handler returns and before the settlement is
// applied, so the function given to [Delivery.OnSettled] can tell an
// accepted copy from a handled delivery with it, as the contrib adapters
// do; read elsewhere (a goroutine of the handler's), it may not be
// decided yet.
func (d *Delivery) DeadLetterCopied() (address string, err error) {
	if n := d.dl.Load(); n != nil {
		return n.address, n.err
	}
	return "", nil
}

// deadLetterSender is the sender of DeadLetterCopy's copies on one link's
// session, attached when the first copy is sent.
type deadLetterSender struct {
	mu  sync.Mutex
	snd *amqp.Sender
}

// errNoDeadLetterLink: d has no live broker link to send its copy on (a
// test source, or its link is gone and its settlement will be skipped).
var errNoDeadLetterLink = errors.New("no link")

// copyToDeadLetter sends d's copy with oe's reason to the dead-letter
// address, on the session of the link d came on. An error means it was not
// sent: settle d as rejected.
func (s *Subscriber) copyToDeadLetter(d *Delivery, oe *OutcomeError) error {
	l := d.l
	if l == nil || l.sess == nil || d.t.Stale() {
		return errNoDeadLetterLink
	}
	addr := s.deadLetterAddress()
	// Bound by DialTimeout, and cut short with the handlers at the end of
	// a stop.
	ctx, cancel := context.WithTimeout(s.hctx, s.cfg.dialTimeout)
	defer cancel()
	l.dlq.mu.Lock()
	snd := l.dlq.snd
	if snd == nil {
		// The one attached with the link was lost: attach another.
		var err error
		if snd, err = s.deadLetterSender(ctx, l.sess); err != nil {
			l.dlq.mu.Unlock()
			return err
		}
		l.dlq.snd = snd
	}
	l.dlq.mu.Unlock()
	if err := snd.Send(ctx, deadLetterCopy(d.msg, s.cfg.profile.drv.Address(s.queue), s.queue, oe), nil); err != nil {
		var le *amqp.LinkError
		if errors.As(err, &le) {
			// The sender is gone: attach a new one for the next copy.
			l.dlq.mu.Lock()
			if l.dlq.snd == snd {
				l.dlq.snd = nil
			}
			l.dlq.mu.Unlock()
		}
		return fmt.Errorf("send to dead-letter address %q: %w", addr, err)
	}
	return nil
}

// deadLetterCopy returns a copy of m for the dead-letter queue of queue
// (at address), with the reason of oe.
func deadLetterCopy(m *amqp.Message, address, queue string, oe *OutcomeError) *amqp.Message {
	c := &amqp.Message{
		Format:   m.Format,
		Data:     m.Data,
		Value:    m.Value,
		Sequence: m.Sequence,
		Footer:   m.Footer,
	}
	if m.Header != nil {
		h := *m.Header
		h.TTL = 0
		c.Header = &h
	}
	if m.Properties != nil {
		p := *m.Properties
		p.AbsoluteExpiryTime = nil
		c.Properties = &p
	}
	c.Annotations = amqp.Annotations{}
	for k, v := range m.Annotations {
		c.Annotations[k] = v
	}
	c.Annotations["x-opt-ORIG-ADDRESS"] = address
	c.Annotations["x-opt-ORIG-QUEUE"] = queue
	c.ApplicationProperties = make(map[string]any, len(m.ApplicationProperties)+5)
	for k, v := range m.ApplicationProperties {
		c.ApplicationProperties[k] = v
	}
	c.ApplicationProperties["_AMQ_ORIG_ADDRESS"] = address
	c.ApplicationProperties["_AMQ_ORIG_QUEUE"] = queue
	c.ApplicationProperties["DeadLetterReason"] = oe.reason
	if oe.description != "" {
		c.ApplicationProperties["DeadLetterErrorDescription"] = oe.description
	}
	if m.Properties != nil && m.Properties.MessageID != nil {
		c.ApplicationProperties["_AMQ_DUPL_ID"] = deadLetterID(m, address)
	}
	return c
}

// deadLetterID is the duplicate-detection id of m's dead-letter copy: the
// same for every delivery of m (so a copy sent again after a crash between
// the copy and the accept is stored once), and different for any other
// message.
//
// It names the message-id and hashes the body, so that two messages that
// share a message-id (producers reuse them) both keep their copy; and it
// hashes the id of an earlier copy of m and Artemis's
// x-opt-ORIG-MESSAGE-ID, which a message retried from the dead-letter queue
// carries, so that its second copy is not taken for its first.
func deadLetterID(m *amqp.Message, address string) string {
	h := xxhash.New()
	for _, d := range m.Data {
		_, _ = h.Write(d) // an xxhash Digest never fails to write
		_, _ = h.Write([]byte{0})
	}
	if m.Value != nil {
		_, _ = fmt.Fprintf(h, "v%#v", m.Value)
	}
	for _, seq := range m.Sequence {
		_, _ = fmt.Fprintf(h, "s%#v", seq)
	}
	if prev, ok := m.ApplicationProperties["_AMQ_DUPL_ID"]; ok {
		_, _ = fmt.Fprintf(h, "p%v", prev)
	}
	if orig, ok := annotation(m, "x-opt-ORIG-MESSAGE-ID"); ok {
		_, _ = fmt.Fprintf(h, "o%v", orig)
	}
	return fmt.Sprintf("amqpsub-dlq:%s:%v:%016x", address, m.Properties.MessageID, h.Sum64())
}
