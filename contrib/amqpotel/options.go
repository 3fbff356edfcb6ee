package amqpotel

import (
	"errors"
	"fmt"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
)

// ErrInvalidOption is wrapped by the error NewMetrics returns, and by the
// value Handler and BatchHandler panic with, for an option given an
// invalid value (a nil provider, an empty system name).
var ErrInvalidOption = errors.New("amqpotel: invalid option")

// An Option configures NewMetrics, Handler or BatchHandler. Each option says
// which it applies to; the others ignore it.
type Option interface{ apply(*config) }

type optionFunc func(*config)

func (f optionFunc) apply(c *config) { f(c) }

type config struct {
	meters  metric.MeterProvider
	tracers trace.TracerProvider
	prop    propagation.TextMapPropagator
	system  string
	errs    []error
}

func (c *config) invalid(format string, args ...any) {
	c.errs = append(c.errs, fmt.Errorf("%w: "+format, append([]any{ErrInvalidOption}, args...)...))
}

// newConfig applies opts over the defaults and validates the result once.
func newConfig(opts []Option) (config, error) {
	c := config{system: "activemq"}
	for _, o := range opts {
		if o == nil {
			c.invalid("nil Option")
			continue
		}
		o.apply(&c)
	}
	if c.meters == nil {
		c.meters = otel.GetMeterProvider()
	}
	if c.tracers == nil {
		c.tracers = otel.GetTracerProvider()
	}
	if c.prop == nil {
		c.prop = propagation.TraceContext{}
	}
	return c, errors.Join(c.errs...)
}

// WithMeterProvider makes NewMetrics create its instruments with mp. nil is
// rejected. Applies to NewMetrics. Default: otel.GetMeterProvider(), read
// when NewMetrics is called.
func WithMeterProvider(mp metric.MeterProvider) Option {
	return optionFunc(func(c *config) {
		if mp == nil {
			c.invalid("WithMeterProvider(nil)")
			return
		}
		c.meters = mp
	})
}

// WithTracerProvider makes Handler and BatchHandler start their spans with
// tp. nil is rejected. Applies to Handler and BatchHandler. Default:
// otel.GetTracerProvider(), read when Handler or BatchHandler is called.
func WithTracerProvider(tp trace.TracerProvider) Option {
	return optionFunc(func(c *config) {
		if tp == nil {
			c.invalid("WithTracerProvider(nil)")
			return
		}
		c.tracers = tp
	})
}

// WithPropagator makes Handler and BatchHandler read the producer's trace
// context from a delivery's application properties with p (give a
// composite with propagation.Baggage to have baggage too). nil is
// rejected. Applies to Handler and BatchHandler. Default:
// propagation.TraceContext{} (W3C traceparent and tracestate), not the
// global propagator, since what a broker carries is the producer's choice,
// not this process's.
func WithPropagator(p propagation.TextMapPropagator) Option {
	return optionFunc(func(c *config) {
		if p == nil {
			c.invalid("WithPropagator(nil)")
			return
		}
		c.prop = p
	})
}

// WithSystem sets the spans' messaging.system: "activemq" (Artemis),
// "rabbitmq", "servicebus" or "amqp" (any other broker), the value
// amqpsub.MetricsInfo.System has for the subscriber's profile. On
// "servicebus" the settle spans take Service Bus's operation names
// (complete, abandon, dead_letter). "" is rejected. Applies to Handler and
// BatchHandler; NewMetrics takes the system from the subscriber. Default:
// "activemq", as amqpsub's default profile is Artemis.
func WithSystem(system string) Option {
	return optionFunc(func(c *config) {
		if system == "" {
			c.invalid(`WithSystem("")`)
			return
		}
		c.system = system
	})
}
