package driver

import (
	"context"
	"errors"

	"github.com/Azure/go-amqp"
)

// Source is the set of receiver calls the engine makes. *amqp.Receiver
// implements it; a broker's driver may wrap it, and tests and benchmarks
// use a fake.
//
// A source that settles a delivery with another outcome than the one it
// was asked for (a release the broker can only take as modified, say)
// returns its answer wrapped by [SentAs]: the engine counts and reports
// the outcome that went out.
type Source interface {
	Receive(ctx context.Context, opts *amqp.ReceiveOptions) (*amqp.Message, error)
	IssueCredit(credit uint32) error
	AcceptMessage(ctx context.Context, msg *amqp.Message) error
	ReleaseMessage(ctx context.Context, msg *amqp.Message) error
	RejectMessage(ctx context.Context, msg *amqp.Message, e *amqp.Error) error
	ModifyMessage(ctx context.Context, msg *amqp.Message, opts *amqp.ModifyMessageOptions) error
}

// ErrSourceDone says, wrapped by a source's Receive error, that the source
// ended as it should (a session whose consumer moves on, say), not that
// its link was lost: the engine attaches the next one without counting a
// loss. A source should end so only when nothing of it is held.
var ErrSourceDone = errors.New("driver: source done")
