package amqpsubtest

import "github.com/amqpsub/amqpsub/amqpsub"

// rules are what a broker does that the queue plays: one set per profile.
type rules struct {
	// counts: modified{delivery-failed} raises the delivery count, which
	// the header carries, and MaxDeliveryAttempts dead-letters on it.
	// Without it the header's delivery-count is always 0.
	counts bool
	// groups: the messages of a group-id go to one link at a time, the
	// first one a message of the group went to, until it ends (Artemis
	// message groups).
	groups bool
	// firstAcquirer: the header's first-acquirer says whether this is the
	// message's first delivery. Without it, it is the producer's.
	firstAcquirer bool
	// modifyEndsSession: a modified outcome ends the link's session with
	// amqp:invalid-field (RabbitMQ 3.10); the message goes back, uncounted.
	modifyEndsSession bool
	// peekLock: Service Bus peek-lock on a queue without sessions. Each
	// delivery is locked for the lock duration (its 16-byte delivery tag is
	// the lock token; x-opt-locked-until says until when) and carries
	// x-opt-sequence-number and x-opt-enqueued-time.
	//
	// A lock not renewed in time expires, and the message goes back
	// counted; settling after that is answered with
	// com.microsoft:message-lock-lost. Every modified outcome is an
	// abandon, counted; modified{undeliverable-here} (a defer) is refused.
	// A dead letter carries the service's DeadLetterReason.
	peekLock bool
}

var (
	artemisRules    = rules{counts: true, groups: true}
	rabbitMQRules   = rules{firstAcquirer: true, modifyEndsSession: true}
	serviceBusRules = rules{counts: true, peekLock: true}
)

// rulesFor returns the rules of profile p.
func rulesFor(p amqpsub.Profile) (rules, bool) {
	switch p.String() {
	case amqpsub.Artemis.String(), amqpsub.Generic.String():
		return artemisRules, true
	case amqpsub.RabbitMQ3.String():
		return rabbitMQRules, true
	case amqpsub.AzureServiceBus.String():
		return serviceBusRules, true
	}
	return rules{}, false
}
