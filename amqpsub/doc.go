// Package amqpsub consumes an AMQP 1.0 queue with flow control, bounded
// memory, per-key ordering under concurrency, batching and a clean shutdown,
// on Apache ActiveMQ Artemis (the default), Azure Service Bus, RabbitMQ 4
// ([RabbitMQ4]), RabbitMQ 3.10 and other AMQP 1.0 brokers.
//
// A [Subscriber] reads one queue through one receiver link:
//
//	broker ──credit──▶ pump ──channel (credit deep)──▶ lanes ──▶ handler
//	   ▲                 │                                          │
//	   └──settlements────┴◀──────────── outcome ────────────────────┘
//
// The broker sends ahead at most the credit ([Credit], 256 by default). One
// goroutine, the pump, owns the link: it puts each delivery in a channel as
// deep as the credit, applies the settlements the handlers produce, and
// grants credit back in chunks as deliveries settle. So the process never
// holds more than the credit, and a slow handler slows the broker down rather
// than filling memory.
//
// Deliveries fan out to workers: Workers(n) runs n handlers at once with no
// order; WorkersByKey(n) runs n lanes, sends each delivery to the lane its
// AMQP group-id hashes to and runs a lane's deliveries one at a time, in
// order. Deliveries without a group-id rotate over the lanes. [NewBatch] takes
// a [BatchHandler] that gets batches closed at a size or a wait.
//
// A handler returns nil to accept a delivery, Release() to put it back
// untouched, Reject(reason) to dead-letter it, and any other error (or a
// panic) to retry it: the broker counts the attempt and dead-letters the
// delivery after its maximum delivery attempts.
//
// Run consumes until its ctx is cancelled, Shutdown or Close is called, or a
// fatal error. A graceful stop grants no more credit, releases at once every
// delivery no handler has taken (so another replica gets it), lets the
// handlers in progress finish within the grace period, settles them and
// closes. On a RabbitMQ 4 quorum queue, which counts every release as a
// delivery attempt, it handles the buffered deliveries first, for up to
// half the grace period (see [RabbitMQ4]).
package amqpsub
