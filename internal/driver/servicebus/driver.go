package servicebus

import (
	"time"

	"github.com/Azure/go-amqp"

	"github.com/amqpsub/amqpsub/internal/driver"
)

// Driver is Service Bus's driver: its facts, the conditions its clients
// take as fatal, the throttling wait, and its pipe (pipe.go: peek-lock,
// the lease book that renews locks, settlements by lock token once a link
// is gone, the $management node beside each link, and sessions).
type Driver struct{ driver.Plain }

// Options are Service Bus's own options (the public wrapper's), given to
// the driver as PipeConfig.Options. The zero value is not valid: start
// from DefaultOptions.
type Options struct {
	// Sessions: the subscriber is a session consumer, each pipe holding
	// one session at a time (PipeConfig.Key names it, or "" for the next
	// available).
	Sessions bool
	// MaxRenewal bounds how long after its handler began a delivery's
	// lock is still renewed (LeasesConfig.MaxRenewal).
	MaxRenewal time.Duration
	// SessionIdle is how long a session that sends nothing is kept.
	SessionIdle time.Duration
	// SettleTimeout bounds each settlement's wait for the service.
	SettleTimeout time.Duration
}

// DefaultOptions are the options' defaults: locks renewed for 5 minutes
// after a handler began (the .NET processor's
// MaxAutoLockRenewalDuration), an idle session kept 1 minute, settlements
// bounded by 30 s.
func DefaultOptions() Options {
	return Options{MaxRenewal: 5 * time.Minute, SessionIdle: time.Minute, SettleTimeout: 30 * time.Second}
}

// Facts are Service Bus's.
func (Driver) Facts() driver.Facts {
	return driver.Facts{
		Name:         "servicebus",
		System:       "servicebus",
		Retry:        driver.Outcome{Kind: driver.Modify},
		Detach:       true,
		RejectCond:   CondDeadLetter,
		PeekLock:     true,
		CountBase:    1,
		NamedReasons: true,
	}
}

// FatalCond knows com.microsoft:entity-disabled: an entity an operator
// disabled stays so until one enables it.
func (Driver) FatalCond(err error) bool { return IsCond(err, CondEntityDisabled) }

// DefaultFatal adds amqp:not-allowed: under the AzureServiceBus profile the default test of
// FatalErrors is IsFatal and amqp:not-allowed. For the two conditions
// azservicebus takes as fatal beyond IsFatal's (internal/errors.go,
// RecoveryKindFatal), on a receiver's reconnect:
//
//   - amqp:not-allowed is fatal. The .NET client turns it into an
//     InvalidOperationException (Amqp/AmqpExceptionHelper.cs), which
//     Learn's "Service Bus messaging exceptions (.NET)" describes as an
//     operation not valid for the client's configuration, mended by
//     changing its options: the same attach is refused again.
//   - amqp:resource-limit-exceeded is retried, with the backoff. On the
//     receive path it is a quota (the .NET client's QuotaExceeded): per
//     Learn's "Service Bus messaging exceptions (.NET)", too many
//     concurrent receives on the entity, or too many connections to the
//     namespace, which frees as other clients close. azservicebus's
//     entry is about a full entity, which only a sender meets; and the
//     .NET ServiceBusProcessor receives again after any receive error
//     (ServiceBusProcessor.cs), as a subscriber here reconnects.
func (Driver) DefaultFatal(err error) bool { return IsCond(err, amqp.ErrCondNotAllowed) }

// Wait is 10 s (ServerBusyWait, the ServerBusyBaseSleepTime of Microsoft's
// .NET clients) after the service said it is throttling
// (com.microsoft:server-busy, or a $management answer that wraps
// ErrServerBusy), 0 otherwise.
func (Driver) Wait(err error) time.Duration {
	if Busy(err) {
		return ServerBusyWait
	}
	return 0
}

// NewPipe returns Service Bus's pipe.
func (Driver) NewPipe(env driver.PipeEnv) driver.Pipe { return newPipe(env) }
