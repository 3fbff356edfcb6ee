package amqpsub

import (
	"context"
	"errors"
	"fmt"

	"github.com/amqpsub/amqpsub/internal/driver"
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

// sourceChecker is a kind that checks a test source at attach as its
// attached checks a link (rabbit4Kind: the queue's type, which may refuse
// the options). step names what failed, as attached's does.
type sourceChecker interface {
	checkSource(src driver.Source) (step string, err error)
}

// attach takes the next test source for p, and has p's kind check it. A
// source the kind refuses is closed, if it can be (as a refused link is),
// and the attach fails as a link's does: Run ends at the first attach, and
// at a reconnect if FatalErrors says so (ErrInvalidOption is fatal).
func (c sourceConnector) attach(ctx context.Context, s *Subscriber, p *pipe) (driver.Source, error) {
	src, err := c.next(ctx)
	if err != nil {
		return nil, err
	}
	if k, ok := p.kind.(sourceChecker); ok {
		if step, err := k.checkSource(src); err != nil {
			if cl, ok := src.(interface{ Close(context.Context) error }); ok {
				_ = cl.Close(ctx)
			}
			return nil, fmt.Errorf("amqpsub: %s on %s queue %q: %w", step, c, s.queue, err)
		}
	}
	return src, nil
}

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
