// Package amqpprom exposes what amqpsub Subscribers do as Prometheus
// metrics. It lives in a module of its own so that amqpsub itself does not
// depend on the Prometheus client.
//
// Give one *Metrics to every Subscriber of a process (amqpsub.WithMetrics);
// each Subscriber's series carry its queue and broker as labels:
//
//	reg := prometheus.NewRegistry()
//	m := amqpprom.New(reg)
//	sub, err := amqpsub.New(conn, "orders", h, amqpsub.WithMetrics(m))
//	http.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
//
// The names follow the OpenTelemetry messaging semantic conventions as
// Prometheus spells them (dots become underscores, units become suffixes),
// with the labels messaging_system ("activemq", "rabbitmq", "servicebus",
// "amqp") and messaging_destination_name (the queue):
//
//	messaging_client_consumed_messages_total{messaging_operation_name="receive"}
//	    counter: deliveries received from the broker.
//	messaging_process_duration_seconds{messaging_operation_name="process", result, error_type}
//	    histogram: handler calls (retries in the lane included) and how long
//	    they ran; result is "accept", "release", "reject" or "retry";
//	    error_type is "" for accept and release, else "reject", "retry" or
//	    "panic" (as in contrib/amqpotel).
//	amqpsub_settlements_total{outcome, error_type}
//	    counter: settlements applied, by outcome ("accepted", "released",
//	    "modified", "rejected"); error_type is "" when the broker took
//	    it, "not_settled" when the delivery's link or lock was lost first
//	    (amqpsub.ErrNotSettled; contrib/amqpotel says the same),
//	    else "failed". With amqpsub.DeadLetterCopy, a rejection whose copy
//	    the broker took settles as "accepted": it is counted here as
//	    accepted, and in amqpsub_dead_letter_copies_total.
//	amqpsub_batch_size
//	    histogram: deliveries per BatchHandler call (BatchHandler only).
//	amqpsub_events_total{kind}
//	    counter: amqpsub.Events by kind ("link-lost", "reconnected",
//	    "credit-overshoot", "lock-lost", ...).
//	amqpsub_dead_letter_copies_total
//	    counter: rejected deliveries that amqpsub.DeadLetterCopy copied,
//	    with their reason, to the dead-letter address, the originals being
//	    accepted (amqpsub.Stats.DeadLetterCopies; event
//	    "dead-letter-copied"). Handled deliveries accepted are
//	    amqpsub_settlements_total{outcome="accepted"} less this.
//	amqpsub_dead_letter_copy_failures_total
//	    counter: copies the broker did not take; those deliveries were
//	    rejected without their reason (amqpsub.Stats.DeadLetterCopyFailures;
//	    event "dead-letter-copy-failed").
//	amqpsub_locks_renewed_total
//	    counter: Service Bus message locks renewed.
//	amqpsub_dropped_total
//	    counter: deliveries given up unsettled: before a handler saw them
//	    (their link or lock was lost), or still held when Run returned
//	    (handlers a stop cut short); the broker delivers them again.
//	    Consumed = settlements + dropped once the subscriber's Run has
//	    returned.
//
// and gauges read from Subscriber.Stats at each scrape, one for each row
// of amqpsub.StatFields that is no counter, with the row's help: summed
// over the Subscribers of one queue and broker (replicas in one process),
// the highest of them for an amqpsub.StatMaxGauge; a Subscriber whose Run
// has returned is forgotten. A row's series is amqpsub_<name>, with
// _seconds for a duration (in seconds) and _bytes for a size whose name
// does not say bytes; three keep the names they had before the table:
//
//	amqpsub_held_deliveries (held), amqpsub_held_bytes (bytes_held),
//	amqpsub_parked_deliveries (parked: held deliveries waiting behind an
//	earlier one of their group or a handler call that runs long),
//	amqpsub_max_held, amqpsub_max_bytes_held, amqpsub_buffered,
//	amqpsub_handling, amqpsub_settling, amqpsub_longest_lane,
//	amqpsub_groups_held, amqpsub_credit (now: adaptive unless FixedCredit),
//	amqpsub_credit_limit (the Credit option; summed, as the others),
//	amqpsub_round_trip_seconds, amqpsub_locks_held,
//	amqpsub_lane_load{lane}  (deliveries waiting for each lane or in it)
//
// The table's counters are no series of their own: the counters above
// count what happens as it happens (amqpsub_events_total by kind among
// them), and keep what a Subscriber counted once its Run returned, which
// gauges read from Stats would lose.
//
// On the delivery path a call costs an atomic add, or a histogram
// observation, on a series resolved when the Subscriber was made; nothing
// is allocated.
package amqpprom
