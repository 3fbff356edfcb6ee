package amqpsub

import (
	"fmt"
	"math"
	"time"

	"go.uber.org/zap"
)

// Option configures a [Subscriber].
type Option interface {
	apply(*config)
}

type optionFunc func(*config)

func (f optionFunc) apply(c *config) { f(c) }

type config struct {
	credit       int
	fixedCredit  bool // FixedCredit: hold credit, do not adapt
	floor        int  // the adaptive credit's floor, set by build (creditFloor)
	floorNeed    int  // what one lane takes at once: 1, or a batch (creditFloor)
	workers      int
	byKey        bool
	workersSet   string // the option that set workers, to refuse a second one
	balanced     bool
	batchSize    int
	batchWait    time.Duration
	batchSet     bool
	grace        time.Duration
	dialTimeout  time.Duration
	closeTimeout time.Duration
	profile      Profile
	profileSet   bool
	log          *zap.Logger
	linkName     string
	idleTimeout  time.Duration
	backoffMin   time.Duration
	backoffMax   time.Duration
	isFatal      func(error) bool
	fatalSet     bool // FatalErrors given: the profile's default does not apply
	onReconnect  func(attempts int, cause error)
	onEvent      func(Event)
	metrics      Metrics
	localRetry   RetryPolicy
	maxDelivery  uint32
	// maxHeldBytes and maxMessageSize: MaxHeldBytes, MaxMessageSize; 0 off.
	maxHeldBytes, maxMessageSize int64
	// deadLetterCopy is DeadLetterCopy's address; "" when off.
	deadLetterCopy string
	// waitForQueue makes amqp:not-found at attach a reason to wait.
	waitForQueue bool
	// slots, when not nil, makes one pipe per element, each asking its
	// broker for that key ("" for whatever is free) and holding one group
	// at a time (so its groups are pinned to it), the credit shared
	// between them. A broker's options set it (Service Bus's Sessions
	// and SessionIDs); nil is one pipe.
	slots []string
	// broker holds the options of the profile's broker, set by the
	// option functions in its file; nil when none was given.
	broker brokerOptions
	errs   []error
}

// brokerOptions are a broker's own options (config.broker), kept for its
// driver by the option functions in the broker's file.
type brokerOptions interface {
	// check checks them against the rest of cfg, once every option has
	// been applied and the connector has validated cfg.
	check(cfg *config)
	// driver returns them as the driver reads them
	// (driver.PipeConfig.Options).
	driver() any
}

func defaultConfig() config {
	return config{
		credit:       256,
		workers:      1,
		batchSize:    100,
		batchWait:    10 * time.Millisecond,
		grace:        30 * time.Second,
		dialTimeout:  10 * time.Second,
		closeTimeout: 5 * time.Second,
		profile:      Artemis,
		log:          zap.NewNop(),
		idleTimeout:  30 * time.Second,
		backoffMin:   100 * time.Millisecond,
		backoffMax:   2 * time.Second,
		isFatal:      IsFatal,
	}
}

// checked returns the option that applies set when ok, and otherwise
// reports "name(v): rule" as invalid.
func checked(name string, v any, ok bool, rule string, set func(*config)) Option {
	return optionFunc(func(c *config) {
		if !ok {
			c.invalid("%s(%v): %s", name, v, rule)
			return
		}
		set(c)
	})
}

func (c *config) invalid(format string, args ...any) {
	c.errs = append(c.errs, fmt.Errorf("%w: "+format, append([]any{ErrInvalidOption}, args...)...))
}

// Credit sets the most deliveries the broker may send ahead, which is
// also the most the process holds at once (waiting, in lanes and in
// handlers). The credit the link holds follows demand below it (see
// [FixedCredit] for how, and for holding all of it). Must be between 1 and
// 1048576. Default: 256.
func Credit(n int) Option {
	return checked("Credit", n, n >= 1 && n <= 1<<20, "must be between 1 and 1048576", func(c *config) {
		c.credit = n
	})
}

// FixedCredit holds the whole [Credit] at all times, whatever the
// handlers' pace.
//
// Without it (the default) the credit is adaptive: the link holds what the
// lanes will start soon, their measured drain rate times four round trips
// a granted credit takes to come back as a delivery (each counted as at
// least 2 ms), on top of one delivery per lane (for a [BatchHandler], a
// batch per lane) and of what waits behind a busy lane (a slow group's
// backlog), and never more than Credit. A replica with slow handlers then takes
// from the queue only what it will start soon and leaves the rest to the
// replicas that are free, and on Service Bus fewer locks are held and
// renewed ahead of their handlers; fast handlers grow the credit up to
// Credit within a fraction of a second. A lowered credit is not taken back
// from the broker: the next grants wait until what was granted has been
// spent. docs/design.md says how it is computed, docs/performance.md what
// it measured.
//
// Hold the whole credit when the broker's round trip varies widely, or
// when a replica should prefetch a full Credit regardless (a lone
// consumer draining a backlog gains nothing by it).
func FixedCredit() Option {
	return optionFunc(func(c *config) { c.fixedCredit = true })
}

// Workers runs up to n handlers at once, with no order between deliveries.
// Must be between 1 and 4096, and not given with [WorkersByKey]. Default:
// Workers(1), which handles deliveries one at a time in queue order.
func Workers(n int) Option {
	return optionFunc(func(c *config) { c.setWorkers(fmt.Sprintf("Workers(%d)", n), n, false) })
}

// WorkersByKey runs n lanes. A delivery goes to the lane its group-id hashes
// to, and a lane handles its deliveries one at a time in arrival order, so
// each group keeps its order while groups run side by side. Deliveries
// without a group-id (or with an empty one) rotate over the lanes. Must be
// between 1 and 4096, and not given with [Workers]. Default: off (Workers(1)).
func WorkersByKey(n int) Option {
	return optionFunc(func(c *config) { c.setWorkers(fmt.Sprintf("WorkersByKey(%d)", n), n, true) })
}

// BalanceKeys changes how [WorkersByKey] places groups on its lanes: a group
// is bound to a lane only while that lane has one of its deliveries (in its
// handler or open batch); the group's other deliveries wait in a shared
// pool, in order, and any lane that is free takes the next group that is
// ready.
//
// Each group still runs in order, one delivery at a time (and its batches
// keep their order), but a slow or busy group holds back no other group,
// and groups spread over the lanes by load, where the hash placement can
// leave some lanes idle while others queue (docs/performance.md measures
// both). [LocalRetry] of a delivery holds only its own group. The cost is a
// lock shared by the lanes, taken a few times per delivery.
//
// Only with WorkersByKey. Default: off (a group's lane is the hash of its
// group-id, mod n).
func BalanceKeys() Option {
	return optionFunc(func(c *config) { c.balanced = true })
}

// maxWorkers bounds Workers and WorkersByKey: each is a goroutine.
const maxWorkers = 4096

func (c *config) setWorkers(name string, n int, byKey bool) {
	if c.workersSet != "" {
		c.invalid("%s after %s: give one of Workers and WorkersByKey, once", name, c.workersSet)
		return
	}
	c.workersSet = name
	if n < 1 || n > maxWorkers {
		c.invalid("%s: must be between 1 and %d", name, maxWorkers)
		return
	}
	c.workers, c.byKey = n, byKey
}

// Batch sets the size and wait of the batches a [BatchHandler] gets: a batch
// closes at size deliveries or wait after its first delivery, whichever
// comes first. Only for [NewBatch].
//
// A wait of 0 means no wait: a batch closes as soon as no more deliveries
// are waiting, so batches are as large as the backlog allows and a lone
// delivery is handed over at once.
//
// A lane's batch holds only what the broker has sent and not seen settled,
// which the credit bounds and the lanes share: batches reach size only with
// [Credit] ≥ lanes × size (the default Credit(256) with Workers(8) gives
// batches of about 32, closed by wait); a size above the credit acts as
// the credit.
//
// Size must be ≥ 1, wait ≥ 0. Default: Batch(100, 10*time.Millisecond).
func Batch(size int, wait time.Duration) Option {
	return optionFunc(func(c *config) {
		c.batchSet = true
		if size < 1 {
			c.invalid("Batch(%d, %v): size must be ≥ 1", size, wait)
			return
		}
		if wait < 0 {
			c.invalid("Batch(%d, %v): wait must be ≥ 0", size, wait)
			return
		}
		c.batchSize, c.batchWait = size, wait
	})
}

// GracePeriod bounds how long a graceful stop waits for the handlers in
// progress. When it runs out their context is cancelled (its cause is
// [ErrStopping]), their results are ignored and the connection is closed;
// the broker redelivers what was not settled.
//
// GracePeriod(0) releases the buffered deliveries and cancels the handlers
// at once: once the releases are applied, or after a quarter of
// [CloseTimeout], whichever comes first. On Azure Service Bus, where each
// settlement waits for the service's answer, the settlements decided
// before the handlers were cancelled (results, releases) are still sent
// afterwards, up to a quarter of CloseTimeout before the stop's bound;
// those not sent by then are counted in [Stats.Unsent].
//
// Must be ≥ 0. Default: 30 s.
func GracePeriod(d time.Duration) Option {
	return checked("GracePeriod", d, d >= 0, "must be ≥ 0", func(c *config) {
		c.grace = d
	})
}

// DialTimeout bounds connecting, opening the session and attaching the link.
// With [DialFailover] it bounds each address tried on its own: a pass through
// n addresses takes up to n × DialTimeout. Must be > 0. Default: 10 s.
func DialTimeout(d time.Duration) Option {
	return checked("DialTimeout", d, d > 0, "must be > 0", func(c *config) {
		c.dialTimeout = d
	})
}

// CloseTimeout bounds closing the link, session and connection at the end
// of Run, all steps together, and how long Run then still waits for
// handlers whose context it cancelled. Must be > 0. Default: 5 s.
func CloseTimeout(d time.Duration) Option {
	return checked("CloseTimeout", d, d > 0, "must be > 0", func(c *config) {
		c.closeTimeout = d
	})
}

// WithProfile sets the broker profile: how the link is attached, how [Retry]
// is settled and how the link is closed. Default: Artemis.
func WithProfile(p Profile) Option {
	return optionFunc(func(c *config) {
		if p.drv == nil {
			c.invalid("WithProfile: the zero Profile; use one of the package's profiles")
			return
		}
		c.profile, c.profileSet = p, true
	})
}

// Logger sets the logger; every line carries the field queue. At info and
// above it logs lifecycle events (attached, link lost, reconnected,
// stopping, …), one line each; what can happen once per delivery is logged
// at debug, or, for what needs a person (a panic, a poison message, a lost
// lock), at warn or error at most once a minute per line. docs/logging.md
// lists every line and its fields. nil is rejected. Default: zap.NewNop().
func Logger(l *zap.Logger) Option {
	return optionFunc(func(c *config) {
		if l == nil {
			c.invalid("Logger(nil)")
			return
		}
		c.log = l
	})
}

// maxIdleTimeout is the longest IdleTimeout: go-amqp advertises half of it
// in the open frame, as an AMQP uint of milliseconds.
const maxIdleTimeout = 2 * math.MaxUint32 * time.Millisecond

// LinkName sets the receiver link's name. Default: a random name chosen by
// go-amqp.
func LinkName(name string) Option {
	return optionFunc(func(c *config) { c.linkName = name })
}

// IdleTimeout sets the AMQP idle timeout of the connections the subscriber
// opens ([Dial], [DialFailover], [ServiceBus], [ServiceBusWithToken]): the
// broker is asked to send a frame at least every half of it, and a
// connection that stays silent for longer is taken as lost (a half-open TCP
// connection is found that way) and reconnected.
//
// With Dial and DialFailover it applies when their amqp.ConnOptions leave
// IdleTimeout at 0; a connection given with [Conn] keeps its own.
//
// Must be between 100 ms and about 99 days (2386h5m34.59s): below that a
// broker's heartbeats cannot keep a healthy connection alive; above it,
// half of it, which is what the broker is told, no longer fits AMQP's
// 32-bit count of milliseconds. Default: 30 s.
func IdleTimeout(d time.Duration) Option {
	return checked("IdleTimeout", d, d >= 100*time.Millisecond && d <= maxIdleTimeout,
		"must be between 100ms and "+maxIdleTimeout.String(), func(c *config) {
			c.idleTimeout = d
		})
}

// Backoff bounds the waits between reconnect attempts after a lost link or
// connection: attempt k waits a random time between 0 and
// min(max, initial·2^k) ("full jitter"), so replicas that lost the same
// broker do not all come back at once. A connection that cannot be made at
// the start of Run is not retried: Run returns its error. Must be
// 0 < initial ≤ max. Default: Backoff(100*time.Millisecond, 2*time.Second).
func Backoff(initial, max time.Duration) Option {
	return optionFunc(func(c *config) {
		if initial <= 0 || max < initial {
			c.invalid("Backoff(%v, %v): want 0 < initial ≤ max", initial, max)
			return
		}
		c.backoffMin, c.backoffMax = initial, max
	})
}

// FatalErrors sets the test that decides which errors end Run instead of
// being retried by reconnecting. nil retries everything, forever. Default:
// [IsFatal]; under [AzureServiceBus], IsFatal and amqp:not-allowed (see
// IsFatal). A test of your own replaces the default: under AzureServiceBus,
// keep amqp:not-allowed fatal by testing for an *amqp.Error whose
// Condition is amqp.ErrCondNotAllowed beside IsFatal.
func FatalErrors(isFatal func(error) bool) Option {
	return optionFunc(func(c *config) {
		if isFatal == nil {
			isFatal = func(error) bool { return false }
		}
		c.isFatal, c.fatalSet = isFatal, true
	})
}

// OnReconnect sets a function called after the subscriber attached a new
// link in place of a lost one, with the number of attempts it took and the
// error that ended the old link. It runs on the goroutine that attaches
// links, before the new link receives anything; keep it short: a stop
// waits for it up to [CloseTimeout], after which Run returns an error
// wrapping [ErrAbandoned] (and the new link is closed once f returns). The
// same news reaches [OnEvent] as [EventReconnected]. Default: none.
func OnReconnect(f func(attempts int, cause error)) Option {
	return optionFunc(func(c *config) { c.onReconnect = f })
}

// OnEvent sets a function that hears of every error and lifecycle event the
// subscriber meets while it runs: handler failures and panics, deliveries
// dead-lettered for their delivery count, failed settlements, lost links and
// reconnects, a broker sending past its credit, handlers abandoned at a
// stop (see [EventKind]). Each [Event] names its kind, its error, and the
// delivery's identity when there is one.
//
// Events are passed to f in order, on a goroutine of their own, so f never
// slows the pump or a lane; if f falls more than 1024 events behind, later
// ones are dropped and counted ([Stats.EventsDropped]). Run waits for f to
// finish the events queued before it returns, within [CloseTimeout].
//
// Default: none (events are only logged).
func OnEvent(f func(Event)) Option {
	return optionFunc(func(c *config) { c.onEvent = f })
}

// RetryPolicy says how [LocalRetry] retries a failed delivery in its lane.
type RetryPolicy struct {
	// Attempts is the most retries after the first failure; 0 means no
	// limit on attempts, so that Budget alone bounds them.
	Attempts int
	// Budget is how long after the first failure retries go on; 0 means no
	// limit in time, so that Attempts alone bounds them.
	Budget time.Duration
	// Initial and Max bound the wait before retry k: min(Max, Initial·2^k).
	// A zero Initial means 100 ms; a zero Max means 5 s, or Initial if
	// that is longer.
	Initial, Max time.Duration
}

// LocalRetry retries a delivery (or, for a [BatchHandler], the deliveries of
// a batch that failed, as a batch of their own) in its lane before a [Retry]
// outcome goes to the broker. Only Retry outcomes are retried, never
// [Release] or [Reject].
//
// The lane does nothing else meanwhile, so the delivery's group keeps its
// order, which a broker redelivery would break: give a Budget that outlasts
// the outages you expect (a store restarting, say), and let the broker's
// own redelivery count (Artemis max-delivery-attempts, with
// redelivery-delay) handle what outlasts it.
//
// When the retries run out, the Retry goes to the broker as a failed
// attempt, and the lane goes on at once with the group's next deliveries,
// those already held: for that group, order is then lost. A handler whose
// work depends on order must tell that case from an outage: when it finds
// a delivery out of order (a gap in a sequence it keeps), it should return
// [Release], which LocalRetry does not retry and the broker does not count
// as a failed attempt (a RabbitMQ 4 quorum queue counts it toward its
// delivery-limit all the same), so that the broker hands the group over
// again; a Retry there would be retried in the lane, where the missing
// delivery can never arrive, until the budget runs out.
//
// Retrying ends early:
//
//   - A graceful stop ends the waiting and releases the delivery, since
//     the stop, not the message, cut its retries short ([Results.Release]
//     counts it). Artemis, RabbitMQ 3.10, a RabbitMQ 4 classic queue and
//     Service Bus do not count a release as a delivery attempt; a
//     RabbitMQ 4 quorum queue counts it toward its delivery-limit, so
//     there the stop first hands what is buffered to the handlers, for up
//     to half the [GracePeriod], and the retries go on meanwhile: the
//     delivery is released only if they have not ended by then (see
//     [RabbitMQ4]). A Close ends the waiting too, but sends nothing: the
//     broker delivers the message again.
//   - The loss of its Service Bus lock ends it too, and cancels the
//     handler's context; nothing is sent then: the service delivers the
//     message again.
//   - A delivery whose link is lost (Artemis, RabbitMQ, a Service Bus
//     session) stops being retried at once: no result of it could be
//     settled, and the broker delivers it again.
//
// A BatchHandler that fails a delivery of a group must fail the group's
// later deliveries in the same batch too: the ones it accepted are settled
// at once, and their effects would then come before the failed one's.
//
// p needs Attempts or Budget > 0, both ≥ 0, and 0 ≤ Initial ≤ Max.
// Default: off.
func LocalRetry(p RetryPolicy) Option {
	return optionFunc(func(c *config) {
		if p.Initial == 0 {
			p.Initial = 100 * time.Millisecond
		}
		if p.Max == 0 {
			p.Max = max(5*time.Second, p.Initial)
		}
		if p.Attempts < 0 || p.Budget < 0 || p.Attempts == 0 && p.Budget == 0 || p.Initial < 0 || p.Max < p.Initial {
			c.invalid("LocalRetry(%+v): want Attempts or Budget > 0, neither negative, and 0 ≤ Initial ≤ Max", p)
			return
		}
		c.localRetry = p
	})
}

// WaitForQueue makes a missing queue (amqp:not-found at attach) a reason to
// wait and try again, with the [Backoff] waits, rather than an error that
// ends Run, also at the first attach. It is for queues that appear after
// the consumer starts, such as the dead-letter queue Artemis creates with
// the first dead letter (auto-create-dead-letter-resources): a dead-letter
// reader can start first. Default: off.
func WaitForQueue() Option {
	return optionFunc(func(c *config) { c.waitForQueue = true })
}

// MaxHeldBytes bounds the bytes of the deliveries the process holds, as
// [Credit] bounds their number: credit is granted only while the bodies held
// (see [MaxMessageSize] for what is counted) stay under n.
//
// The broker does not say how large a message is before sending it, so the
// subscriber grants by the sizes it has seen: as many as n holds of the
// largest lately (a larger size counts at once; the estimate then decays
// by 1/16 a delivery), one at a time until it has seen one. One delivery
// always flows when nothing is held, however large, so nothing stalls.
//
// What is held passes n only by deliveries larger than any lately: those
// granted while smaller ones came, up to the credit. With traffic of mixed
// sizes (mostly small, now and then very large), lower Credit too: the
// bound on bodies held is about n + Credit × the largest message.
// [Stats.BytesHeld] and MaxBytesHeld show it.
//
// It counts bodies held, not the process's memory: go-amqp assembles each
// message in a growing buffer before decoding it, and Go's collector lets
// the heap grow to twice what is live unless GOMEMLIMIT says otherwise, so
// expect the RSS to reach two to four times the bytes held, and set
// GOMEMLIMIT in a container.
//
// With [Sessions], each session held gets its share of n.
//
// Must be ≥ 0; 0 means no bound. Default: off (the credit alone bounds what
// is held: 256 deliveries of 1 MiB hold 256 MiB).
func MaxHeldBytes(n int64) Option {
	return checked("MaxHeldBytes", n, n >= 0, "must be ≥ 0", func(c *config) {
		c.maxHeldBytes = n
	})
}

// MaxMessageSize dead-letters, before a handler sees it, every delivery
// whose body is larger than n bytes (its data sections, or a binary or
// string value; the rest of a message is not counted).
// Stats.Results.Oversize counts them and [OnEvent] hears of each
// ([EventOversize]). How it is rejected follows the broker:
//
//   - On Service Bus ([AzureServiceBus]) it is rejected as [Reject] does there:
//     condition com.microsoft:dead-letter, DeadLetterReason
//     "MaxMessageSizeExceeded" and a DeadLetterErrorDescription naming the
//     size and n, so the service moves it to the entity's dead-letter queue
//     with that reason.
//   - Elsewhere it is rejected with condition
//     amqp:link:message-size-exceeded and a reason, and the broker
//     dead-letters it.
//
// The limit is checked once the message has arrived, not on the wire:
// go-amqp v1.7 drops its own limit when the broker's attach declares none,
// as Artemis's does. So an oversized message is read whole before it is
// refused, and costs the process two to four times its size in memory for
// a moment (see [MaxHeldBytes]), though not in BytesHeld. To keep such
// messages away from consumers altogether, limit them where they are
// produced (Artemis: an address setting or a broker plugin).
//
// Must be ≥ 0; 0 means no limit. Default: off.
func MaxMessageSize(n int64) Option {
	return checked("MaxMessageSize", n, n >= 0, "must be ≥ 0", func(c *config) {
		c.maxMessageSize = n
	})
}

// MaxDeliveryCount dead-letters, before a handler sees it, every delivery
// past the n-th of its message: a poison-message limit for brokers without
// one of their own, or lower than theirs. How deliveries are counted
// follows the broker (see [Delivery.DeliveryCount]):
//
//   - On Service Bus ([AzureServiceBus]) it means what an entity's
//     MaxDeliveryCount means: the n-th delivery is the last one handled
//     (the service's count, the AMQP header's delivery-count + 1, is then
//     n). The next is rejected as [Reject] does there, with
//     DeadLetterReason "MaxDeliveryCountExceeded" (the service's own
//     reason at the entity's limit) and a DeadLetterErrorDescription that
//     says amqpsub rejected it. An entity's own limit at or below n acts
//     first.
//   - Elsewhere a delivery whose header delivery-count (the earlier failed
//     attempts) is above n is rejected with a reason: n+1 deliveries are
//     handled. RabbitMQ 3.10 always sends a delivery count of 0, so it has
//     no effect there. On RabbitMQ 4 ([RabbitMQ4]) a quorum queue counts
//     Retry (and its own delivery-limit counts every return); a classic
//     queue counts nothing, so Run refuses the option there with an error
//     wrapping [ErrInvalidOption].
//
// So for at most N handled deliveries of a message, give MaxDeliveryCount(N)
// on Service Bus and MaxDeliveryCount(N-1) elsewhere. Under [RabbitMQ4] the
// rejection carries the reason MaxDeliveryCountExceeded and the delivery's
// number as its description, as on Service Bus. With [LocalRetry], each
// delivery is retried in its lane first: a message that always fails runs
// its handler (n+1) × (1 + the local retries) times, and holds its lane
// (and its group) for n+1 budgets.
//
// 0 turns it off. Default: off.
func MaxDeliveryCount(n uint32) Option {
	return optionFunc(func(c *config) { c.maxDelivery = n })
}

// WithMetrics gives the subscriber's measurements to m: New calls
// m.Recorder once. Its cost on the delivery path is an interface call per
// event and two clock reads per handler call (see docs/performance.md).
// nil is rejected. Default: none.
func WithMetrics(m Metrics) Option {
	return optionFunc(func(c *config) {
		if m == nil {
			c.invalid("WithMetrics: nil Metrics")
			return
		}
		c.metrics = m
	})
}
