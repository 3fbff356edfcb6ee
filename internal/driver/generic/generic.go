// Package generic is the driver that assumes only the AMQP 1.0
// specification: Artemis's settings but for the source capability, which
// other brokers may not know.
package generic

import (
	"github.com/Azure/go-amqp"

	"github.com/amqpsub/amqpsub/internal/driver"
)

// Driver is the generic driver; rejectCond is the condition of a Reject.
type Driver struct {
	driver.Plain
	rejectCond amqp.ErrCond
}

// New returns the generic driver, rejecting with rejectCond.
func New(rejectCond amqp.ErrCond) Driver { return Driver{rejectCond: rejectCond} }

// Facts returns the generic facts.
func (d Driver) Facts() driver.Facts {
	return driver.Facts{
		Name:           "generic",
		System:         "amqp",
		Retry:          driver.Outcome{Kind: driver.Modify, DeliveryFailed: true},
		Detach:         true,
		RejectCond:     d.rejectCond,
		PinsGroups:     true,
		DeadLetterCopy: true,
		AnyBroker:      true,
	}
}
