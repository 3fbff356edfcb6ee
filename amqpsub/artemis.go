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

// DeadLetterCopy keeps the reason of a [Reject] (and of a [MaxDeliveryCount]
// or [MaxMessageSize] rejection) on brokers that drop it, such as Artemis:
// the subscriber sends a copy of the message to address ("{queue}" stands
// for the queue's name) with application properties DeadLetterReason and
// DeadLetterErrorDescription, waits until the broker has taken it, and then
// accepts the original ([OutcomeAccepted]; see [Delivery.DeadLetterCopied]).
// If the copy cannot be sent, the delivery is rejected as without this
// option ([EventDeadLetterCopyFailed]). An address refused at the first
// attach fails Run (or is waited for, with [WaitForQueue]).
//
// On Artemis, address is "DLQ::DLQ.{queue}" with
// auto-create-dead-letter-resources, "DLQ::DLQ" with the stock broker.xml.
// address must not be empty; New refuses the option for [RabbitMQ4],
// [RabbitMQ3] and Service Bus ([ErrInvalidOption]). Default: off. Why, and
// what a crash between copy and accept risks: docs/options.md#deadlettercopy.
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
