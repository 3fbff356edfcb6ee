package servicebus

import (
	"context"

	"github.com/Azure/go-amqp"

	"github.com/amqpsub/amqpsub/internal/driver"
)

// ByTokenFunc stands in for [Dispositions] behind a [Receiver].
type ByTokenFunc func(ctx context.Context, msg *amqp.Message, o driver.Outcome, retries int) error

func (f ByTokenFunc) settle(ctx context.Context, msg *amqp.Message, o driver.Outcome, retries int) error {
	return f(ctx, msg, o, retries)
}

// SettleThrough settles msg as a [Receiver] does, with onLink in place of
// the link's settlement and fb of settlement by lock token.
func SettleThrough(ctx context.Context, msg *amqp.Message, o driver.Outcome, onLink func() error, fb ByTokenFunc) error {
	return Receiver{fb: fb}.settle(ctx, msg, o, onLink)
}

// DispositionRetries is the retry budget of a settlement.
const DispositionRetries = dispositionRetries

// SettleByToken sends o for msg through f, as a [Receiver] whose link is
// gone does, with the whole retry budget.
func SettleByToken(ctx context.Context, f *Dispositions, msg *amqp.Message, o driver.Outcome) error {
	return f.settle(ctx, msg, o, dispositionRetries)
}
