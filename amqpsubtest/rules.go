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
	// rabbit4: RabbitMQ 4.0's native AMQP 1.0, either queue type. A
	// modified outcome with a message-annotation key that does not start
	// with "x-" ends the link's session with amqp:internal-error (the
	// session's function_clause), before the outcome is applied;
	// modified{undeliverable-here} dead-letters the message, as rejected
	// does; the dead letter keeps nothing of a rejected outcome's error.
	rabbit4 bool
	// quorum: a RabbitMQ 4 quorum queue. Every return counts toward the
	// delivery limit: released, modified with or without delivery-failed,
	// and what a link that ends left unsettled. A return past the limit
	// dead-letters the message (reason delivery_limit); a return goes
	// ahead of the messages never delivered. The annotations of a
	// modified outcome stay on the message, and on its dead letter.
	quorum bool
}

var (
	artemisRules    = rules{counts: true, groups: true}
	rabbitMQRules   = rules{firstAcquirer: true, modifyEndsSession: true}
	serviceBusRules = rules{counts: true, peekLock: true}
	// RabbitMQ 4: the quorum queue's header delivery-count counts
	// modified{delivery-failed}; the classic queue's is always 0.
	quorumRules  = rules{counts: true, firstAcquirer: true, rabbit4: true, quorum: true}
	classicRules = rules{firstAcquirer: true, rabbit4: true}
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
	case amqpsub.RabbitMQ4.String():
		return quorumRules, true // WithQueueType may make it classicRules
	}
	return rules{}, false
}
