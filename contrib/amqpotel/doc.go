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
// an instrument for each row of amqpsub.StatFields that is no counter,
// with the row's unit and help, named by InstrumentName: summed over the
// running subscribers of a queue (one whose Run returned is left out), as
// asynchronous up-down counters, which the OpenTelemetry guidelines want
// for values that add up across attributes (a Prometheus exporter shows
// them as gauges); an amqpsub.StatMaxGauge (amqpsub.longest_lane,
// amqpsub.round_trip in ns) is an asynchronous gauge of the highest.
// Those that had a name before the table keep it: amqpsub.messages.held
// (held now, against amqpsub.credit, the credit now, within
// amqpsub.credit.limit), amqpsub.groups.held, amqpsub.messages.parked
// (held deliveries waiting behind an earlier one of their group or a
// handler call that runs long), amqpsub.bytes.held (By) and
// amqpsub.locks.held; the others are amqpsub.<name>: amqpsub.max_held,
// amqpsub.max_bytes_held, amqpsub.buffered, amqpsub.handling,
// amqpsub.settling. Beside them, amqpsub.lane.load is each lane's load
// (per lane, amqpsub.lane). The table's counters are no instruments of
// their own: the counters above count what happens as it happens
// (amqpsub.events by kind among them), and keep what a subscriber counted
// once its Run returned, which a read of Stats would lose.
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
