// Package rabbitmq3 is the driver for RabbitMQ 3.x with the
// rabbitmq_amqp1_0 plugin: /amq/queue/ addresses, Retry as released (the
// broker ends the session on modified), credit in windows, no link detach
// (the broker does not answer one), and no drain (the broker requeues what
// the link holds unsettled on one).
package rabbitmq3

import (
	"strings"

	"github.com/Azure/go-amqp"

	"github.com/amqpsub/amqpsub/internal/driver"
)

// Driver is RabbitMQ 3's driver; rejectCond is the condition of a Reject.
type Driver struct {
	driver.Plain
	rejectCond amqp.ErrCond
}

// New returns RabbitMQ 3's driver, rejecting with rejectCond.
func New(rejectCond amqp.ErrCond) Driver { return Driver{rejectCond: rejectCond} }

// Facts returns RabbitMQ 3's facts.
func (d Driver) Facts() driver.Facts {
	return driver.Facts{
		Name:       "rabbitmq3",
		System:     "rabbitmq",
		Retry:      driver.Outcome{Kind: driver.Release},
		Windowed:   true,
		RejectCond: d.rejectCond,
		// Measured on 3.10.8: after a drain a second consumer gets the
		// deliveries the first still holds unsettled, and without one it
		// does not (integration's TestRabbitMQStopHandsBufferedToAnotherConsumer).
		DrainRequeues: true,
	}
}

// Address maps q to /amq/queue/q; a name that starts with "/" is used as
// it is.
func (Driver) Address(q string) string {
	if len(q) > 0 && q[0] == '/' {
		return q
	}
	return "/amq/queue/" + q
}

// Claims claims RabbitMQ below major version 4.
func (Driver) Claims(product, version string) bool {
	return strings.EqualFold(product, "rabbitmq") && driver.MajorVersion(version) < 4
}
