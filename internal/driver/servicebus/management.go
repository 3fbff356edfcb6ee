package servicebus

import (
	"context"
	"errors"
	"fmt"
	"math"
	"sync/atomic"
	"time"

	"github.com/Azure/go-amqp"
)

// Management is an entity's $management node on a link's session. Its rpc
// attaches a new link pair when one dies; when that fails, the receive
// link is given up too: by AbandonLink, which the pipe's lock renewer
// calls (pipe.go, renewer), or, for a session, by Session.renew.
type Management struct {
	*rpc
	linkName string // the receive link, named in each request

	abandoned atomic.Bool // abandonLink has run
}

// lockLostStatus is the status code $management answers for a lock that
// is lost (or unknown).
const lockLostStatus = 410

// RenewLocks renews message locks ([Renewer]). Its errors are
// Request's; a 200 whose expirations are not one per token wraps
// [ErrIncomplete]. The lease book decides what each means for the
// locks.
func (m *Management) RenewLocks(ctx context.Context, tokens []amqp.UUID) ([]time.Time, error) {
	const op = "com.microsoft:renew-lock"
	resp, err := m.Request(ctx, op, map[string]any{"lock-tokens": tokens})
	if err != nil {
		return nil, err
	}
	body, _ := resp.Value.(map[string]any)
	exp, ok := body["expirations"].([]time.Time)
	if !ok || len(exp) != len(tokens) {
		return nil, fmt.Errorf("amqpsub: %s: %d expirations for %d locks: %w", op, len(exp), len(tokens), ErrIncomplete)
	}
	return exp, nil
}

// errorCondition is the errorCondition application property of a
// $management answer, which Service Bus sets on a failure ("" if none).
func errorCondition(m *amqp.Message) amqp.ErrCond {
	switch v := m.ApplicationProperties["errorCondition"].(type) {
	case amqp.Symbol:
		return amqp.ErrCond(v)
	case string:
		return amqp.ErrCond(v)
	}
	return ""
}

// Request sends operation with body and returns the answer, or an error:
//
//   - a *statusError for an answer that is not a success, wrapping
//     [ErrLockLost] for status 410, [ErrBadRequest] for 400, and
//     [ErrServerBusy] for 503 or an errorCondition of
//     com.microsoft:server-busy (the .NET client maps both to ServiceBusy);
//   - one wrapping [ErrNodeGone] when the $management link pair is gone for
//     good;
//   - or the link's error.
//
// ctx bounds it; when ctx ends first, the operation is in doubt.
func (m *Management) Request(ctx context.Context, operation string, body map[string]any) (*amqp.Message, error) {
	props := map[string]any{"operation": operation}
	if m.linkName != "" {
		// None for a node that serves no receive link of its connection
		// (the stop node, pipe.stopNode).
		props["associated-link-name"] = m.linkName
	}
	if dl, ok := ctx.Deadline(); ok {
		props["com.microsoft:server-timeout"] = millis32(time.Until(dl))
	}
	resp, err := m.call(ctx, &amqp.Message{Value: body, ApplicationProperties: props})
	if err != nil {
		return nil, err
	}
	code, desc := status(resp)
	if code >= 200 && code < 300 {
		return resp, nil
	}
	e := &statusError{op: operation, code: code, desc: desc}
	switch {
	case code == lockLostStatus:
		e.kind = ErrLockLost
	case code == 400:
		e.kind = ErrBadRequest
	case code == 503 || errorCondition(resp) == CondServerBusy:
		e.kind = ErrServerBusy
	}
	return nil, e
}

// statusError is a $management answer with a status that is not a
// success; kind, when not nil, is the sentinel it wraps.
type statusError struct {
	op   string
	code int
	desc string
	kind error
}

func (e *statusError) Error() string {
	if e.kind != nil {
		return fmt.Sprintf("amqpsub: %s: status %d: %s: %v", e.op, e.code, e.desc, e.kind)
	}
	return fmt.Sprintf("amqpsub: %s: status %d: %s", e.op, e.code, e.desc)
}

func (e *statusError) Unwrap() error { return e.kind }

// transientStatus reports whether a $management request that failed with
// err may succeed if sent again: the service was busy (503), failed
// inside (500), or timed out (408), as azservicebus retries them
// (internal/errors.go).
func transientStatus(err error) bool {
	var se *statusError
	if !errors.As(err, &se) {
		return false
	}
	switch se.code {
	case 408, 500, 503:
		return true
	}
	return errors.Is(se, ErrServerBusy)
}

// AbandonLink closes rcv, the receive link the node serves, once its
// $management link pair is gone for good: no lock of it can be renewed any
// more, so the pump is made to attach both anew (held deliveries are
// redelivered by the service). ctx bounds the wait for the service's
// answer; the link is closing either way. It reports whether this call
// closed it (false after the first).
func (m *Management) AbandonLink(ctx context.Context, rcv *amqp.Receiver) bool {
	if rcv == nil || !m.abandoned.CompareAndSwap(false, true) {
		return false
	}
	_ = rcv.Close(ctx)
	return true
}

// millis32 is d in whole milliseconds as an AMQP uint, clamped to its range
// (a negative d is 0; past 49 days, the most a uint holds).
func millis32(d time.Duration) uint32 {
	ms := max(0, d/time.Millisecond)
	if ms > math.MaxUint32 {
		return math.MaxUint32
	}
	return uint32(ms)
}

// NewManagement attaches the link pair to the $management node of the
// entity at address on sess, within ctx. linkName is the receive link the
// node serves, named in every request.
//
// The node is address + "/$management" for every entity, a dead-letter
// queue ("<entity>/$DeadLetterQueue/$management") included: a lock is
// known only to the node of the entity it came from, as azservicebus
// attaches a dead-letter receiver's node (receiver.go builds the path,
// internal/amqpLinks.go appends "/$management").
func NewManagement(ctx context.Context, sess *amqp.Session, address, linkName string) (*Management, error) {
	r, err := newRPC(ctx, sess, ManagementNode(address))
	if err != nil {
		return nil, err
	}
	return &Management{rpc: r, linkName: linkName}, nil
}

// ManagementNode is the address of the $management node of the entity at
// address (see [NewManagement]).
func ManagementNode(address string) string { return address + "/$management" }

// Done is closed when the node's link pair is gone for good (it ends with
// the AMQP session).
func (m *Management) Done() <-chan struct{} { return m.done }

// Pair returns the node's current link pair (nil, nil while none is
// attached): for tests that close one of its links under the node, as a
// detach by the service ends it.
func (m *Management) Pair() (*amqp.Sender, *amqp.Receiver) {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.snd, m.rcv
}
