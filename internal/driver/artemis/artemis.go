// Package artemis is the driver for Apache ActiveMQ Artemis: source
// capability "queue", Retry as modified{delivery-failed}, message groups
// pinned to their consumer.
package artemis

import (
	"strings"

	"github.com/Azure/go-amqp"

	"github.com/amqpsub/amqpsub/internal/driver"
)

// Driver is Artemis's driver; rejectCond is the condition of a Reject.
type Driver struct {
	driver.Plain
	rejectCond amqp.ErrCond
}

// New returns Artemis's driver, rejecting with rejectCond.
func New(rejectCond amqp.ErrCond) Driver { return Driver{rejectCond: rejectCond} }

// Facts returns Artemis's facts.
func (d Driver) Facts() driver.Facts {
	return driver.Facts{
		Name:           "artemis",
		System:         "activemq",
		SourceCaps:     []string{"queue"},
		Retry:          driver.Outcome{Kind: driver.Modify, DeliveryFailed: true},
		Detach:         true,
		RejectCond:     d.rejectCond,
		PinsGroups:     true,
		DeadLetterCopy: true,
	}
}

// Claims claims a broker whose product names Artemis.
func (Driver) Claims(product, _ string) bool {
	return strings.Contains(strings.ToLower(product), "artemis")
}
