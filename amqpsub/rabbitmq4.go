package amqpsub

import "github.com/amqpsub/amqpsub/internal/driver/rabbitmq4"

// RabbitMQ4 is for RabbitMQ 4.x, whose AMQP 1.0 is native. A queue
// name q is addressed as /queues/q, q percent-encoded (RFC 3986); a
// name that already starts with /queues/ is used as it is. The queue
// must exist: attaching to a missing one fails with amqp:not-found
// (see [WaitForQueue]). Retry is settled as modified{delivery-failed}.
//
// At each attach the subscriber asks the broker's management node for
// the queue's type, since what a return costs depends on it:
//
//   - A quorum queue counts every return of a delivery toward its
//     delivery-limit (20 by default), a release included, and
//     dead-letters past the limit. So a graceful stop takes the credit
//     back and finishes what is buffered, for up to half the
//     [GracePeriod] (GracePeriod(0) skips it), before it releases what
//     is left; [Release] counts there too. A [Reject] is settled as modified{delivery-failed,
//     undeliverable-here} with the reason in the message annotations
//     [AnnotationDeadLetterReason], [AnnotationDeadLetterDescription]
//     and [AnnotationDeadLetterCondition], which the dead letter keeps.
//     [MaxDeliveryCount] reads the header's delivery-count, which counts
//     the Retry attempts (modified{delivery-failed}) but not releases.
//   - A classic queue counts nothing: its delivery-count stays 0 and it
//     has no delivery limit, so a message that always fails is retried
//     for ever. [MaxDeliveryCount] is refused there (Run fails with
//     [ErrInvalidOption]). A message whose handler always fails comes
//     back for ever, and holds its lane (and, under [WorkersByKey], the
//     groups behind it, with the credit they take) while it does: use
//     a quorum queue, or count the attempts in the handler (by
//     message-id, in the process) and [Reject]. [LocalRetry] bounds the
//     retries of one delivery in its lane, not the deliveries. A Reject
//     is settled as rejected, which dead-letters (with a dead-letter
//     exchange) but keeps no reason.
//
// If the management node cannot be read, the queue is treated as a
// quorum queue but for Reject, which is settled as rejected.
var RabbitMQ4 = newProfile(rabbitmq4.New(RejectCondition))

func init() { known = append(known, RabbitMQ4) }

// The annotations a Reject on a quorum queue puts on the dead letter.
// RabbitMQ takes only keys that start with "x-": any other ends the session.
const (
	// AnnotationDeadLetterReason holds a Reject's reason on a dead letter
	// of a RabbitMQ 4 quorum queue.
	AnnotationDeadLetterReason = rabbitmq4.AnnotationReason
	// AnnotationDeadLetterDescription holds RejectWith's description.
	AnnotationDeadLetterDescription = rabbitmq4.AnnotationDescription
	// AnnotationDeadLetterCondition holds the rejection's AMQP error
	// condition ([RejectCondition], or MaxMessageSize's).
	AnnotationDeadLetterCondition = rabbitmq4.AnnotationCondition
)
