package amqpsub

import (
	"fmt"

	"github.com/amqpsub/amqpsub/internal/pump"
)

// poison rejects, before a handler sees it, a delivery larger than
// MaxMessageSize or delivered more often than MaxDeliveryCount allows, and
// returns the Reject (nil for a delivery to handle). How it counts and what
// the Reject carries are the profile's (its driver's Facts, CountBase and
// NamedReasons): Service Bus counts from 1 and names its reasons.
func (s *Subscriber) poison(d *Delivery) error {
	if s.cfg.maxMessageSize > 0 {
		if size := pump.Size(d.msg); size > s.cfg.maxMessageSize {
			s.results.oversize.Add(1)
			detail := fmt.Sprintf("amqpsub: message body of %d bytes is past the limit of %d", size, s.cfg.maxMessageSize)
			err := s.cfg.profile.unhandledReject(reasonMessageSizeExceeded, detail, condMessageSizeExceeded)
			s.limited.Warn("message larger than MaxMessageSize; dead-lettering it unhandled", s.fields(d, err)...)
			s.events.send(s.event(d, EventOversize, err))
			return err
		}
	}
	limit := s.cfg.maxDelivery
	n := uint64(d.DeliveryCount()) + uint64(s.cfg.profile.f.CountBase)
	if limit == 0 || n <= uint64(limit) {
		return nil
	}
	s.results.poisoned.Add(1)
	detail := fmt.Sprintf("amqpsub: delivery count %d is past the limit %d", d.DeliveryCount(), limit)
	if s.cfg.profile.f.NamedReasons {
		// The delivery's number: the earlier deliveries (the header's
		// count) and this one.
		detail = fmt.Sprintf("amqpsub: delivery %d is past MaxDeliveryCount %d", uint64(d.DeliveryCount())+1, limit)
	}
	err := s.cfg.profile.unhandledReject(reasonMaxDeliveryCountExceeded, detail, "")
	s.limited.Warn("delivery count past MaxDeliveryCount; dead-lettering it unhandled", s.fields(d, err)...)
	s.events.send(s.event(d, EventPoisoned, err))
	return err
}

// The DeadLetterReasons of poison's dead-letters on Service Bus. The first
// is the reason the service itself gives at an entity's MaxDeliveryCount.
const (
	reasonMaxDeliveryCountExceeded = "MaxDeliveryCountExceeded"
	reasonMessageSizeExceeded      = "MaxMessageSizeExceeded"
)
