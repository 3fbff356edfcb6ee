// Package amqpsubtest tests amqpsub handlers without a broker: a [Queue] plays
// the broker behind the real amqpsub pipeline (pump, credit, lanes,
// batches, outcomes, LocalRetry, MaxDeliveryCount, reconnects, stops, and
// on Service Bus the renewal of message locks), and records what happened
// to every message. It plays Apache ActiveMQ Artemis, RabbitMQ 3.10,
// RabbitMQ 4.0 (a quorum queue or a classic one), and Azure Service Bus
// peek-lock on a queue without sessions.
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
// sub.Run(ctx) on a goroutine, [Queue.Wait] for the messages to settle, and
// cancel ctx, call Shutdown or Close, and check what Run returned and what
// your handler's ctx said.
//
// What to assert on: [Queue.Records] (every message in publish order, each
// with its deliveries: the delivery count each carried and the outcome it was
// settled with), [Queue.Accepted] (in acceptance order), [Queue.DeadLetters]
// (with the Reject reason and description), [Queue.Queued] (what is left).
// [GroupOrder] checks per-group order, of what a handler recorded or of
// Queue.Accepted. The subscriber's own Stats and OnEvent say the rest.
//
// # Fake time
//
// Run the test in a testing/synctest bubble (synctest.Test) and LocalRetry
// backoffs, batch waits, grace periods, reconnect backoffs and Service Bus
// lock durations take no real time; synctest.Wait lets everything settle
// before you look. The queue starts no goroutine and no timer of its own:
// it runs on the subscriber's goroutines and yours, and makes the channels
// it blocks on there (and, while Service Bus locks are held, the timer a
// waiting Receive wakes at for the next expiry), so a bubble sees a
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
//     each link was given: it never sends past it. [Queue.Credit] is what
//     the attached links have left. A drain (which amqpsub sends at a
//     stop) takes the link's credit back at once, so what the stop
//     releases is not sent back to the stopping link.
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
//     when it reaches [MaxDeliveryAttempts] (10 by default; 5 in the
//     repository's test brokers) the message is dead-lettered, otherwise it goes back.
//   - rejected (Reject, RejectWith, MaxDeliveryCount): dead-lettered at
//     once. The dead letter keeps the rejected outcome's error (condition,
//     description, info), which Artemis does not (see amqpsub.DeadLetterCopy).
//   - A message that goes back goes to its place in publish order, ahead of
//     the messages published after it (Artemis puts it back by message id).
//     It may be delivered again at once, also to the link that gave it back.
//   - A link ends when the queue loses it (LoseLinks) or when its subscriber
//     stops receiving from it (Run returning, whatever the stop). Its
//     unsettled deliveries go back uncounted, recorded as [Unsettled] (Artemis
//     closes an AMQP consumer as not failed), and settling them afterwards
//     fails, as on a closed link (under Service Bus they stay locked: see
//     below). Credit granted on it afterwards is taken without an error
//     and goes nowhere, as go-amqp's IssueCredit does on a lost link: the
//     loss shows at the next Receive. RefuseAttach makes attaches fail;
//     [Queue.FailIssueCredit] makes grants fail as go-amqp's do while a
//     drain is pending on the link.
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
// # RabbitMQ 4 (WithProfile(amqpsub.RabbitMQ4))
//
// The queue plays a RabbitMQ 4.0 queue over its native AMQP 1.0: a quorum
// queue by default, RabbitMQ 4's recommended type, or a classic one
// ([WithQueueType]), as RabbitMQ 4.0.5 was measured to behave and as its
// source (rabbit_fifo, rabbit_classic_queue, rabbit_amqp_session) says. A
// subscriber with the RabbitMQ4 profile learns the type at each attach,
// from the queue in place of the broker's management node, and acts on it
// as on a broker (see amqpsub.RabbitMQ4): MaxDeliveryCount on a classic
// queue makes Run fail with an error wrapping amqpsub.ErrInvalidOption; on
// a quorum queue a graceful stop finishes what is buffered, for up to half
// the grace period, before it releases the rest, and a Reject keeps its
// reason on the dead letter.
//
// Either type:
//
//   - The queue hands out messages only within a link's credit, and
//     answers a drain at once. first-acquirer is true on a message's first
//     delivery only. There are no message groups: a group-id is a plain
//     property, and a group's messages go to any link with credit.
//   - accepted consumes the message; rejected dead-letters it (RabbitMQ
//     drops it unless the queue has a dead-letter exchange), and the dead
//     letter keeps nothing of the rejected outcome's error: [Record.Reason]
//     and [Record.Description] are "" ([Delivery.Error] is what was sent).
//   - modified{undeliverable-here} dead-letters the message at once.
//   - A modified outcome with a message-annotation key that does not start
//     with "x-" ends the link's session with amqp:internal-error (the
//     broker's session fails with function_clause) before anything is
//     applied: the link's deliveries go back as when a session ends.
//
// A quorum queue:
//
//   - counts every return of a message toward its [DeliveryLimit] (20 by
//     default): a release (amqpsub's Release, what a stop gives back), a
//     modified outcome with or without delivery-failed (Retry), and a
//     delivery a link that ends left unsettled. The return that takes the
//     count past the limit dead-letters the message, reason delivery_limit
//     ([Record.Reason]): it is delivered at most limit+1 times.
//   - raises the header's delivery-count for modified{delivery-failed}, so
//     amqpsub's MaxDeliveryCount counts the Retries; not for a release. An
//     ended link's unsettled deliveries keep their count when the link was
//     detached (the subscriber stopped receiving from it), and have it
//     raised when its session or connection went ([Queue.LoseLinks], an
//     annotation key not x-), as RabbitMQ returns a consumer's messages
//     when its process goes down. That, and the counting of what an ended
//     link held, are from RabbitMQ's source (rabbit_fifo returns a
//     removed consumer's messages, each counted), not measured.
//   - puts a return ahead of the messages never delivered, after the
//     returns already waiting.
//   - keeps the annotations of a modified outcome on the message: its
//     later deliveries carry them, and so does its dead letter
//     ([Record.Annotations]). A Reject's reason (annotation
//     amqpsub.AnnotationDeadLetterReason) is then [Record.Reason], its
//     description [Record.Description].
//
// A classic queue counts nothing: the header's delivery-count is always 0
// and there is no delivery limit, so a message a handler always fails
// comes back for ever. A return goes back to its place in publish order. A
// modified outcome's annotations are dropped.
//
// Where the queue departs from RabbitMQ 4: as under Artemis, a quorum
// queue's header count starts from the published header's delivery-count;
// dead letters are a list to assert on, not a dead-letter exchange's
// queue, and carry none of RabbitMQ's x-opt-deaths or x-first-death-*
// annotations; a rejected message is dead-lettered without any
// dead-letter exchange; there are no streams, single active consumer,
// priorities, TTLs or length limits.
//
// # Azure Service Bus (WithProfile(amqpsub.AzureServiceBus))
//
// The queue plays a Service Bus queue without sessions, in peek-lock mode,
// as amqpsub's AzureServiceBus profile and docs/brokers.md describe it (from
// the Azure SDKs' sources and Microsoft's AMQP documentation, not from
// Azure itself), so that a test of a Service Bus consumer can show what
// its locks do:
//
//	func TestSlowReport(t *testing.T) {
//		synctest.Test(t, func(t *testing.T) { // 60 s locks, minutes of handler: no real time
//			q := amqpsubtest.NewQueue(amqpsubtest.WithProfile(amqpsub.AzureServiceBus))
//			q.Publish(amqpsubtest.Message("", "report"))
//			sub, err := amqpsub.New(q.Connector(), "reports", reports.Handler(), amqpsub.MaxLockRenewal(90*time.Second))
//			if err != nil {
//				t.Fatal(err)
//			}
//			ctx, cancel := context.WithTimeout(t.Context(), time.Hour)
//			defer cancel()
//			if err := q.Drain(ctx, sub); err != nil {
//				t.Fatal(err)
//			}
//			if got := q.Records()[0].String(); got != "#0: 0 accepted → consumed" {
//				t.Fatal(got) // such as `#0: 0 lock expired, 1 accepted → consumed`: it took too long
//			}
//		})
//	}
//
// What it does:
//
//   - Its Connector stands in for amqpsub.ServiceBus's: a subscriber on it
//     takes the AzureServiceBus profile without [WithProfile], and New refuses
//     another profile, and Sessions or SessionIDs.
//   - Each delivery is locked for [LockDuration] (60 s by default) from when
//     it is sent. It carries the lock token as its 16-byte delivery tag
//     (in .NET's Guid byte order, as the service sends it), and message
//     annotations x-opt-locked-until (when the lock expires),
//     x-opt-sequence-number (from 1, in publish order) and
//     x-opt-enqueued-time (when it was published). Its header's
//     delivery-count is the number of earlier deliveries abandoned or whose
//     lock expired.
//   - The subscriber's lease book renews the locks through the link, in
//     place of com.microsoft:renew-lock on the $management node: a renewal
//     extends each lock to LockDuration from then ([Delivery.Renewals],
//     [Delivery.LockedUntil]); a request naming a lock that is expired,
//     settled or unknown renews none and fails with an error wrapping
//     amqpsub.ErrLockLost, as the service's status 410 does.
//   - A lock that is not renewed in time (a handler ran past MaxLockRenewal,
//     say) expires at its locked-until: the delivery is recorded as
//     [LockExpired], and the message goes back, counted. A settlement that
//     comes later is refused with an *amqp.Error of condition
//     com.microsoft:message-lock-lost and not
//     applied; [Delivery.Late] records it (amqpsub sends none once its lease
//     book knows the lock is lost, and counts the refusals it gets in
//     Stats().Locks.LostAtSettle).
//   - accepted completes the message; released returns it, not counted
//     (so a stop's releases cost nothing); modified (amqpsub's Retry, an
//     abandon) returns it, counted, whatever delivery-failed says;
//     modified{undeliverable-here}, a defer, is refused with
//     amqp:not-implemented; rejected dead-letters it, with the rejected
//     error's DeadLetterReason and DeadLetterErrorDescription ([Record.Reason],
//     [Record.Description]). When the count reaches MaxDeliveryAttempts (the
//     entity's MaxDeliveryCount, 10 by default, as on Service Bus), the
//     service dead-letters the message with reason MaxDeliveryCountExceeded.
//   - Settlements are answered at once, and a drain (which amqpsub sends at
//     a stop) takes the link's credit back at once. A group-id is a plain
//     property: on Service Bus it is the session id, and this queue has no
//     sessions.
//
// What it does not play: sessions (session locks and state, accepting a
// session); $management's other operations (peek, receive by sequence
// number, deferral, update-disposition); scheduled messages, time to live,
// duplicate detection and partitions; the properties-to-modify of a
// modified outcome; connections, claims-based security and link detaches
// by the service. A link that ends leaves its unsettled messages locked,
// as Service Bus does for a queue without sessions: they are renewed and
// settled as before (amqpsub settles them by lock token, on $management,
// once their link is gone; here through the ended link), a release then
// counting as an abandon, in the queue and in Stats().Settled.Modified
// (Stats().Locks.SettledByToken stays 0 here);
// they go back, counted, only when their locks expire. Dead letters are a
// list to assert on, not a $DeadLetterQueue to consume. Test those parts
// against the peer in integration/sbpeer, and remember that a test here
// says what amqpsub does with your handler, not what Azure does.
package amqpsubtest
