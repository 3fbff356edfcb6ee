package driver

import (
	"strconv"
	"strings"
	"time"

	"github.com/Azure/go-amqp"
)

// Facts are what a broker's driver says of its broker, fixed for the
// driver's life. The core reads them where it would otherwise name a
// broker.
type Facts struct {
	// Name is the profile's name (Profile.String), for logs.
	Name string
	// System is the messaging.system value of the subscriber's metrics.
	System string
	// SourceCaps are sent as the source capabilities at attach (and as
	// the target capabilities of a dead-letter copy's sender).
	SourceCaps []string
	// Retry is how a Retry outcome is settled.
	Retry Outcome
	// Windowed: the credit is granted in windows, since the broker sends
	// past its credit; otherwise it is granted continuously.
	Windowed bool
	// Detach says whether the broker answers a link detach; if not, the
	// session is closed instead.
	Detach bool
	// DrainRequeues: a drain (a flow with drain set) makes the broker
	// requeue every delivery the link holds unsettled, also those in
	// handlers, which another consumer then gets while they run. The
	// credit is then never drained: a stop only stops granting it.
	DrainRequeues bool
	// RejectCond is the condition of a Reject outcome's error.
	RejectCond amqp.ErrCond
	// PeekLock: receiver settle mode second, settlements answered by the
	// broker, message locks renewed.
	PeekLock bool
	// CountBase is added to the AMQP delivery-count to give the count
	// MaxDeliveryCount(n) holds to n.
	CountBase uint32
	// NamedReasons: a dead-letter made before a handler ran carries a
	// reason code as its reason and what happened as its description.
	NamedReasons bool
	// PinsGroups: the broker gives every delivery of a group-id to the
	// consumer that took its first, and stops its dispatch at a group
	// whose consumer has no credit.
	PinsGroups bool
	// DeadLetterCopy: the broker drops a rejection's reason, so the
	// DeadLetterCopy option may send a copy that keeps it.
	DeadLetterCopy bool
	// AnyBroker: the profile fits every broker, so the core does not
	// suggest another from the broker's open frame.
	AnyBroker bool
}

// Driver is one broker's side of the only seam between the core and a
// broker. The core calls exactly these methods: Facts once, as the
// profile is made; Address whenever it needs the queue's address (the
// attach, its log line, a dead-letter copy's annotations); Claims of every
// driver the package knows, as a link is attached, to suggest a better
// profile; FatalCond of every driver the package knows, in IsFatal;
// DefaultFatal in the default FatalErrors test; Wait after every failed
// attach and every lost link; and NewPipe once per pipe, whose Pipe it
// then calls as Pipe's doc says. A driver imports nothing of the core or
// the engine: it reaches them only through the interfaces of this package
// (PipeEnv, EngineEnv, Link, Source, Leases).
type Driver interface {
	// Facts returns the broker's static facts.
	Facts() Facts
	// Address maps a queue name to the link's source address.
	Address(queue string) string
	// Claims reports whether the broker that names itself product,
	// version in its open frame is this driver's.
	Claims(product, version string) bool
	// FatalCond reports whether err carries a condition of this broker's own
	// that no retry mends (IsFatal asks every driver).
	FatalCond(err error) bool
	// DefaultFatal reports whether err is fatal under this driver's
	// profile beyond IsFatal, when FatalErrors is not given.
	DefaultFatal(err error) bool
	// Wait is the least wait after err before the next attach: the
	// broker said it is throttling. 0 otherwise.
	Wait(err error) time.Duration
	// NewPipe returns what the driver adds to the links of one pipe
	// (Base for nothing).
	NewPipe(env PipeEnv) Pipe
}

// MismatchError says the queue does not fit an option the subscriber was
// given (the core reports it as an invalid option).
type MismatchError struct{ Detail string }

func (e *MismatchError) Error() string { return e.Detail }

// Plain is a Driver's part that adds nothing to a pipe, claims no broker
// and knows no condition: a driver embeds it and overrides what it adds.
type Plain struct{}

// Claims claims no broker.
func (Plain) Claims(string, string) bool { return false }

// FatalCond knows no condition.
func (Plain) FatalCond(error) bool { return false }

// DefaultFatal adds nothing to IsFatal.
func (Plain) DefaultFatal(error) bool { return false }

// Wait asks for no wait.
func (Plain) Wait(error) time.Duration { return 0 }

// NewPipe returns a pipe part that adds nothing (Base).
func (Plain) NewPipe(PipeEnv) Pipe { return Base{} }

// Address uses the queue name as the address.
func (Plain) Address(q string) string { return q }

// MajorVersion is the major version of a version string an open frame
// gives ("4.1.0-rc.1": 4), 0 when it has none.
func MajorVersion(version string) int {
	major, _, _ := strings.Cut(version, ".")
	n, err := strconv.Atoi(major)
	if err != nil {
		return 0
	}
	return n
}
