// Package amqpsubtest tests amqpsub handlers without a broker: a Queue plays
// the broker behind the real amqpsub pipeline (pump, credit, lanes,
// batches, outcomes, LocalRetry, MaxDeliveryCount, reconnects, stops), and
// records what happened to every message.
//
// # Five minutes
//
// Publish messages, run your handler on the queue as in production, wait
// until every message is accepted or dead-lettered, and look at what the
// broker saw:
//
//	func TestOrderHandler(t *testing.T) {
//		q := amqpsubtest.NewQueue(amqpsubtest.MaxDeliveryAttempts(5))
//		q.Publish(amqpsubtest.Message("alice", `{"amount": 5}`), amqpsubtest.Message("bob", `oops`))
//		sub, err := amqpsub.New(q.Connector(), "orders", orders.Handler(store), amqpsub.WorkersByKey(4))
//		if err != nil {
//			t.Fatal(err)
//		}
//		if err := q.Drain(t.Context(), sub); err != nil { // runs sub, stops it when drained
//			t.Fatal(err)
//		}
//		if r := q.Records()[1]; r.State != amqpsubtest.DeadLettered || r.Reason() != "malformed order" {
//			t.Fatalf("bob's order: %v", r) // such as `#1 group bob: 0 rejected "malformed order" → dead-lettered`
//		}
//	}
//
// Drain runs the subscriber for you. To test a stop, run it yourself: call
// sub.Run(ctx) on a goroutine, Queue.Wait for the messages to settle, and
// cancel ctx, call Shutdown or Close, and check what Run returned and what
// your handler's ctx said.
//
// What to assert on: Queue.Records (every message in publish order, each
// with its deliveries: the delivery count each carried and the outcome it
// was settled with), Queue.Accepted (in acceptance order), Queue.DeadLetters
// (with the Reject reason and description), Queue.Queued (what is left).
// GroupOrder checks per-group order, of what a handler recorded or of
// Queue.Accepted. The subscriber's own Stats and OnEvent say the rest.
//
// # Fake time
//
// Run the test in a testing/synctest bubble (synctest.Test) and LocalRetry
// backoffs, batch waits, grace periods and reconnect backoffs take no real
// time; synctest.Wait lets everything settle before you look. The queue
// starts no goroutine and no timer: it runs on the subscriber's goroutines
// and yours, and makes the channels it blocks on there, so a bubble sees a
// subscriber on an idle queue as durably blocked. Use a queue
// from one bubble at a time. A handler that releases a message every time
// keeps the bubble busy (the message comes back at once, as on a broker),
// so the fake clock stands still.
//
// # What the queue does (the Artemis profile, the default)
//
// It follows Apache ActiveMQ Artemis 2.40 as docs/brokers.md records it:
//
//   - The queue hands out messages in publish order, only within the credit
//     each link was given: it never sends past it.
//   - Each delivery is a copy of the published message (group-id and every
//     other property kept) with a header of its own: its delivery-count is
//     the message's count of failed attempts; first-acquirer is the
//     producer's.
//   - accepted: the message is consumed.
//   - released, and modified without delivery-failed: the message goes back,
//     its count unchanged. A modified outcome's message-annotations are
//     ignored, as Artemis ignores them; with undeliverable-here the message
//     is not delivered on that link again while it is attached.
//   - modified{delivery-failed} (amqpsub's Retry): its count goes up by one;
//     when it reaches MaxDeliveryAttempts (10 by default; 5 in our test
//     broker) the message is dead-lettered, otherwise it goes back.
//   - rejected (Reject, RejectWith, MaxDeliveryCount): dead-lettered at
//     once. The dead letter keeps the rejected outcome's error (condition,
//     description, info), which Artemis does not (see amqpsub.DeadLetterCopy).
//   - A message that goes back goes to its place in publish order, ahead of
//     the messages published after it (Artemis puts it back by message id).
//     It may be delivered again at once, also to the link that gave it back.
//   - A link ends when the queue loses it (LoseLinks) or when its subscriber
//     stops receiving from it (Run returning, whatever the stop). Its
//     unsettled deliveries go back uncounted, recorded as Unsettled (Artemis
//     closes an AMQP consumer as not failed), and settling them afterwards
//     fails, as on a closed link. RefuseAttach makes attaches fail.
//   - Message groups: the messages of a group-id go to the first link that
//     got one of them, until that link ends; a group-sequence of 0xFFFFFFFF
//     (-1 to Artemis) unbinds the group when it is delivered. A link's pass
//     over the queue stops at a message whose group belongs to a link with
//     no credit left, so a busy owner holds the others back, as in Artemis.
//     Several subscribers on one queue (replicas) compete for its messages.
//
// Under WithProfile(amqpsub.RabbitMQ3), for RabbitMQ 3.10: delivery-count
// is always 0 and nothing is counted, so nothing is dead-lettered for
// failures (the subscriber's Retry arrives as released anyway);
// first-acquirer is true on a message's first delivery only; a modified
// outcome ends the link's session with amqp:invalid-field, as RabbitMQ 3.10
// does, and the message goes back; there are no message groups; a rejected
// message is dead-lettered (RabbitMQ drops it unless the queue has a
// dead-letter exchange). amqpsub.Generic gets the Artemis rules.
//
// Where the queue departs from Artemis: it records the reject's error; the
// count starts from the published header's delivery-count, so that a test
// can publish a message that failed before (Artemis keeps its own count,
// from 0); there is no redelivery-delay (Artemis's default is 0), and
// no expiry (TTL), priority or paging; dead letters are a list to assert
// on, not a queue to consume (publish them to another Queue to test a
// dead-letter consumer), and carry none of the x-opt-ORIG-* annotations;
// the queue name the subscriber gives is not checked; and
// amqpsub.DeadLetterCopy has no session to send on, so its rejections stay
// plain rejections. Under RabbitMQ3 the queue does not
// send past the credit, which RabbitMQ 3.10 does at small credits.
//
// The queue does not play Azure Service Bus (amqpsub.AzureServiceBus):
// its message locks, sessions and $management node are not simulated; test
// Service Bus consumers against the peer in integration/sbpeer.
package amqpsubtest
