// Package amqpotel reports what amqpsub subscribers do to OpenTelemetry:
// metrics through amqpsub.WithMetrics(NewMetrics(...)), and traces through
// a handler middleware, Handler or BatchHandler. It follows the
// OpenTelemetry messaging semantic conventions (semconv 1.43.0, still
// "development" for messaging) and names what they lack under amqpsub.
// It is a module of its own, so that amqpsub itself depends on no
// OpenTelemetry package.
//
// # Metrics
//
// Every instrument has messaging.system (amqpsub.MetricsInfo.System:
// "activemq", "rabbitmq", "servicebus" or "amqp") and
// messaging.destination.name (the queue).
//
//   - messaging.client.consumed.messages, counter, {message}: one per
//     delivery received; messaging.operation.name "receive".
//   - messaging.process.duration, histogram, s: one per handler call
//     (each LocalRetry too), with the buckets the conventions recommend;
//     messaging.operation.name "process", amqpsub.result (accept, release,
//     reject, retry) and, on a failed call, error.type: "retry", "reject"
//     or "panic".
//   - amqpsub.settlements, counter, {settlement}: one per settlement
//     applied; messaging.operation.name the settle operation (see Handler),
//     amqpsub.outcome (accepted, released, modified, rejected) and, when
//     the broker did not take it, error.type ("not_settled" when it was not
//     sent, else the AMQP error's condition, or "link_closed" and the like).
//   - amqpsub.batch.size, histogram, {message}: deliveries per
//     BatchHandler call; messaging.operation.name "process".
//   - amqpsub.events, counter, {event}: amqpsub.Events by amqpsub.event,
//     the kind's name (link-lost, reconnected, credit-overshoot, lock-lost,
//     handler-failed...).
//   - amqpsub.dead_letter.copies, counter, {message}: rejections that
//     amqpsub.DeadLetterCopy copied to the dead-letter address; they
//     settle as accepted, and amqpsub.settlements counts them so.
//   - amqpsub.dead_letter.copy_failures, counter, {message}: copies the
//     broker did not take; those deliveries were rejected without their
//     reason.
//   - amqpsub.locks.renewed, counter, {lock}: Service Bus message locks
//     renewed.
//   - amqpsub.deliveries.dropped, counter, {message}: deliveries given up
//     unsettled: before a handler saw them (their link or lock was lost),
//     or still held when Run returned (handlers a stop cut short); the
//     broker delivers them again. Consumed = settlements + dropped, once
//     the subscriber's Run has returned.
//
// And, read from amqpsub.MetricsInfo.Stats in one callback per collection,
// summed over the running subscribers of a queue (one whose Run returned
// is left out): amqpsub.messages.held (held now,
// against amqpsub.credit, the credit now, within amqpsub.credit.limit),
// amqpsub.lane.load (per lane, amqpsub.lane),
// amqpsub.groups.held, amqpsub.messages.parked (held deliveries waiting
// behind an earlier one of their group or a handler call that runs long),
// amqpsub.bytes.held (By) and amqpsub.locks.held.
// They are asynchronous up-down counters, as the OpenTelemetry guidelines
// want for values that add up across attributes (a Prometheus exporter
// shows them as gauges).
//
// A Recorder's methods allocate nothing of their own: every attribute set
// is made when the subscriber is created, and passed with
// metric.WithAttributeSet (see the README for the measured figures).
//
// # Traces
//
// Handler and BatchHandler run the handler in a "process <queue>" span,
// of kind CONSUMER, linked to (and, for one delivery, a child of) the
// producer's context carried in the message's application properties
// (W3C traceparent, or Diagnostic-Id as the Azure Service Bus SDKs write
// it), and record a "<operation> <queue>" settle span, of kind CLIENT, for
// each delivery's settlement ("dead_letter_copy <queue>" for a rejection
// amqpsub.DeadLetterCopy copied and then accepted). See Handler for the
// attributes.
package amqpotel
