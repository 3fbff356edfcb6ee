package amqpsub

import (
	"slices"
	"strconv"
)

// StatKind says how a number of [Stats] moves, and so how the numbers of
// several subscribers combine.
type StatKind uint8

const (
	// StatCounter is a total since [New]: it only rises.
	StatCounter StatKind = iota + 1
	// StatGauge is a level now, which rises and falls; the levels of
	// several subscribers of one queue add up.
	StatGauge
	// StatMaxGauge is a level now that does not add up (the longest lane,
	// the round trip): of several subscribers', the highest counts.
	StatMaxGauge
)

// String returns "counter", "gauge" or "max_gauge".
func (k StatKind) String() string {
	switch k {
	case StatCounter:
		return "counter"
	case StatGauge:
		return "gauge"
	case StatMaxGauge:
		return "max_gauge"
	}
	return "StatKind(" + strconv.Itoa(int(k)) + ")"
}

// StatField is one number of [Stats]. [StatFields] lists them all, once:
// [Stats.String], [Stats.MarshalLogObject] and the metrics adapters
// (contrib/amqpprom, contrib/amqpotel) range over that list, so that a
// number added to it reaches each of them.
type StatField struct {
	// Name is the number's snake_case name, the log field's
	// ("held", "result_retry", "locks_lost").
	Name string
	// Help says what it counts, in a sentence.
	Help string
	// Kind is how it moves.
	Kind StatKind
	// Unit is its unit as OpenTelemetry writes it (UCUM): "{message}",
	// "By" (bytes), "ns" (a duration in nanoseconds), and so on.
	Unit string
	// Value returns the number in st. A uint64 counter comes as its
	// int64 conversion, which turns it negative only past 2⁶³.
	Value func(st Stats) int64

	logAs logType  // the Go type of the field, which the log keeps
	show  strPlace // where String writes it
}

// logType is the Go type a number has in Stats; MarshalLogObject writes it
// with the encoder method of that type.
type logType uint8

const (
	logUint64 logType = iota
	logInt
	logInt64
	logDuration
)

// strPlace is where Stats.String writes a number.
type strPlace uint8

const (
	strTail strPlace = iota // after the head, when it is not 0
	strHead                 // in the head, always (String's format names it)
	strNone                 // not at all: seldom 0, and the log has it
)

// StatFields returns the numbers of [Stats], in the order
// [Stats.MarshalLogObject] writes them. The slice is a copy, the caller's
// to keep.
func StatFields() []StatField { return slices.Clone(statFields) }

// statFields is the one list of Stats's numbers.
var statFields = []StatField{
	gauge("held", "Deliveries held in the process now: waiting for a handler, in one, or waiting for their settlement (at most the credit on a broker that keeps within it).",
		"{message}", logInt, strHead, func(st Stats) int64 { return int64(st.Held) }),
	gauge("max_held", "The most deliveries held at once.",
		"{message}", logInt, strHead, func(st Stats) int64 { return int64(st.MaxHeld) }),
	gauge("bytes_held", "Bytes of the message bodies held now.",
		"By", logInt64, strTail, func(st Stats) int64 { return st.BytesHeld }),
	gauge("max_bytes_held", "The most bytes of message bodies held at once.",
		"By", logInt64, strNone, func(st Stats) int64 { return st.MaxBytesHeld }),
	gauge("buffered", "Held deliveries waiting for a handler.",
		"{message}", logInt, strHead, func(st Stats) int64 { return int64(st.Buffered) }),
	gauge("handling", "Held deliveries in a handler.",
		"{message}", logInt, strHead, func(st Stats) int64 { return int64(st.Handling) }),
	gauge("settling", "Held deliveries whose settlement waits to be sent.",
		"{message}", logInt, strHead, func(st Stats) int64 { return int64(st.Settling) }),
	{Name: "longest_lane", Help: "The highest load of a lane: deliveries waiting for it and in its handler.",
		Kind: StatMaxGauge, Unit: "{message}", logAs: logInt, show: strHead, Value: func(st Stats) int64 { return int64(st.LongestLane()) }},
	gauge("groups_held", "Groups with deliveries in the lanes now (BalanceKeys).",
		"{group}", logInt, strTail, func(st Stats) int64 { return int64(st.GroupsHeld) }),
	gauge("parked", "Deliveries held now that wait behind an earlier one of their group, or behind a handler call running over four times the mean (a hot, slow or stuck group).",
		"{message}", logInt, strTail, func(st Stats) int64 { return int64(st.Parked) }),
	gauge("credit", "The credit now: the most deliveries the broker may send ahead and the process hold (adaptive, within credit_limit, unless FixedCredit).",
		"{message}", logInt, strNone, func(st Stats) int64 { return int64(st.Credit) }),
	gauge("credit_limit", "The credit's bound: the Credit option.",
		"{message}", logInt, strNone, func(st Stats) int64 { return int64(st.CreditLimit) }),
	{Name: "round_trip", Help: "The round trip measured from a credit grant to the first delivery it brought; 0 under FixedCredit or before a delivery.",
		Kind: StatMaxGauge, Unit: "ns", logAs: logDuration, show: strNone, Value: func(st Stats) int64 { return int64(st.RoundTrip) }},

	counter("received", "Deliveries received.", "{message}", strHead, func(st Stats) uint64 { return st.Received }),
	counter("accepted", "Settlements the broker took, as accepted.", "{settlement}", strHead, func(st Stats) uint64 { return st.Settled.Accepted }),
	counter("released", "Settlements the broker took, as released.", "{settlement}", strHead, func(st Stats) uint64 { return st.Settled.Released }),
	counter("modified", "Settlements the broker took, as modified.", "{settlement}", strHead, func(st Stats) uint64 { return st.Settled.Modified }),
	counter("rejected", "Settlements the broker took, as rejected.", "{settlement}", strHead, func(st Stats) uint64 { return st.Settled.Rejected }),
	counter("result_accept", "Deliveries a handler accepted (returned nil).", "{message}", strHead, func(st Stats) uint64 { return st.Results.Accept }),
	counter("result_release", "Deliveries a handler released.", "{message}", strHead, func(st Stats) uint64 { return st.Results.Release }),
	counter("result_retry", "Deliveries a handler failed (Retry, another error, or a panic).", "{message}", strHead, func(st Stats) uint64 { return st.Results.Retry }),
	counter("result_reject", "Deliveries a handler rejected.", "{message}", strHead, func(st Stats) uint64 { return st.Results.Reject }),
	counter("panics", "Handler calls that panicked (each is also a retry).", "{call}", strTail, func(st Stats) uint64 { return st.Results.Panics }),
	counter("local_retries", "Handler calls repeated in the lane (LocalRetry).", "{call}", strTail, func(st Stats) uint64 { return st.Results.LocalRetries }),
	counter("poisoned", "Deliveries rejected for their delivery count before a handler saw them (MaxDeliveryCount).", "{message}", strTail, func(st Stats) uint64 { return st.Results.Poisoned }),
	counter("oversize", "Deliveries rejected for their size before a handler saw them (MaxMessageSize).", "{message}", strTail, func(st Stats) uint64 { return st.Results.Oversize }),
	counter("settle_errors", "Settlements the broker did not take (the link was gone); it delivers those again.", "{settlement}", strTail, func(st Stats) uint64 { return st.SettleErrors }),
	counter("stale", "Settlements not sent because the delivery's link was lost while a handler had it; the broker delivers those again.", "{settlement}", strTail, func(st Stats) uint64 { return st.Stale }),
	counter("unsent", "Settlements decided but not sent, the stop's bound coming first; the broker delivers those again.", "{settlement}", strTail, func(st Stats) uint64 { return st.Unsent }),
	counter("dropped", "Deliveries of a lost link dropped before a handler saw them; the broker delivers those again.", "{message}", strTail, func(st Stats) uint64 { return st.Dropped }),
	{Name: "overshoot", Help: "Deliveries the broker sent past the credit.",
		Kind: StatCounter, Unit: "{message}", logAs: logInt64, show: strTail, Value: func(st Stats) int64 { return st.Overshoot }},
	counter("links", "Links attached.", "{link}", strNone, func(st Stats) uint64 { return st.Links }),
	counter("links_lost", "Links lost.", "{link}", strTail, func(st Stats) uint64 { return st.LinksLost }),
	counter("reconnects", "Links attached in place of a lost one.", "{link}", strTail, func(st Stats) uint64 { return st.Reconnects }),
	gauge("locks_held", "Service Bus deliveries whose locks are kept now.",
		"{lock}", logInt, strNone, func(st Stats) int64 { return int64(st.Locks.Held) }),
	counter("locks_renewed", "Service Bus message locks renewed.", "{lock}", strTail, func(st Stats) uint64 { return st.Locks.Renewed }),
	counter("lock_renew_requests", "Renew-lock requests sent.", "{request}", strTail, func(st Stats) uint64 { return st.Locks.RenewRequests }),
	counter("lock_renew_failures", "Renew-lock requests that failed for another reason than a lost lock.", "{request}", strTail, func(st Stats) uint64 { return st.Locks.RenewFailures }),
	counter("locks_lost", "Message locks lost: refused by the service, or expired.", "{lock}", strTail, func(st Stats) uint64 { return st.Locks.Lost }),
	counter("locks_dropped", "Locks lost of deliveries no handler had taken.", "{lock}", strTail, func(st Stats) uint64 { return st.Locks.Dropped }),
	counter("locks_skipped", "Locks lost of deliveries in a handler, whose settlement was then not sent.", "{lock}", strTail, func(st Stats) uint64 { return st.Locks.Skipped }),
	counter("locks_unrenewable", "Deliveries without a lock token or expiry, never renewed.", "{message}", strTail, func(st Stats) uint64 { return st.Locks.Unrenewable }),
	counter("settled_by_token", "Settlements the service took by lock token on its management node.", "{settlement}", strTail, func(st Stats) uint64 { return st.Locks.SettledByToken }),
	counter("disposition_requests", "Requests on the management node that settled by lock token.", "{request}", strTail, func(st Stats) uint64 { return st.Locks.DispositionRequests }),
	counter("locks_lost_at_settle", "Settlements the service answered with message-lock-lost.", "{settlement}", strTail, func(st Stats) uint64 { return st.Locks.LostAtSettle }),
	counter("settle_timeouts", "Settlements the service did not answer within SettleTimeout.", "{settlement}", strTail, func(st Stats) uint64 { return st.Locks.SettleTimeouts }),
	counter("dead_letter_copies", "Rejections kept as a copy on the dead-letter address (DeadLetterCopy); their originals are accepted.", "{message}", strTail, func(st Stats) uint64 { return st.DeadLetterCopies }),
	counter("dead_letter_copy_failures", "Dead-letter copies the broker did not take; those deliveries were rejected instead, without their reason.", "{message}", strTail, func(st Stats) uint64 { return st.DeadLetterCopyFailures }),
	counter("abandoned", "Handlers that had not returned when Run returned.", "{call}", strTail, func(st Stats) uint64 { return st.Abandoned }),
	counter("events_dropped", "Events the OnEvent function fell too far behind to get.", "{event}", strTail, func(st Stats) uint64 { return st.EventsDropped }),
}

// gauge is a StatGauge row.
func gauge(name, help, unit string, as logType, show strPlace, v func(Stats) int64) StatField {
	return StatField{Name: name, Help: help, Kind: StatGauge, Unit: unit, Value: v, logAs: as, show: show}
}

// counter is a StatCounter row of a uint64 field.
func counter(name, help, unit string, show strPlace, v func(Stats) uint64) StatField {
	return StatField{Name: name, Help: help, Kind: StatCounter, Unit: unit, logAs: logUint64, show: show,
		Value: func(st Stats) int64 { return int64(v(st)) }} //nolint:gosec // G115: a counter past 2⁶³ is documented to wrap
}
