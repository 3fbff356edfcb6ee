package servicebus

import (
	"errors"
	"time"

	"github.com/Azure/go-amqp"

	"github.com/amqpsub/amqpsub/internal/backoff"
)

// Service Bus's error conditions.
const (
	// CondDeadLetter is the condition of a rejected outcome that the
	// service takes as "dead-letter this message".
	CondDeadLetter amqp.ErrCond = "com.microsoft:dead-letter"
	// CondEntityDisabled: an operator disabled the entity; it stays so
	// until one enables it.
	CondEntityDisabled amqp.ErrCond = "com.microsoft:entity-disabled"
	// CondServerBusy: the service is throttling.
	CondServerBusy amqp.ErrCond = "com.microsoft:server-busy"
	// CondTimeout: the service timed out; for a session receiver's
	// attach, no session became free in time.
	CondTimeout amqp.ErrCond = "com.microsoft:timeout"
	// CondSessionCannotBeLocked: the session asked for is held by another
	// receiver.
	CondSessionCannotBeLocked amqp.ErrCond = "com.microsoft:session-cannot-be-locked"
	// CondLockLost: the service answers a settlement so when the
	// delivery's lock has expired (or the message was settled).
	CondLockLost amqp.ErrCond = "com.microsoft:message-lock-lost"
)

// IsCond reports whether err is an *amqp.Error of condition cond.
func IsCond(err error, cond amqp.ErrCond) bool {
	var ae *amqp.Error
	return errors.As(err, &ae) && ae.Condition == cond
}

// Busy reports whether err says that the service is throttling: the
// condition com.microsoft:server-busy, or a $management answer that wraps
// [ErrServerBusy].
func Busy(err error) bool { return IsCond(err, CondServerBusy) || errors.Is(err, ErrServerBusy) }

// RetryWait is the wait before attempt k (from 0) after err: the jittered
// backoff between floor and ceiling, and at least [ServerBusyWait] when the
// service said it is throttling ([Busy]).
func RetryWait(err error, k int, floor, ceiling time.Duration) time.Duration {
	wait := backoff.Jittered(k, floor, ceiling)
	if Busy(err) {
		wait = max(wait, ServerBusyWait)
	}
	return wait
}
