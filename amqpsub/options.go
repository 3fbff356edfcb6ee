package amqpsub

import (
	"context"
	"errors"
	"fmt"
	"time"

	"go.uber.org/zap"

	"github.com/amqpsub/amqpsub/pump"
)

// ErrInvalidOption is wrapped by the error New and NewBatch return for an
// option with a value out of range or an option that does not fit the
// subscriber (such as Batch with a plain Handler).
var ErrInvalidOption = errors.New("amqpsub: invalid option")

// Option configures a Subscriber.
type Option interface {
	apply(*config)
}

type optionFunc func(*config)

func (f optionFunc) apply(c *config) { f(c) }

type config struct {
	credit       int
	workers      int
	byKey        bool
	batchSize    int
	batchWait    time.Duration
	batchSet     bool
	grace        time.Duration
	dialTimeout  time.Duration
	closeTimeout time.Duration
	profile      Profile
	log          *zap.Logger
	linkName     string
	idleTimeout  time.Duration
	backoffMin   time.Duration
	backoffMax   time.Duration
	isFatal      func(error) bool
	onReconnect  func(attempts int, cause error)
	localRetries int
	localMin     time.Duration
	localMax     time.Duration
	maxDelivery  uint32
	errs         []error

	// testSource, set only by tests, replaces the broker.
	testSource func(context.Context) (pump.Source, error)
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

func (c *config) invalid(format string, args ...any) {
	c.errs = append(c.errs, fmt.Errorf("%w: "+format, append([]any{ErrInvalidOption}, args...)...))
}

// Credit sets how many deliveries the broker may send ahead, which is also
// the most the process holds at once (waiting, in lanes and in handlers).
// Must be ≥ 1. Default: 256.
func Credit(n int) Option {
	return optionFunc(func(c *config) {
		if n < 1 || n > 1<<20 {
			c.invalid("Credit(%d): must be between 1 and 1048576", n)
			return
		}
		c.credit = n
	})
}

// Workers runs up to n handlers at once, with no order between deliveries.
// Must be ≥ 1. Default: Workers(1), which handles deliveries one at a time
// in queue order.
func Workers(n int) Option {
	return optionFunc(func(c *config) {
		if n < 1 {
			c.invalid("Workers(%d): must be ≥ 1", n)
			return
		}
		c.workers, c.byKey = n, false
	})
}

// WorkersByKey runs n lanes. A delivery goes to the lane its group-id hashes
// to, and a lane handles its deliveries one at a time in arrival order, so
// each group keeps its order while groups run side by side. Deliveries
// without a group-id (or with an empty one) rotate over the lanes. Must be
// ≥ 1. Default: off (Workers(1)).
func WorkersByKey(n int) Option {
	return optionFunc(func(c *config) {
		if n < 1 {
			c.invalid("WorkersByKey(%d): must be ≥ 1", n)
			return
		}
		c.workers, c.byKey = n, true
	})
}

// Batch sets the size and wait of the batches a BatchHandler gets: a batch
// closes at size deliveries or wait after its first delivery, whichever
// comes first. A wait of 0 means the default. Only for NewBatch. Size must be
// ≥ 1, wait ≥ 0. Default: Batch(100, 10*time.Millisecond).
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
		c.batchSize = size
		if wait > 0 {
			c.batchWait = wait
		}
	})
}

// GracePeriod bounds how long a graceful stop waits for the handlers in
// progress. When it runs out their context is cancelled and the connection
// closed; the broker redelivers what was not settled. Must be ≥ 0.
// Default: 30 s.
func GracePeriod(d time.Duration) Option {
	return optionFunc(func(c *config) {
		if d < 0 {
			c.invalid("GracePeriod(%v): must be ≥ 0", d)
			return
		}
		c.grace = d
	})
}

// DialTimeout bounds connecting, opening the session and attaching the link.
// Must be > 0. Default: 10 s.
func DialTimeout(d time.Duration) Option {
	return optionFunc(func(c *config) {
		if d <= 0 {
			c.invalid("DialTimeout(%v): must be > 0", d)
			return
		}
		c.dialTimeout = d
	})
}

// CloseTimeout bounds each step of closing the link, session and
// connection. Must be > 0. Default: 5 s.
func CloseTimeout(d time.Duration) Option {
	return optionFunc(func(c *config) {
		if d <= 0 {
			c.invalid("CloseTimeout(%v): must be > 0", d)
			return
		}
		c.closeTimeout = d
	})
}

// WithProfile sets the broker profile: how the link is attached, how Retry
// is settled and how the link is closed. Default: Artemis.
func WithProfile(p Profile) Option {
	return optionFunc(func(c *config) {
		if p.name == "" {
			c.invalid("WithProfile: the zero Profile; use Artemis, RabbitMQ3 or Generic")
			return
		}
		c.profile = p
	})
}

// Logger sets the logger. nil is rejected. Default: zap.NewNop().
func Logger(l *zap.Logger) Option {
	return optionFunc(func(c *config) {
		if l == nil {
			c.invalid("Logger(nil)")
			return
		}
		c.log = l
	})
}

// LinkName sets the receiver link's name. Default: a random name chosen by
// go-amqp.
func LinkName(name string) Option {
	return optionFunc(func(c *config) { c.linkName = name })
}

// IdleTimeout sets the AMQP idle timeout of the connections Dial opens: the
// broker is asked to send a frame at least every half of it, and a
// connection that stays silent for longer is taken as lost (a half-open TCP
// connection is found that way) and reconnected. It applies when Dial's
// amqp.ConnOptions leave IdleTimeout at 0. Must be > 0. Default: 30 s.
func IdleTimeout(d time.Duration) Option {
	return optionFunc(func(c *config) {
		if d <= 0 {
			c.invalid("IdleTimeout(%v): must be > 0", d)
			return
		}
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
// IsFatal.
func FatalErrors(isFatal func(error) bool) Option {
	return optionFunc(func(c *config) {
		if isFatal == nil {
			isFatal = func(error) bool { return false }
		}
		c.isFatal = isFatal
	})
}

// OnReconnect sets a function called after the subscriber attached a new
// link in place of a lost one, with the number of attempts it took and the
// error that ended the old link. It runs on the pump's goroutine: keep it
// short. Default: none.
func OnReconnect(f func(attempts int, cause error)) Option {
	return optionFunc(func(c *config) { c.onReconnect = f })
}

// LocalRetry retries a delivery in its lane, up to n times, before a Retry
// outcome goes to the broker: attempt k waits min(max, initial·2^k) first.
// The lane does nothing else meanwhile, so the delivery's group keeps its
// order, which a broker redelivery would break. A stop or Close ends the
// waiting and sends the Retry to the broker. n ≥ 0 and 0 < initial ≤ max.
// Default: off (n = 0).
func LocalRetry(n int, initial, max time.Duration) Option {
	return optionFunc(func(c *config) {
		if n < 0 || initial <= 0 || max < initial {
			c.invalid("LocalRetry(%d, %v, %v): want n ≥ 0 and 0 < initial ≤ max", n, initial, max)
			return
		}
		c.localRetries, c.localMin, c.localMax = n, initial, max
	})
}

// MaxDeliveryCount rejects, with a reason, every delivery whose broker
// delivery count is above n before a handler sees it: a poison-message limit
// for brokers without max-delivery-attempts. RabbitMQ 3.10 always sends a
// delivery count of 0, so it has no effect there. 0 turns it off.
// Default: off.
func MaxDeliveryCount(n uint32) Option {
	return optionFunc(func(c *config) { c.maxDelivery = n })
}
