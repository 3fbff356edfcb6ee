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
// 1048576; New rejects other values ([ErrInvalidOption]). Default: 256.
func Credit(n int) Option {
	return checked("Credit", n, n >= 1 && n <= 1<<20, "must be between 1 and 1048576", func(c *config) {
		c.credit = n
	})
}

// FixedCredit holds the whole [Credit] at all times, whatever the
// handlers' pace.
//
// Without it the credit is adaptive: the link holds what the lanes will
// start soon, their measured drain rate times four round trips (each
// counted as at least 2 ms), on top of one delivery per lane (for a
// [BatchHandler], a batch per lane) and of what waits behind a busy lane,
// and never more than Credit. A lowered credit is not taken back from the
// broker: the next grants wait until what was granted has been spent.
//
// Default: off (the credit adapts). Why, and when to hold the whole
// credit: docs/options.md#fixedcredit.
func FixedCredit() Option {
	return optionFunc(func(c *config) { c.fixedCredit = true })
}

// Workers runs up to n handlers at once, with no order between deliveries.
// Must be between 1 and 4096, and not given with [WorkersByKey]; New
// rejects anything else ([ErrInvalidOption]). Default: Workers(1), which
// handles deliveries one at a time in queue order.
func Workers(n int) Option {
	return optionFunc(func(c *config) { c.setWorkers(fmt.Sprintf("Workers(%d)", n), n, false) })
}

// WorkersByKey runs n lanes. A delivery goes to the lane its group-id hashes
// to, and a lane handles its deliveries one at a time in arrival order, so
// each group keeps its order while groups run side by side. Deliveries
// without a group-id (or with an empty one) rotate over the lanes. Must be
// between 1 and 4096, and not given with [Workers]; New rejects anything
// else ([ErrInvalidOption]). Default: off (Workers(1)).
func WorkersByKey(n int) Option {
	return optionFunc(func(c *config) { c.setWorkers(fmt.Sprintf("WorkersByKey(%d)", n), n, true) })
}

// BalanceKeys changes how [WorkersByKey] places groups on its lanes: a group
// is bound to a lane only while that lane has one of its deliveries (in its
// handler or open batch); the group's other deliveries wait in a shared
// pool, in order, and any lane that is free takes the next group that is
// ready. Each group still runs in order, one delivery at a time (and its
// batches keep their order), but a slow or busy group holds back no other
// group. [LocalRetry] of a delivery holds only its own group.
//
// Only with WorkersByKey; New rejects it otherwise ([ErrInvalidOption]).
// Default: off (a group's lane is the hash of its group-id, mod n).
// Why: docs/options.md#balancekeys.
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
// comes first. A wait of 0 means no wait: a batch closes as soon as no more
// deliveries are waiting, and a lone delivery is handed over at once.
//
// A lane's batch holds only what the broker has sent and not seen settled:
// batches reach size only with [Credit] ≥ lanes × size, and a size above
// the credit acts as the credit.
//
// Only for [NewBatch]; size must be ≥ 1, wait ≥ 0. New rejects anything
// else ([ErrInvalidOption]). Default: Batch(100, 10*time.Millisecond).
// Why: docs/options.md#batch.
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
// [CloseTimeout], whichever comes first. On Azure Service Bus the
// settlements decided before the handlers were cancelled (results,
// releases) are still sent afterwards, up to a quarter of CloseTimeout
// before the stop's bound; those not sent by then are counted in
// [Stats.Unsent]. Must be ≥ 0 ([ErrInvalidOption] otherwise). Default: 30 s.
func GracePeriod(d time.Duration) Option {
	return checked("GracePeriod", d, d >= 0, "must be ≥ 0", func(c *config) {
		c.grace = d
	})
}

// DialTimeout bounds connecting, opening the session and attaching the link.
// With [DialFailover] it bounds each address tried on its own: a pass through
// n addresses takes up to n × DialTimeout. Must be > 0 ([ErrInvalidOption]
// otherwise). Default: 10 s.
func DialTimeout(d time.Duration) Option {
	return checked("DialTimeout", d, d > 0, "must be > 0", func(c *config) {
		c.dialTimeout = d
	})
}

// CloseTimeout bounds closing the link, session and connection at the end
// of Run, all steps together, and how long Run then still waits for
// handlers whose context it cancelled. Must be > 0 ([ErrInvalidOption]
// otherwise). Default: 5 s.
func CloseTimeout(d time.Duration) Option {
	return checked("CloseTimeout", d, d > 0, "must be > 0", func(c *config) {
		c.closeTimeout = d
	})
}

// WithProfile sets the broker profile: how the link is attached, how [Retry]
// is settled and how the link is closed. The zero Profile is rejected
// ([ErrInvalidOption]). Default: Artemis.
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
// lists every line and its fields. nil is rejected ([ErrInvalidOption]).
// Default: zap.NewNop().
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
// connection is found that way) and reconnected. With Dial and DialFailover
// it applies when their amqp.ConnOptions leave IdleTimeout at 0; a
// connection given with [Conn] keeps its own.
//
// Must be between 100 ms and about 99 days (2386h5m34.59s); New rejects
// other values ([ErrInvalidOption]). Default: 30 s.
// Why these bounds: docs/options.md#idletimeout.
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
// 0 < initial ≤ max; New rejects anything else ([ErrInvalidOption]).
// Default: Backoff(100*time.Millisecond, 2*time.Second).
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
// outcome goes to the broker; only Retry outcomes are retried, never
// [Release] or [Reject]. The lane does nothing else meanwhile, so the group
// keeps its order; once the retries run out, the Retry goes to the broker as
// a failed attempt and the lane goes on at once with the group's next
// deliveries, so that group's order is lost. A graceful stop ends the
// retries and releases the delivery ([Results.Release]; on a RabbitMQ 4
// quorum queue only if they have not ended within half the [GracePeriod]);
// a Close, a lost link or a lost Service Bus lock end them and send
// nothing: the broker delivers the message again.
//
// p needs Attempts or Budget > 0, both ≥ 0, and 0 ≤ Initial ≤ Max; New
// rejects anything else ([ErrInvalidOption]). Default: off. Why, and what
// a handler must do to keep order: docs/options.md#localretry.
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
// (see [MaxMessageSize] for what is counted) stay under n. The broker does
// not say a message's size before sending it, so grants go by the largest
// size seen lately, one at a time until one is seen; one delivery always
// flows when nothing is held. What is held passes n only by messages larger
// than any seen lately: about n + Credit × the largest message at most, so
// with mixed sizes lower Credit too. [Stats.BytesHeld] and MaxBytesHeld
// show it. It counts bodies, not the process's memory, which is a multiple
// of it: set GOMEMLIMIT. With [Sessions], each session held gets its share
// of n.
//
// Must be ≥ 0, 0 meaning no bound ([ErrInvalidOption] otherwise). Default:
// off (the credit alone bounds what is held).
// Why: docs/options.md#maxheldbytes.
func MaxHeldBytes(n int64) Option {
	return checked("MaxHeldBytes", n, n >= 0, "must be ≥ 0", func(c *config) {
		c.maxHeldBytes = n
	})
}

// MaxMessageSize dead-letters, before a handler sees it, every delivery
// whose body is larger than n bytes (its data sections, or a binary or
// string value; the rest of a message is not counted).
// Stats.Results.Oversize counts them and [OnEvent] hears of each
// ([EventOversize]). On Service Bus ([AzureServiceBus]) it is rejected as
// [Reject] does there, with DeadLetterReason "MaxMessageSizeExceeded" and a
// DeadLetterErrorDescription naming the size and n; elsewhere with
// condition amqp:link:message-size-exceeded and a reason, and the broker
// dead-letters it. The message is read whole before it is refused.
//
// Must be ≥ 0, 0 meaning no limit ([ErrInvalidOption] otherwise).
// Default: off. Why, and its memory cost: docs/options.md#maxmessagesize.
func MaxMessageSize(n int64) Option {
	return checked("MaxMessageSize", n, n >= 0, "must be ≥ 0", func(c *config) {
		c.maxMessageSize = n
	})
}

// MaxDeliveryCount dead-letters, before a handler sees it, every delivery
// past the n-th of its message: a poison-message limit for brokers without
// one of their own, or lower than theirs. Counting follows the broker (see
// [Delivery.DeliveryCount]): on Service Bus ([AzureServiceBus]) n
// deliveries are handled, as with an entity's MaxDeliveryCount of n;
// elsewhere a delivery whose header delivery-count is above n is rejected,
// so n+1 are handled. It has no effect on RabbitMQ 3.10, which always sends
// a count of 0. Under [RabbitMQ4] a quorum queue counts Retry; on a classic
// queue, which counts nothing, Run fails with an error wrapping
// [ErrInvalidOption]. On Service Bus and RabbitMQ 4 the rejection carries
// the reason "MaxDeliveryCountExceeded". With [LocalRetry], each delivery
// is retried in its lane first.
//
// 0 turns it off. Default: off. Why: docs/options.md#maxdeliverycount.
func MaxDeliveryCount(n uint32) Option {
	return optionFunc(func(c *config) { c.maxDelivery = n })
}

// WithMetrics gives the subscriber's measurements to m: New calls
// m.Recorder once. Its cost on the delivery path is an interface call per
// event and two clock reads per handler call (see docs/performance.md).
// nil is rejected ([ErrInvalidOption]). Default: none.
func WithMetrics(m Metrics) Option {
	return optionFunc(func(c *config) {
		if m == nil {
			c.invalid("WithMetrics: nil Metrics")
			return
		}
		c.metrics = m
	})
}
