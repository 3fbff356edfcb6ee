package amqpsub

import (
	"context"
	"errors"

	"github.com/amqpsub/amqpsub/internal/testhook"
	"github.com/amqpsub/amqpsub/internal/wire"
)

func init() {
	testhook.Connector = func(name string, next testhook.Attach, serviceBus bool) any {
		return sourceConnector{name: name, next: next, serviceBus: serviceBus}
	}
	testhook.DialWire = func(url string, o wire.Options) any { return &dialer{url: url, wire: o} }
}

// sourceConnector stands in for a broker: package amqpsubtest gives the
// subscriber in-memory sources through it.
type sourceConnector struct {
	name string
	next testhook.Attach
	// serviceBus: the sources play Service Bus, so the subscriber takes
	// the AzureServiceBus profile (see build).
	serviceBus bool
}

func (sourceConnector) connect(context.Context, connectRequest) (*connection, error) {
	return nil, errors.New("amqpsub: a source connector has no connection")
}

func (c sourceConnector) String() string { return c.name }

// validate: sources that play Service Bus take the AzureServiceBus profile,
// and play no sessions.
func (c sourceConnector) validate(cfg *config, _ string) {
	if !c.serviceBus {
		return
	}
	serviceBusProfile(cfg)
	if cfg.sessions() {
		cfg.invalid("Sessions and SessionIDs: %s does not play Service Bus sessions", c)
	}
}
