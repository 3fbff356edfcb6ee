package amqpsubtest

import "github.com/amqpsub/amqpsub/amqpsub"

// rules are what a broker does that the queue plays: one set per profile.
//
// Service Bus has no rules here yet: playing it needs a message lock (a
// delivery not settled within the lock duration goes back to the queue,
// counted, and settling it afterwards fails with amqp:message-lock-lost),
// driven by time.Now() so that a synctest bubble's clock expires it.
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
}

var (
	artemisRules  = rules{counts: true, groups: true}
	rabbitMQRules = rules{firstAcquirer: true, modifyEndsSession: true}
)

// rulesFor returns the rules of profile p.
func rulesFor(p amqpsub.Profile) (rules, bool) {
	switch p.String() {
	case amqpsub.Artemis.String(), amqpsub.Generic.String():
		return artemisRules, true
	case amqpsub.RabbitMQ3.String():
		return rabbitMQRules, true
	}
	return rules{}, false
}
