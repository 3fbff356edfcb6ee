package amqpsub

import (
	"context"
	"fmt"

	"github.com/amqpsub/amqpsub/internal/driver"
)

// SourceOf returns a Connector that attaches to src, on every attach,
// instead of a broker.
func SourceOf(src driver.Source) Connector { return SourcesOf(always(src)) }

// SourcesOf returns a Connector that attaches to the sources next gives,
// one call per attach.
func SourcesOf(next func(ctx context.Context) (driver.Source, error)) Connector {
	return sourceConnector{name: "a test source", next: next}
}

// SourceFor is SourceOf named as c is (its String, as the logs and errors
// name a broker), for tests of what is said about c.
func SourceFor(c Connector, src driver.Source) Connector {
	return sourceConnector{name: fmt.Sprint(c), next: always(src)}
}

// ServiceBusSourceOf is SourceOf for a source that plays Service Bus: a
// subscriber on it takes the AzureServiceBus profile (peek-lock), as one on
// ServiceBus's connector does.
func ServiceBusSourceOf(src driver.Source) Connector { return ServiceBusSourcesOf(always(src)) }

// ServiceBusSourcesOf is SourcesOf for sources that play Service Bus (see
// ServiceBusSourceOf).
func ServiceBusSourcesOf(next func(ctx context.Context) (driver.Source, error)) Connector {
	return sourceConnector{name: "a test Service Bus source", next: next, peekLock: true}
}

func always(src driver.Source) func(context.Context) (driver.Source, error) {
	return func(context.Context) (driver.Source, error) { return src, nil }
}

// PumpCredit is the credit of s's pumps, summed.
func PumpCredit(s *Subscriber) int {
	total := 0
	for _, p := range s.pipes {
		total += p.pump.Credit()
	}
	return total
}

// HandshakeHint is handshakeHint, for the tests of Dial's errors.
var HandshakeHint = handshakeHint

// AttachAndCloseLate attaches s's first pipe and closes the link with a
// context that has already ended, as a stop past its bound does.
func AttachAndCloseLate(ctx context.Context, s *Subscriber) error {
	l, err := s.attach(ctx, s.pipes[0])
	if err != nil {
		return err
	}
	ended, cancel := context.WithCancel(ctx)
	cancel()
	s.closeLink(ended, l, nil)
	return nil
}
