package amqpsub

import (
	"context"

	"github.com/amqpsub/amqpsub/pump"
)

// WithSource makes the subscriber receive from src instead of a broker.
func WithSource(src pump.Source) Option {
	return optionFunc(func(c *config) {
		c.testSource = func(context.Context) (pump.Source, error) { return src, nil }
	})
}
