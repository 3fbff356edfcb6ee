package amqpsub

import (
	"time"

	"github.com/amqpsub/amqpsub/internal/driver"
)

// Metrics makes a Recorder for each [Subscriber] given it ([WithMetrics]), so
// that a metrics library sees what the subscriber does without amqpsub
// depending on one.
//
// New calls Recorder once, with what does not change while the subscriber
// lives; an adapter typically resolves its labels there, so that the
// Recorder's calls on the delivery path need no lookup.
//
// The adapters live in modules of their own:
// github.com/amqpsub/amqpsub/contrib/amqpprom (Prometheus) and
// github.com/amqpsub/amqpsub/contrib/amqpotel (OpenTelemetry metrics and
// traces).
type Metrics interface {
	Recorder(MetricsInfo) Recorder
}

// MetricsInfo is what a [Recorder] is made for.
type MetricsInfo struct {
	// Queue is the queue (entity path) the subscriber consumes.
	Queue string
	// System names the broker as the OpenTelemetry messaging conventions
	// do (messaging.system): "activemq" (the Artemis profile), "rabbitmq",
	// "servicebus", or "amqp" ([Generic]).
	System string
	// Credit is the credit (Credit), the most deliveries held at once on a
	// broker that keeps within it (a session consumer: the sum of its
	// sessions' shares); Lanes the number of lanes or workers.
	Credit, Lanes int
	// Batch reports whether the handler is a [BatchHandler].
	Batch bool
	// Stats returns the subscriber's counters, for gauges read when they
	// are collected: Held against Credit, each lane's Load, GroupsHeld, Parked,
	// BytesHeld, [Locks.Held]. It may be called from any goroutine once [New]
	// returned; it allocates, so call it per scrape, not per delivery.
	// Called before New has returned, it returns zeros.
	Stats func() Stats
	// Done is closed when the subscriber's Run has returned (see
	// [Subscriber.Done]): an adapter stops reporting its gauges then.
	Done <-chan struct{}
}

// Recorder hears of what one [Subscriber] does. Its methods are called from
// the subscriber's goroutines (the pump's, the lanes'), often at once, and
// must be safe for that; they must return at once, without blocking: the
// pump applies no settlement while Received or Settled runs. They are
// called per delivery, so an implementation should not allocate.
type Recorder interface {
	// Received is called for each delivery received from the broker.
	Received()
	// Handled is called after each handler call, retries in the lane
	// included.
	Handled(HandlerCall)
	// Settled is called for each settlement the subscriber applied: err
	// is nil when the broker took it, [ErrNotSettled] when it was not sent,
	// or the broker's or link's error.
	Settled(o Outcome, err error)
	// Dropped is called for deliveries given up without a settlement, n at
	// a time: before any handler saw them, when their link (or, on Service
	// Bus, their lock) was lost ([Stats.Dropped], Stats.Locks.Dropped); and,
	// as Run returns, those still held, whose handlers a stop cut short or
	// abandoned. The broker delivers them again. With Settled, it accounts
	// for every delivery Received once Run has returned.
	Dropped(n int)
	// Event is called for every Event, as [OnEvent]'s function would be,
	// but on the goroutine that raised it (so it must not block): links
	// lost, reconnects, credit overshoot, lost locks and the rest. No
	// event is dropped.
	Event(Event)
	// LocksRenewed is called for each renew-lock request the service
	// answered (Service Bus): n locks were renewed by it.
	LocksRenewed(n int)
}

// HandlerCall describes one call of a [Handler] or [BatchHandler].
type HandlerCall struct {
	// Lane is the lane (or worker) that made the call.
	Lane int
	// Deliveries is 1 for a [Handler], the batch's size for a [BatchHandler].
	Deliveries int
	// Took is how long the handler ran.
	Took time.Duration
	// Result is what the call decided; for a batch, the most severe of
	// its deliveries' results ([Retry], then [Reject], [Release], Accept).
	Result Result
	// Panicked reports a call that panicked (its Result is [ResultRetry]).
	Panicked bool
}

// meter passes the pump's reports to a Recorder (pump.Meter).
type meter struct{ r Recorder }

func (m meter) Received() { m.r.Received() }

func (m meter) Dropped(n int) { m.r.Dropped(n) }

func (m meter) Settled(k driver.Kind, err error) {
	if o, ok := outcomeOf(k); ok {
		m.r.Settled(o, err)
	}
}
