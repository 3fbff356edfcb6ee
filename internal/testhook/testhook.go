// Package testhook lets package amqpsubtest run a Subscriber on an
// in-memory source without widening amqpsub's public API: amqpsub sets the
// functions here when it is initialised, amqpsubtest calls them.
package testhook

import (
	"context"

	"github.com/amqpsub/amqpsub/internal/driver"
	"github.com/amqpsub/amqpsub/internal/wire"
)

// Attach gives a source to receive from, one call per attach (the first,
// and one after each lost link).
type Attach func(ctx context.Context) (driver.Source, error)

// Connector returns an amqpsub.Connector (as any: this package cannot
// import amqpsub) that attaches to the sources next gives instead of a
// broker; name is what String says. serviceBus says that the sources play
// Azure Service Bus: a Subscriber on the connector then takes the
// AzureServiceBus profile, as one on amqpsub.ServiceBus's connector does,
// and refuses sessions, which no source plays. Under a peek-lock profile, a
// source that also implements servicebus.Renewer renews the locks of its
// deliveries, in place of the $management node beside a broker's link.
// Under the RabbitMQ4 profile, a source with a method RabbitMQQueue() (typ
// string, deliveryLimit int64) says the queue's type, in place of the
// management node a subscriber asks at each attach; a source the
// subscriber refuses at attach is closed if it has Close(context.Context)
// error. Set by package amqpsub.
var Connector func(name string, next Attach, serviceBus bool) any

// DialWire returns an amqpsub.Connector (as any) that dials url as
// amqpsub.Dial(url, nil) does, with wire options o instead of the zero
// value: for the benchmark's side-by-side runs. Set by package amqpsub.
var DialWire func(url string, o wire.Options) any
