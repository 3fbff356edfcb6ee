package amqpsub

import (
	"fmt"

	"github.com/Azure/go-amqp"

	"github.com/amqpsub/amqpsub/internal/driver"
)

// OutcomeError is the error a handler returns to choose how a delivery is
// settled other than by accepting it. Make one with [Release], [Retry] or
// [Reject]; it may be wrapped ([errors.As] finds it). A nil *OutcomeError
// returned as a (non-nil) error, or a zero OutcomeError, means Retry.
type OutcomeError struct {
	kind        Result
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
	case e == nil || e.kind == ResultAccept:
		return "amqpsub: retry: an OutcomeError not made by Release, Retry or Reject"
	case e.err != nil:
		return fmt.Sprintf("amqpsub: %s: %v", e.kind, e.err)
	case e.reason != "":
		return fmt.Sprintf("amqpsub: %s: %s", e.kind, e.reason)
	}
	return "amqpsub: " + e.kind.String()
}

// Unwrap returns the error given to [Retry].
func (e *OutcomeError) Unwrap() error {
	if e == nil {
		return nil
	}
	return e.err
}

var releaseOutcome = &OutcomeError{kind: ResultRelease}

// Release returns the delivery to the queue untouched: the broker does not
// count it as a failed attempt, so it is never dead-lettered for it; but a
// RabbitMQ 4 quorum queue counts every return toward its delivery-limit,
// a release too (see [RabbitMQ4]).
func Release() error { return releaseOutcome }

// Retry returns the delivery to the queue as a failed attempt: on Artemis it
// is settled as modified{delivery-failed}, so the broker's delivery count
// goes up and the delivery is dead-lettered after max-delivery-attempts.
// Under the [RabbitMQ3] profile it is released, since RabbitMQ 3.10 ends the
// session on modified. A RabbitMQ 4 classic queue counts nothing (see
// [RabbitMQ4]). Any error a handler returns that is not an
// [OutcomeError] means Retry; Retry(err) just says so explicitly. err may be
// nil. Retry of an error that is already a Retry returns it unchanged.
func Retry(err error) error {
	if o, ok := err.(*OutcomeError); ok && o != nil && o.kind == ResultRetry {
		return o
	}
	return &OutcomeError{kind: ResultRetry, err: err}
}

// Reject dead-letters the delivery at once, with reason: it is settled as
// rejected, with an error whose description is reason (and info
// DeadLetterReason = reason, the key Service Bus reads). Artemis moves it
// to the queue's dead-letter address (without one it is dropped) but keeps
// no trace of the reason; see [DeadLetterCopy] for a way to keep it. On a
// RabbitMQ 4 quorum queue the dead letter keeps it (see [RabbitMQ4]). On
// Service Bus, a reader of the dead-letter queue ("<queue>/$DeadLetterQueue")
// finds it in the dead letter's ApplicationProperties()["DeadLetterReason"]
// (and the description in "DeadLetterErrorDescription").
func Reject(reason string) error { return &OutcomeError{kind: ResultReject, reason: reason} }

// RejectWith is [Reject] with a longer description besides the reason (info
// DeadLetterErrorDescription, as Service Bus names it).
func RejectWith(reason, description string) error {
	return &OutcomeError{kind: ResultReject, reason: reason, description: description}
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

// Result is what a handler decided for a delivery.
type Result uint8

var resultNames = [...]string{"accept", "release", "reject", "retry"}

// String returns "accept", "release", "reject" or "retry".
func (r Result) String() string {
	if int(r) < len(resultNames) {
		return resultNames[r]
	}
	return "Result(?)"
}

// ResultOf returns what a handler's error means: see [Handler].
func ResultOf(err error) Result {
	r, _ := decide(err)
	return r
}

// mostSevere orders results for a batch's HandlerCall.Result.
func mostSevere(a, b Result) Result {
	rank := [...]int{ResultAccept: 0, ResultRelease: 1, ResultReject: 2, ResultRetry: 3}
	if rank[b] > rank[a] {
		return b
	}
	return a
}

const (
	// ResultAccept is a nil error: the delivery was handled.
	ResultAccept Result = iota
	// ResultRelease is Release().
	ResultRelease
	// ResultReject is [Reject], [RejectWith], or a delivery past
	// [MaxDeliveryCount] or [MaxMessageSize].
	ResultReject
	// ResultRetry is Retry(err), any other error, or a panic.
	ResultRetry
)

// RejectCondition is the AMQP error condition sent with a [Reject] outcome;
// its description is the reason given to Reject.
const RejectCondition amqp.ErrCond = "amqpsub:rejected"

// Outcome is the settlement a delivery was given on the wire.
type Outcome uint8

const (
	// OutcomeAccepted settles as accepted: handled (or, with
	// [DeadLetterCopy], rejected and copied).
	OutcomeAccepted Outcome = iota
	// OutcomeReleased settles as released: Release, a stop, or [Retry] under
	// [RabbitMQ3] (on Service Bus, on the delivery's link only: see
	// OutcomeModified).
	OutcomeReleased
	// OutcomeModified settles as modified: Retry on Artemis, [Generic],
	// [RabbitMQ4] and Service Bus (an abandon); a release on Service Bus
	// sent by lock token once its link is gone, which goes as an abandon
	// (counted towards MaxDeliveryCount); and on a RabbitMQ 4 quorum
	// queue also Reject, [MaxDeliveryCount] and [MaxMessageSize], which
	// dead-letter there as modified{undeliverable-here} (count dead letters
	// by the handler's Result, or Stats().Results, on that broker).
	OutcomeModified
	// OutcomeRejected settles as rejected: Reject, [MaxDeliveryCount],
	// [MaxMessageSize] (a dead-lettering on Service Bus; on a RabbitMQ 4
	// quorum queue, modified: see OutcomeModified).
	OutcomeRejected
)

var wireOutcomeNames = [...]string{"accepted", "released", "modified", "rejected"}

// String returns "accepted", "released", "modified" or "rejected".
func (o Outcome) String() string {
	if int(o) < len(wireOutcomeNames) {
		return wireOutcomeNames[o]
	}
	return "Outcome(?)"
}

var outcomeOfKind = [...]Outcome{driver.Accept: OutcomeAccepted, driver.Release: OutcomeReleased,
	driver.Modify: OutcomeModified, driver.Reject: OutcomeRejected}

func outcomeOf(k driver.Kind) (Outcome, bool) {
	if int(k) < len(outcomeOfKind) {
		return outcomeOfKind[k], true
	}
	return 0, false
}
