package amqpsub

import (
	"errors"
	"fmt"

	"github.com/Azure/go-amqp"
)

// outcomeKind is what a handler decided.
type outcomeKind uint8

const (
	outcomeAccept outcomeKind = iota
	outcomeRelease
	outcomeRetry
	outcomeReject
)

var outcomeNames = [...]string{"accept", "release", "retry", "reject"}

// OutcomeError is the error a handler returns to choose how a delivery is
// settled other than by accepting it. Make one with Release, Retry or
// Reject; it may be wrapped (errors.As finds it). A nil *OutcomeError
// returned as a (non-nil) error, or a zero OutcomeError, means Retry.
type OutcomeError struct {
	kind        outcomeKind
	reason      string
	description string
	err         error
	poisoned    bool         // a Reject of MaxDeliveryCount's or MaxMessageSize's, not a handler's
	cond        amqp.ErrCond // the rejection's condition, when not the profile's
}

// condMessageSizeExceeded is the condition of MaxMessageSize's rejections.
const condMessageSizeExceeded = amqp.ErrCondMessageSizeExceeded

func (e *OutcomeError) Error() string {
	switch {
	case e == nil || e.kind == outcomeAccept:
		return "amqpsub: retry: an OutcomeError not made by Release, Retry or Reject"
	case e.err != nil:
		return fmt.Sprintf("amqpsub: %s: %v", outcomeNames[e.kind], e.err)
	case e.reason != "":
		return fmt.Sprintf("amqpsub: %s: %s", outcomeNames[e.kind], e.reason)
	}
	return "amqpsub: " + outcomeNames[e.kind]
}

// Unwrap returns the error given to Retry.
func (e *OutcomeError) Unwrap() error {
	if e == nil {
		return nil
	}
	return e.err
}

var releaseOutcome = &OutcomeError{kind: outcomeRelease}

// Release returns the delivery to the queue untouched: the broker does not
// count it as a failed attempt, so it is never dead-lettered for it.
func Release() error { return releaseOutcome }

// Retry returns the delivery to the queue as a failed attempt: on Artemis it
// is settled as modified{delivery-failed}, so the broker's delivery count
// goes up and the delivery is dead-lettered after max-delivery-attempts.
// Under the RabbitMQ3 profile it is released, since RabbitMQ 3.10 ends the
// session on modified. Any error a handler returns that is not an
// OutcomeError means Retry; Retry(err) just says so explicitly. err may be
// nil. Retry of an error that is already a Retry returns it unchanged.
func Retry(err error) error {
	if o, ok := err.(*OutcomeError); ok && o != nil && o.kind == outcomeRetry {
		return o
	}
	return &OutcomeError{kind: outcomeRetry, err: err}
}

// Reject dead-letters the delivery at once, with reason: it is settled as
// rejected, with an error whose description is reason (and info
// DeadLetterReason = reason, the key Service Bus reads). Artemis moves it
// to the queue's dead-letter address (without one it is dropped) but keeps
// no trace of the reason; see DeadLetterCopy for a way to keep it.
func Reject(reason string) error { return &OutcomeError{kind: outcomeReject, reason: reason} }

// RejectWith is Reject with a longer description besides the reason (info
// DeadLetterErrorDescription, as Service Bus names it).
func RejectWith(reason, description string) error {
	return &OutcomeError{kind: outcomeReject, reason: reason, description: description}
}

// rejectError is the AMQP error a Reject outcome carries, with condition
// cond (the profile's).
func (e *OutcomeError) rejectError(cond amqp.ErrCond) *amqp.Error {
	info := map[string]any{"DeadLetterReason": e.reason}
	if e.description != "" {
		info["DeadLetterErrorDescription"] = e.description
	}
	return &amqp.Error{Condition: cond, Description: e.reason, Info: info}
}

// decide maps a handler's error to an outcome.
func decide(err error) (outcomeKind, *OutcomeError) {
	if err == nil {
		return outcomeAccept, nil
	}
	// A nil *OutcomeError returned as an error, or one not made by
	// Release, Retry or Reject (its zero kind), is a non-nil error like
	// any other: Retry.
	var oe *OutcomeError
	if errors.As(err, &oe) && oe != nil && oe.kind != outcomeAccept {
		return oe.kind, oe
	}
	return outcomeRetry, nil
}
