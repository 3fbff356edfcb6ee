package amqpotel

import (
	"context"
	"errors"

	"github.com/Azure/go-amqp"
	"go.opentelemetry.io/otel/attribute"

	"github.com/amqpsub/amqpsub/amqpsub"
)

// Attribute keys of amqpsub's own, for what the messaging conventions lack.
const (
	// OutcomeKey is the settlement's outcome on the wire: "accepted",
	// "released", "modified" or "rejected" (amqpsub.Outcome).
	OutcomeKey = attribute.Key("amqpsub.outcome")
	// ResultKey is what a handler decided: "accept", "release", "reject" or
	// "retry" (amqpsub.Result).
	ResultKey = attribute.Key("amqpsub.result")
	// EventKey is an amqpsub.EventKind's name, such as "link-lost".
	EventKey = attribute.Key("amqpsub.event")
	// LaneKey is the lane (or worker) index, from 0.
	LaneKey = attribute.Key("amqpsub.lane")
	// DeliveryCountKey is the AMQP header's delivery-count: the broker's
	// count of earlier failed deliveries of the message.
	DeliveryCountKey = attribute.Key("amqpsub.delivery_count")
	// DeadLetterAddressKey is the address amqpsub.DeadLetterCopy sent a
	// rejected delivery's copy to, on its settle span.
	DeadLetterAddressKey = attribute.Key("amqpsub.dead_letter.address")
)

// OperationDeadLetterCopy is the messaging.operation.name, and the first
// word of the settle span's name, of a rejection that
// amqpsub.DeadLetterCopy copied to its dead-letter address and then settled
// as accepted.
const OperationDeadLetterCopy = "dead_letter_copy"

// The error.type values this package sets, besides an AMQP error's
// condition (such as "amqp:link:detach-forced") for a settlement the broker
// refused or a link that failed under it (see the README).
const (
	// ErrorTypePanic is a handler call that panicked.
	ErrorTypePanic = "panic"
	// ErrorTypeNotSettled is a settlement that was not sent: the
	// delivery's link, or its lock, was lost while a handler had it
	// (amqpsub.ErrNotSettled).
	ErrorTypeNotSettled = "not_settled"
	// ErrorTypeOther is any other error, as the conventions say.
	ErrorTypeOther = "_OTHER"
)

// settleOp returns the messaging.operation.name of a settlement with
// outcome o on system: Service Bus's names on "servicebus" (an AMQP
// released is what Service Bus counts as neither: the message is
// unlocked, its delivery count unchanged), the AMQP outcome's verb
// elsewhere.
func settleOp(system string, o amqpsub.Outcome) string {
	if system == "servicebus" {
		switch o {
		case amqpsub.OutcomeAccepted:
			return "complete"
		case amqpsub.OutcomeModified:
			return "abandon"
		case amqpsub.OutcomeRejected:
			return "dead_letter"
		case amqpsub.OutcomeReleased:
			return "release"
		}
		return "settle"
	}
	switch o {
	case amqpsub.OutcomeAccepted:
		return "accept"
	case amqpsub.OutcomeReleased:
		return "release"
	case amqpsub.OutcomeModified:
		return "modify"
	case amqpsub.OutcomeRejected:
		return "reject"
	}
	return "settle"
}

// dispositionStatus returns Service Bus's messaging.servicebus.
// disposition_status for op, or "" for an op the conventions do not name.
func dispositionStatus(op string) string {
	switch op {
	case "complete", "abandon", "dead_letter":
		return op
	}
	return ""
}

// settleErrorType returns the error.type of a settlement that failed
// with err (not nil): ErrorTypeNotSettled, the AMQP condition the broker
// gave, "link_closed", "session_closed" or "connection_closed" for one
// that closed without a condition, "timeout" or "canceled" for a context, else
// ErrorTypeOther. The values are few, as error.type's must be.
func settleErrorType(err error) string {
	var ae *amqp.Error
	var le *amqp.LinkError
	var se *amqp.SessionError
	var ce *amqp.ConnError
	switch {
	case errors.Is(err, amqpsub.ErrNotSettled):
		return ErrorTypeNotSettled
	case errors.As(err, &ae) && ae.Condition != "":
		return string(ae.Condition)
	case errors.As(err, &le):
		return "link_closed"
	case errors.As(err, &se):
		return "session_closed"
	case errors.As(err, &ce):
		return "connection_closed"
	case errors.Is(err, context.DeadlineExceeded):
		return "timeout"
	case errors.Is(err, context.Canceled):
		return "canceled"
	}
	return ErrorTypeOther
}

// processErrorType returns the error.type of a handler call: "" for one
// that did not fail (accept, release), the result's name ("retry",
// "reject") for one that did, ErrorTypePanic for a panic.
func processErrorType(r amqpsub.Result, panicked bool) string {
	switch {
	case panicked:
		return ErrorTypePanic
	case r == amqpsub.ResultRetry || r == amqpsub.ResultReject:
		return r.String()
	}
	return ""
}
