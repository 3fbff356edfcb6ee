package amqpsub

import (
	"context"

	"github.com/amqpsub/amqpsub/pump"
)

// WithSource makes the subscriber receive from src instead of a broker.
func WithSource(src pump.Source) Option {
	return WithSources(func(context.Context) (pump.Source, error) { return src, nil })
}

// WithSources makes the subscriber attach to the sources next gives, one
// call per attach.
func WithSources(next func(ctx context.Context) (pump.Source, error)) Option {
	return optionFunc(func(c *config) { c.testSource = next })
}
