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
	testhook.Connector = func(name string, next testhook.Attach, peekLock bool) any {
		return sourceConnector{name: name, next: next, peekLock: peekLock}
	}
	testhook.DialWire = func(url string, o wire.Options) any { return &dialer{url: url, wire: o} }
}

// sourceConnector stands in for a broker: package amqpsubtest gives the
// subscriber in-memory sources through it.
type sourceConnector struct {
	name string
	next testhook.Attach
	// peekLock: the sources play a peek-lock broker, so the subscriber
	// takes its profile (see validate).
	peekLock bool
}

func (sourceConnector) connect(context.Context, connectRequest) (*connection, error) {
	return nil, errors.New("amqpsub: a source connector has no connection")
}

func (c sourceConnector) String() string { return c.name }

// attach takes the next test source for p, and has p's driver check it. A
// source the driver refuses is closed, if it can be (as a refused link is),
// and the attach fails as a link's does: Run ends at the first attach, and
// at a reconnect if FatalErrors says so (ErrInvalidOption is fatal).
func (c sourceConnector) attach(ctx context.Context, s *Subscriber, p *pipe) (driver.Source, error) {
	src, err := c.next(ctx)
	if err != nil {
		return nil, err
	}
	if step, err := p.dp.CheckSource(src); err != nil {
		err = mismatch(err)
		if cl, ok := src.(interface{ Close(context.Context) error }); ok {
			_ = cl.Close(ctx)
		}
		return nil, fmt.Errorf("amqpsub: %s on %s queue %q: %w", step, c, s.queue, err)
	}
	return src, nil
}

// validate: sources that play a peek-lock broker take its profile, and
// play no sessions.
func (c sourceConnector) validate(cfg *config, _ string) {
	if !c.peekLock {
		return
	}
	peekLockProfile(cfg)
	if len(cfg.slots) > 0 {
		cfg.invalid("Sessions and SessionIDs: %s does not play Service Bus sessions", c)
	}
}
