package amqpsub

import "context"

// Handler handles one delivery at a time. Its return value settles the
// delivery:
//   - nil accepts it;
//   - Release() puts it back untouched;
//   - Reject(reason) dead-letters it;
//   - Retry(err), or any other error, puts it back as a failed attempt.
//
// A handler that panics is recovered: the panic is logged with its stack and
// the delivery is retried.
//
// ctx is cancelled when the subscriber gives up on the handler (Close, or
// the grace period of a graceful stop running out: cause [ErrStopping]),
// and on Service Bus when the delivery's lock is lost (cause
// [ErrLockLost]); the delivery's settlement is then in doubt, or not sent,
// and the broker may deliver it again.
// The [Delivery] stays valid after Handle returns.
type Handler interface {
	Handle(ctx context.Context, d *Delivery) error
}

// HandlerFunc adapts a function to a [Handler].
type HandlerFunc func(ctx context.Context, d *Delivery) error

// Handle calls f(ctx, d).
func (f HandlerFunc) Handle(ctx context.Context, d *Delivery) error { return f(ctx, d) }

// BatchHandler handles a batch of deliveries and returns one outcome for
// each, as [Handler] does for one: results[i] settles batch[i]. A nil slice
// accepts the whole batch. A slice of the wrong length, or a panic, retries
// the whole batch.
//
// With [WorkersByKey] a batch holds several groups, each in order; to keep a
// group's order, a handler that fails one of its deliveries returns a
// failure for the group's later ones as well.
//
// The slice is valid only until HandleBatch returns; the Deliveries stay
// valid.
type BatchHandler interface {
	HandleBatch(ctx context.Context, batch []*Delivery) (results []error)
}

// BatchHandlerFunc adapts a function to a [BatchHandler].
type BatchHandlerFunc func(ctx context.Context, batch []*Delivery) []error

// HandleBatch calls f(ctx, batch).
func (f BatchHandlerFunc) HandleBatch(ctx context.Context, batch []*Delivery) []error {
	return f(ctx, batch)
}
