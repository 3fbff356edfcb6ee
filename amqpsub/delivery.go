package amqpsub

import (
	"fmt"
	"sync/atomic"

	"github.com/Azure/go-amqp"

	"github.com/amqpsub/amqpsub/internal/driver"
)

// BodyKind says which AMQP body section a message carries.
type BodyKind uint8

const (
	// BodyEmpty means no body section.
	BodyEmpty BodyKind = iota
	// BodyData means one or more data sections (opaque bytes); Body returns them.
	BodyData
	// BodyValue means an amqp-value section, such as a JMS TextMessage's string
	// or MapMessage's map; Value returns it.
	BodyValue
	// BodySequence means amqp-sequence sections, such as a JMS StreamMessage;
	// Sequence returns them.
	BodySequence
)

var bodyKindNames = [...]string{"empty", "data", "amqp-value", "amqp-sequence"}

func (k BodyKind) String() string {
	if int(k) < len(bodyKindNames) {
		return bodyKindNames[k]
	}
	return fmt.Sprintf("BodyKind(%d)", k)
}

// Delivery is one message given to a handler. It stays valid, and keeps
// describing the same message, after the handler returns: a handler may
// hand it to another goroutine. It is settled by the handler's result
// alone.
type Delivery struct {
	msg  *amqp.Message
	lane int
	t    driver.Ticket                  // settles it; the pump refuses a second settlement
	p    *pipe                          // the pipe it came through
	l    *link                          // the link it came on, when known
	dl   atomic.Pointer[deadLetterNote] // what DeadLetterCopy did, once it did
}

// event returns an Event of kind about d.
func (d *Delivery) event(kind EventKind, err error) Event {
	return Event{Kind: kind, Err: err, MessageID: d.MessageID(), GroupID: d.GroupID(),
		DeliveryCount: d.DeliveryCount(), Lane: d.lane}
}

// Message returns the underlying go-amqp message, for anything [Delivery] does
// not wrap. Settle deliveries through the handler's return value, never
// through go-amqp.
func (d *Delivery) Message() *amqp.Message { return d.msg }

// Lane returns the lane or worker running the handler, from 0.
func (d *Delivery) Lane() int { return d.lane }

// Kind returns which body section the message carries.
func (d *Delivery) Kind() BodyKind { return bodyKind(d.msg) }

func bodyKind(m *amqp.Message) BodyKind {
	switch {
	case len(m.Data) > 0:
		return BodyData
	case m.Value != nil:
		return BodyValue
	case len(m.Sequence) > 0:
		return BodySequence
	}
	return BodyEmpty
}

// Body returns the bytes of the message's data sections, joined when there
// are several. An empty body gives nil, nil. A body of another kind gives an
// error wrapping [ErrBodyKind].
func (d *Delivery) Body() ([]byte, error) { return dataBody(d.msg) }

func dataBody(m *amqp.Message) ([]byte, error) {
	switch k := bodyKind(m); k {
	case BodyData:
		if len(m.Data) == 1 {
			return m.Data[0], nil
		}
		n := 0
		for _, s := range m.Data {
			n += len(s)
		}
		b := make([]byte, 0, n)
		for _, s := range m.Data {
			b = append(b, s...)
		}
		return b, nil
	case BodyEmpty:
		return nil, nil
	default:
		return nil, fmt.Errorf("%w: want data, have %s", ErrBodyKind, k)
	}
}

// Value returns the amqp-value body. A body of another kind gives an error
// wrapping [ErrBodyKind].
func (d *Delivery) Value() (any, error) {
	if k := bodyKind(d.msg); k != BodyValue {
		return nil, fmt.Errorf("%w: want amqp-value, have %s", ErrBodyKind, k)
	}
	return d.msg.Value, nil
}

// Sequence returns the amqp-sequence sections. A body of another kind gives
// an error wrapping [ErrBodyKind].
func (d *Delivery) Sequence() ([][]any, error) {
	if k := bodyKind(d.msg); k != BodySequence {
		return nil, fmt.Errorf("%w: want amqp-sequence, have %s", ErrBodyKind, k)
	}
	return d.msg.Sequence, nil
}

// GroupID returns the AMQP group-id, the key [WorkersByKey] orders by; "" when
// the message has none.
func (d *Delivery) GroupID() string { return groupID(d.msg) }

func groupID(m *amqp.Message) string {
	if m.Properties == nil || m.Properties.GroupID == nil {
		return ""
	}
	return *m.Properties.GroupID
}

// GroupSequence returns the AMQP group-sequence and whether it was set.
func (d *Delivery) GroupSequence() (uint32, bool) {
	if p := d.msg.Properties; p != nil && p.GroupSequence != nil {
		return *p.GroupSequence, true
	}
	return 0, false
}

// MessageID returns the AMQP message-id: a string, uint64, UUID or []byte,
// or nil when unset.
func (d *Delivery) MessageID() any {
	if p := d.msg.Properties; p != nil {
		return p.MessageID
	}
	return nil
}

// ContentType returns the AMQP content-type, "" when unset.
func (d *Delivery) ContentType() string {
	if p := d.msg.Properties; p != nil && p.ContentType != nil {
		return *p.ContentType
	}
	return ""
}

// DeliveryCount returns the AMQP header's delivery-count, on every broker:
// the broker's count of earlier attempts to deliver the message, 0 on the
// first delivery.
//
//   - Artemis counts deliveries that failed (modified{delivery-failed},
//     amqpsub's [Retry]); a release does not count.
//   - RabbitMQ 3.10 always sends 0; see FirstAcquirer.
//   - On Service Bus it is one less than the DeliveryCount the service and
//     its clients report (azservicebus's message.go and .NET's
//     ServiceBusReceivedMessage add 1 to the header's count): 0 here is
//     DeliveryCount 1 there. An abandon (Retry) and an expired lock count.
//     See [MaxDeliveryCount] for how the two line up.
func (d *Delivery) DeliveryCount() uint32 {
	if h := d.msg.Header; h != nil {
		return h.DeliveryCount
	}
	return 0
}

// FirstAcquirer returns the AMQP header's first-acquirer flag; false when
// the message has no header, the AMQP default. RabbitMQ 3.10 sets it false
// on a redelivery; Artemis passes on whatever the producer set (go-amqp
// sends false), so on Artemis it says nothing about redelivery.
func (d *Delivery) FirstAcquirer() bool {
	if h := d.msg.Header; h != nil {
		return h.FirstAcquirer
	}
	return false
}

// ApplicationProperties returns the message's application properties; nil
// when it has none. The map belongs to the message: do not modify it.
func (d *Delivery) ApplicationProperties() map[string]any { return d.msg.ApplicationProperties }

// Annotation returns the message annotation named key (such as
// "x-opt-jms-msg-type") and whether it is present. Annotation keys are AMQP
// symbols: go-amqp decodes them as strings, but a message built in Go may
// hold an [amqp.Symbol] key, which is found too.
func (d *Delivery) Annotation(key string) (any, bool) { return annotation(d.msg, key) }

func annotation(m *amqp.Message, key string) (any, bool) {
	if v, ok := m.Annotations[key]; ok {
		return v, true
	}
	v, ok := m.Annotations[amqp.Symbol(key)]
	return v, ok
}

// OnSettled asks for f to be called once the delivery's settlement has been
// applied: with the outcome sent, and nil when the broker took it,
// [ErrNotSettled] when it was not sent, or the broker's or link's error.
// Tracing uses it for a settle span per delivery.
//
// Call it from the handler, before it returns; a later call replaces f. f
// runs on the subscriber's receiving goroutine and must return at once,
// without blocking.
//
// f is not called when the subscriber stops before the settlement was
// applied (an abandoned handler, a stop with GracePeriod(0)). OnSettled
// reports false, never calling f, when called after the delivery's
// settlement was handed over (from a goroutine the handler left behind).
func (d *Delivery) OnSettled(f func(o Outcome, err error)) bool {
	if f == nil || d.t.Entry() == nil {
		return false
	}
	return d.t.OnSettled(func(k driver.Kind, err error) {
		if o, ok := outcomeOf(k); ok {
			f(o, err)
		}
	})
}
