package amqpsub

import (
	"errors"

	"github.com/Azure/go-amqp"

	"github.com/amqpsub/amqpsub/internal/driver"
	"github.com/amqpsub/amqpsub/internal/driver/servicebus"
	"github.com/amqpsub/amqpsub/internal/wire"
)

// IsFatal is the default test of [FatalErrors]. It takes as fatal what
// reconnecting cannot mend:
//
//   - the broker refusing the credentials (a SASL outcome of auth or
//     sys-perm, whatever the mechanism) or access
//     (amqp:unauthorized-access);
//   - an address that does not exist (amqp:not-found);
//   - a link the broker will not attach as asked (amqp:invalid-field,
//     amqp:not-implemented, and amqp:illegal-state, which Artemis sends for
//     capability "queue" on a multicast address);
//   - a connection given with [Conn] that is gone ([ErrLinkLost]);
//   - a connector given something it cannot use (ErrInvalidOption: a
//     Service Bus token without an expiry, say).
//
// Lost connections, links and sessions, timeouts and refused TCP
// connections are not fatal.
//
// It judges the errors of attempts to reconnect (any error of the first
// attach ends Run), and with [DialFailover] each address's error in a pass
// (a fatal one ends the pass and Run, on the first attach too), never what
// ended a link: a link Service Bus detaches with amqp:unauthorized-access
// when its token expired is reconnected (with a new token); a reconnect
// refused so ends Run.
//
// On Service Bus it takes as fatal what azservicebus does (the recovery
// kinds of its internal/errors.go): amqp:unauthorized-access, a
// missing entity (amqp:not-found, which is how the service refuses an
// attach to an entity that does not exist; see [WaitForQueue] to wait for
// one instead), and com.microsoft:entity-disabled (an entity an operator
// disabled stays so until one enables it). com.microsoft:server-busy is
// not fatal: the service is throttling, and the next attempt waits at
// least 10 s; com.microsoft:timeout is not fatal either. Under the
// [AzureServiceBus] profile the default test is IsFatal and
// amqp:not-allowed (an attach the entity does not allow), which
// azservicebus takes as fatal too; amqp:resource-limit-exceeded, which it
// also takes as fatal, is retried there: on a receiver's reconnect it is a
// quota of receivers or connections that frees as other clients close (see
// docs/brokers.md for the sources).
func IsFatal(err error) bool {
	var ae *amqp.Error
	if errors.As(err, &ae) {
		switch ae.Condition {
		case amqp.ErrCondUnauthorizedAccess, amqp.ErrCondNotFound,
			amqp.ErrCondInvalidField, amqp.ErrCondNotImplemented, amqp.ErrCondIllegalState:
			return true
		}
		if knownFatal(err) {
			return true
		}
	}
	var se *wire.SASLError
	if errors.As(err, &se) {
		// sys and sys-temp are the peer's own trouble: try again.
		return se.Code == wire.SASLAuth || se.Code == wire.SASLSysPerm
	}
	return errors.Is(err, ErrLinkLost) || errors.Is(err, ErrInvalidOption)
}

func isNotFound(err error) bool { return isCond(err, amqp.ErrCondNotFound) }

func isCond(err error, cond amqp.ErrCond) bool {
	var ae *amqp.Error
	return errors.As(err, &ae) && ae.Condition == cond
}

// ErrStopping is the cause (context.Cause) of a handler's context cancelled
// by a stop: the grace period ran out, Close was called, or attaching failed
// for good. A handler tells it from a lost lock ([ErrLockLost], on
// Service Bus) this way; its result is ignored.
var ErrStopping = errors.New("amqpsub: the subscriber is stopping")

// Errors Run returns.
var (
	// ErrClosed is returned by Run when the [Subscriber] was already run, or
	// closed or shut down before Run.
	ErrClosed = errors.New("amqpsub: subscriber closed")
	// ErrLinkLost is wrapped by the error Run returns when a lost link or
	// connection could not be replaced: reconnecting failed with an error
	// [FatalErrors] calls fatal, or the connection given with [Conn] is gone.
	// A lost link that can be replaced is replaced, and Run goes on.
	ErrLinkLost = errors.New("amqpsub: link lost")
	// ErrAbandoned is wrapped by the error Run returns when handlers had
	// not returned by the end of the stop (the grace period, then
	// [CloseTimeout]); the error says how many. Their context was cancelled,
	// their results are ignored, and the broker redelivers their
	// deliveries. It is also wrapped when an [OnReconnect] function had not
	// returned by then.
	ErrAbandoned = errors.New("amqpsub: handlers abandoned")
)

// The causes of a handler's failure or of its cancelled context.
var (
	// ErrLockLost is the cause (context.Cause) of a handler's context
	// cancelled because the Service Bus lock of its delivery (or session)
	// was lost; its settlement is then not sent.
	ErrLockLost = servicebus.ErrLockLost
	// ErrHandlerPanic is wrapped by the error a handler's panic becomes
	// (logged, and passed to [OnEvent]); the delivery is retried.
	ErrHandlerPanic = errors.New("amqpsub: handler panicked")
)

// ErrInvalidOption is wrapped by the error [New] and [NewBatch] return for an
// option with a value out of range or an option that does not fit the
// subscriber (such as [Batch] with a plain [Handler]), and by the error
// [DialFailover] and [ServiceBusWithToken] return for addresses they cannot
// use.
var ErrInvalidOption = errors.New("amqpsub: invalid option")

// ErrBodyKind is returned (wrapped) by [Delivery.Body], Value and Sequence
// when the message's body is of another kind; the message says which.
var ErrBodyKind = errors.New("amqpsub: body is of another kind")

// ErrNotSettled is what [Recorder.Settled] and a [Delivery]'s OnSettled
// function hear of a settlement that was not sent, because the delivery's
// link (or, on Service Bus, its lock) was lost while a handler had it. The
// broker delivers the message again.
var ErrNotSettled = driver.ErrNotSent

// ErrCondDeadLetter is the error condition of a rejected outcome that
// Service Bus takes as "dead-letter this message".
const ErrCondDeadLetter = servicebus.CondDeadLetter

// ErrConnectionString is wrapped by the error [ServiceBus] returns for a
// connection string it cannot use. The error names the key at fault and
// quotes none of the string's values: any of them may hold the key, when
// the ';' between two is missing.
var ErrConnectionString = servicebus.ErrConnectionString

// ErrNoSession is returned by [Delivery.SessionState] and SetSessionState
// for a delivery that did not come through a session consumer ([Sessions],
// [SessionIDs]), or whose session the consumer no longer holds.
var ErrNoSession = errors.New("amqpsub: the delivery's session is not held")
