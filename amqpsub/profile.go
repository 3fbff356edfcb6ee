package amqpsub

import (
	"github.com/Azure/go-amqp"

	"github.com/amqpsub/amqpsub/internal/driver"
)

// Profile holds what differs between brokers on the wire: a broker's
// driver (package internal/driver), and the facts it gives. Use one of
// [Artemis], [RabbitMQ4], [RabbitMQ3], [AzureServiceBus] or [Generic];
// each is declared in the file of its broker.
type Profile struct {
	drv driver.Driver
	// f is drv's facts, read once.
	f driver.Facts
}

// String returns the profile's name.
func (p Profile) String() string { return p.f.Name }

// newProfile returns the profile of d.
func newProfile(d driver.Driver) Profile { return Profile{drv: d, f: d.Facts()} }

// known are the package's profiles, each added by its broker's file: IsFatal
// asks their drivers, and an attach suggests the one whose driver claims
// the broker.
var known []Profile

// profileFor names the profile for a broker that calls itself product,
// version in its open frame, "" when it is none amqpsub knows.
func profileFor(product, version string) string {
	for _, p := range known {
		if p.drv.Claims(product, version) {
			return p.String()
		}
	}
	return ""
}

// knownFatal reports whether a known driver takes err as fatal.
func knownFatal(err error) bool {
	for _, p := range known {
		if p.drv.FatalCond(err) {
			return true
		}
	}
	return false
}

// defaultFatal is the default test of FatalErrors under p.
func (p Profile) defaultFatal() func(error) bool {
	d := p.drv
	return func(err error) bool { return IsFatal(err) || d.DefaultFatal(err) }
}

// unhandledReject is the Reject of a delivery dead-lettered before a
// handler ran: reason is the code a profile with namedReasons gives,
// detail what happened, cond the condition elsewhere ("" for the
// profile's).
func (p Profile) unhandledReject(reason, detail string, cond amqp.ErrCond) *OutcomeError {
	if p.f.NamedReasons {
		oe := &OutcomeError{kind: ResultReject, poisoned: true, reason: reason, description: detail}
		if !p.f.PeekLock {
			// Service Bus dead-letters by its own condition; elsewhere
			// the condition says what happened.
			oe.cond = cond
		}
		return oe
	}
	return &OutcomeError{kind: ResultReject, poisoned: true, reason: detail, cond: cond}
}

// system returns the messaging.system value of a profile.
func (p Profile) system() string { return p.f.System }
