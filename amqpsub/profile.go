package amqpsub

import (
	"github.com/Azure/go-amqp"

	"github.com/amqpsub/amqpsub/internal/credit"
	"github.com/amqpsub/amqpsub/internal/driver"
)

// Profile holds what differs between brokers on the wire. Use one of
// Artemis, [RabbitMQ4], [RabbitMQ3], [AzureServiceBus] or [Generic].
type Profile struct {
	name string
	// sourceCaps are sent as the source capabilities at attach.
	sourceCaps []string
	// address maps a queue name to the link's source address.
	address func(queue string) string
	// retry is how a Retry outcome is settled.
	retry driver.Outcome
	// creditMode is the pump's credit mode at start.
	creditMode credit.Mode
	// detach says whether the broker answers a link detach; if not, the
	// session is closed instead.
	detach bool
	// rejectCond is the condition of a Reject outcome's error.
	rejectCond amqp.ErrCond
	// peekLock: receiver settle mode second, settlements answered by the
	// broker (sent by settlers), message locks renewed (the lease book),
	// the entity's $management node attached beside the receiver.
	peekLock bool
	// countBase is added to the AMQP delivery-count (the earlier
	// deliveries) to give the count MaxDeliveryCount(n) holds to n: 1 on
	// Service Bus, whose own count (and its clients' DeliveryCount) is
	// that + 1, and whose entity MaxDeliveryCount of n handles the n-th
	// delivery and dead-letters the next; 0 elsewhere, where a
	// delivery-count above n is rejected.
	countBase uint32
	// namedReasons: a dead-letter made before a handler ran (poison)
	// carries a reason code (MaxDeliveryCountExceeded,
	// MaxMessageSizeExceeded) as DeadLetterReason and what happened as
	// DeadLetterErrorDescription, with the profile's condition, the way
	// Service Bus and its clients dead-letter. Otherwise what happened is
	// the reason, and an oversized delivery is rejected with
	// amqp:link:message-size-exceeded.
	namedReasons bool
	// pinsGroups: the broker gives every delivery of a group-id to the
	// consumer that took its first, and stops its dispatch at a group
	// whose consumer has no credit, as Artemis does with message groups.
	// The adaptive credit then holds a group's backlog behind its lane in
	// full (see pipe.go); elsewhere it holds at most the floor of it.
	// Service Bus sessions pin their session to its link whatever this
	// says.
	pinsGroups bool
	// fatal is the default test of FatalErrors under the profile (nil:
	// IsFatal): a broker whose official clients take more as fatal.
	fatal func(error) bool
	// kind makes what the broker's kind adds to the links of a pipe
	// (brokerKind); session is the Service Bus session the pipe asks for.
	kind func(p *pipe, session string) brokerKind
}

// String returns the profile's name.
func (p Profile) String() string { return p.name }

var (
	// Artemis is for Apache ActiveMQ Artemis. The link asks for source
	// capability "queue", so an address names an anycast queue (created if
	// the broker auto-creates queues) rather than a throwaway subscription.
	// Retry is settled as modified{delivery-failed}: Artemis counts it and
	// dead-letters at max-delivery-attempts.
	Artemis = artemis()

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
	RabbitMQ4 = rabbitMQ4()

	// RabbitMQ3 is for RabbitMQ 3.x with the rabbitmq_amqp1_0 plugin. A
	// queue name q is addressed as /amq/queue/q (the queue must exist); a
	// name that already starts with "/" is used as it is. Retry is settled as
	// released, since RabbitMQ 3.10 ends the whole session on modified, so
	// the broker does not count the attempt (and sends delivery-count 0
	// always). Credit is granted in windows, because the broker sends past
	// its credit. The link is never detached (RabbitMQ 3.10 does not answer
	// a detach): the session is closed instead.
	RabbitMQ3 = rabbitMQ3()

	// Generic assumes only the AMQP 1.0 specification: the queue name is the
	// address, [Retry] is modified{delivery-failed}.
	Generic = generic()

	// AzureServiceBus is for Azure Service Bus in peek-lock mode; the
	// [ServiceBus] connector selects it. The queue name is the entity path: a
	// queue, "<topic>/Subscriptions/<subscription>", or either followed by
	// "/$DeadLetterQueue" (an entity of its own: its claims, lock renewals
	// and settlements by lock token go to its own path and its own
	// "<entity>/$DeadLetterQueue/$management" node). Accept completes a message; [Retry] abandons it
	// (modified: Service Bus counts it towards [MaxDeliveryCount] and
	// dead-letters it there); [Release] releases it (the service does not
	// count a release, so the buffered deliveries a stop gives back do not
	// count either; a release sent by lock token, once the delivery's link
	// is gone, goes as an abandon, counted, and is [OutcomeModified] in
	// Stats and OnSettled); [Reject] dead-letters it with DeadLetterReason and
	// DeadLetterErrorDescription. Settlements wait for the service's
	// answer, many at a time, and the lock of every delivery held is
	// renewed ([MaxLockRenewal]).
	AzureServiceBus = azureServiceBus()
)

func azureServiceBus() Profile {
	return Profile{
		name:         "servicebus",
		address:      func(q string) string { return q },
		retry:        driver.Outcome{Kind: driver.Modify},
		creditMode:   credit.Continuous,
		detach:       true,
		rejectCond:   ErrCondDeadLetter,
		peekLock:     true,
		countBase:    1,
		namedReasons: true,
		fatal:        serviceBusFatal,
		kind:         newServiceBusKind,
	}
}

func artemis() Profile {
	return Profile{
		name:       "artemis",
		sourceCaps: []string{"queue"},
		address:    func(q string) string { return q },
		retry:      driver.Outcome{Kind: driver.Modify, DeliveryFailed: true},
		creditMode: credit.Continuous,
		detach:     true,
		rejectCond: RejectCondition,
		pinsGroups: true,
		kind:       plain,
	}
}

func rabbitMQ3() Profile {
	return Profile{
		name:       "rabbitmq3",
		address:    rabbitAddress,
		retry:      driver.Outcome{Kind: driver.Release},
		creditMode: credit.Windowed,
		detach:     false,
		rejectCond: RejectCondition,
		kind:       plain,
	}
}

func rabbitMQ4() Profile {
	return Profile{
		name:       "rabbitmq4",
		address:    rabbit4Address,
		retry:      driver.Outcome{Kind: driver.Modify, DeliveryFailed: true},
		creditMode: credit.Continuous,
		detach:     true,
		rejectCond: RejectCondition,
		// A quorum queue keeps the reason and description (annotations):
		// a code to filter on, as Service Bus gives.
		namedReasons: true,
		kind:         newRabbit4Kind,
	}
}

func generic() Profile {
	// Artemis's settings but for the capability, which other brokers may
	// not know.
	p := artemis()
	p.name, p.sourceCaps = "generic", nil
	return p
}

func rabbitAddress(q string) string {
	if len(q) > 0 && q[0] == '/' {
		return q
	}
	return "/amq/queue/" + q
}

// plain is the kind of every broker but Service Bus.
func plain(p *pipe, _ string) brokerKind { return plainKind{p: p} }

// unhandledReject is the Reject of a delivery dead-lettered before a
// handler ran: reason is the code a profile with namedReasons gives,
// detail what happened, cond the condition elsewhere ("" for the
// profile's).
func (p Profile) unhandledReject(reason, detail string, cond amqp.ErrCond) *OutcomeError {
	if p.namedReasons {
		oe := &OutcomeError{kind: ResultReject, poisoned: true, reason: reason, description: detail}
		if !p.peekLock {
			// Service Bus dead-letters by its own condition; elsewhere
			// the condition says what happened.
			oe.cond = cond
		}
		return oe
	}
	return &OutcomeError{kind: ResultReject, poisoned: true, reason: detail, cond: cond}
}
