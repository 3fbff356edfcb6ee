// Package shapes is the table of subscriber shapes that tests run over:
// every lane mode ([Lanes]), every broker profile as amqpsubtest plays it
// ([Profiles]) and the workloads that place groups on the lanes
// ([Workloads]). A behaviour that can depend on the shape is tested on
// every combination, not on one example.
//
// The table describes; it runs nothing. A test builds its queue with
// [Profile.QueueOptions], its subscriber with [Profile.Options] and
// [Lane.Options] (and [NewBatch] when [Lane.Batch] is set), publishes the
// group-ids [Workload.Groups] gives, and names its subtests
// profile/lanes/workload, such as artemis/WorkersByKey(4)/keyless.
//
// [NewBatch]: github.com/amqpsub/amqpsub/amqpsub.NewBatch
package shapes

import (
	"fmt"
	"math/rand/v2"
	"time"

	"github.com/amqpsub/amqpsub/amqpsub"
	"github.com/amqpsub/amqpsub/amqpsubtest"
)

// Lane is a lane mode: how deliveries are placed on handlers.
type Lane struct {
	// Name names the mode in a subtest: the options as a user writes
	// them, such as WorkersByKey(4)+BalanceKeys.
	Name string
	// Workers is the number of lanes (Workers or WorkersByKey).
	Workers int
	// ByKey: WorkersByKey, a group's deliveries one at a time in order;
	// otherwise Workers, no order.
	ByKey bool
	// Balanced: BalanceKeys, groups placed by load from a shared pool;
	// otherwise a group's lane is the hash of its group-id.
	Balanced bool
	// Batch is the batch size of a BatchHandler (Batch(Batch, BatchWait));
	// 0 for a Handler, one delivery at a time.
	Batch     int
	BatchWait time.Duration
	// LocalRetry is the retry policy in the lane; zero: off.
	LocalRetry amqpsub.RetryPolicy
	// MaxHeldBytes is the byte budget; 0: off.
	MaxHeldBytes int64
}

// Options returns the subscriber options of the mode.
func (l Lane) Options() []amqpsub.Option {
	var o []amqpsub.Option
	if l.ByKey {
		o = append(o, amqpsub.WorkersByKey(l.Workers))
	} else {
		o = append(o, amqpsub.Workers(l.Workers))
	}
	if l.Balanced {
		o = append(o, amqpsub.BalanceKeys())
	}
	if l.Batch > 0 {
		o = append(o, amqpsub.Batch(l.Batch, l.BatchWait))
	}
	if l.Retries() {
		o = append(o, amqpsub.LocalRetry(l.LocalRetry))
	}
	if l.MaxHeldBytes > 0 {
		o = append(o, amqpsub.MaxHeldBytes(l.MaxHeldBytes))
	}
	return o
}

// Retries reports whether the mode retries in its lanes (LocalRetry).
func (l Lane) Retries() bool { return l.LocalRetry != amqpsub.RetryPolicy{} }

// Need is what a lane takes at once: a delivery, or a batch with a
// BatchHandler (the credit's floor per lane, with the default Credit).
func (l Lane) Need() int { return max(1, l.Batch) }

// Floor is the least the adaptive credit holds: Need per lane.
func (l Lane) Floor() int { return l.Workers * l.Need() }

// Ordered reports whether the mode keeps each group's order.
func (l Lane) Ordered() bool { return l.ByKey }

// Profile is a broker profile as amqpsubtest plays it.
type Profile struct {
	// Name names the profile in a subtest, such as rabbitmq4-quorum.
	Name string
	// Profile is the subscriber's profile.
	Profile amqpsub.Profile
	// QueueOptions make the queue play the broker.
	QueueOptions []amqpsubtest.Option
	// Options are the subscriber's options for the broker: its profile,
	// except on Service Bus, whose queue's Connector gives it.
	Options []amqpsub.Option
	// PinsGroups: the broker binds a group to one consumer (Artemis,
	// Generic; Service Bus with sessions), so that a group's backlog held
	// here is not one other replicas could take. Where it is false
	// (RabbitMQ, Service Bus without sessions) any replica could.
	PinsGroups bool
}

// Profiles returns every profile amqpsubtest plays. Service Bus with
// sessions is not among them: amqpsubtest plays no sessions.
func Profiles() []Profile {
	return []Profile{
		{Name: "artemis", Profile: amqpsub.Artemis, PinsGroups: true},
		{
			Name: "rabbitmq3", Profile: amqpsub.RabbitMQ3,
			QueueOptions: []amqpsubtest.Option{amqpsubtest.WithProfile(amqpsub.RabbitMQ3)},
			Options:      []amqpsub.Option{amqpsub.WithProfile(amqpsub.RabbitMQ3)},
		},
		{
			Name: "rabbitmq4-quorum", Profile: amqpsub.RabbitMQ4,
			QueueOptions: []amqpsubtest.Option{amqpsubtest.WithProfile(amqpsub.RabbitMQ4), amqpsubtest.WithQueueType(amqpsubtest.Quorum)},
			Options:      []amqpsub.Option{amqpsub.WithProfile(amqpsub.RabbitMQ4)},
		},
		{
			Name: "rabbitmq4-classic", Profile: amqpsub.RabbitMQ4,
			QueueOptions: []amqpsubtest.Option{amqpsubtest.WithProfile(amqpsub.RabbitMQ4), amqpsubtest.WithQueueType(amqpsubtest.Classic)},
			Options:      []amqpsub.Option{amqpsub.WithProfile(amqpsub.RabbitMQ4)},
		},
		{
			Name: "servicebus", Profile: amqpsub.AzureServiceBus,
			QueueOptions: []amqpsubtest.Option{amqpsubtest.WithProfile(amqpsub.AzureServiceBus)},
		},
	}
}

// Workers is the number of lanes of every mode in [Lanes].
const Workers = 4

// BatchSize is the batch size of the modes with a BatchHandler. It is
// small, so that the floor (Workers × BatchSize) stays far below the
// default Credit and the credit's adaptive part shows.
const BatchSize = 4

// Retry is the LocalRetry policy of the modes that retry in the lane.
var Retry = amqpsub.RetryPolicy{Attempts: 3, Initial: 10 * time.Millisecond}

// HeldBytes is the byte budget of the modes with MaxHeldBytes: 64
// deliveries of [BodySize] bytes, a quarter of the default Credit.
const HeldBytes = 64 * BodySize

// BodySize is the body size a test that uses the MaxHeldBytes modes
// should publish, so that the budget means 64 deliveries.
const BodySize = 8

// Lanes returns every lane mode: Workers, WorkersByKey (hash placement)
// and WorkersByKey with BalanceKeys, each with a Handler and with a
// BatchHandler, with LocalRetry and with MaxHeldBytes; each with [Workers]
// lanes.
func Lanes() []Lane {
	base := []Lane{
		{Name: fmt.Sprintf("Workers(%d)", Workers), Workers: Workers},
		{Name: fmt.Sprintf("WorkersByKey(%d)", Workers), Workers: Workers, ByKey: true},
		{Name: fmt.Sprintf("WorkersByKey(%d)+BalanceKeys", Workers), Workers: Workers, ByKey: true, Balanced: true},
	}
	var all []Lane
	for _, variant := range []struct {
		suffix string
		set    func(*Lane)
	}{
		{"", func(*Lane) {}},
		{fmt.Sprintf("+Batch(%d,10ms)", BatchSize), func(l *Lane) { l.Batch, l.BatchWait = BatchSize, 10*time.Millisecond }},
		{"+LocalRetry", func(l *Lane) { l.LocalRetry = Retry }},
		{"+MaxHeldBytes", func(l *Lane) { l.MaxHeldBytes = HeldBytes }},
	} {
		for _, l := range base {
			l.Name += variant.suffix
			variant.set(&l)
			all = append(all, l)
		}
	}
	return all
}

// Workload is how a test's messages are grouped.
type Workload struct {
	// Name names the workload in a subtest.
	Name string
	// Groups returns the group-id of each of n messages, in publish
	// order; "" is no group-id. The same n gives the same groups.
	Groups func(n int) []string
	// Repeats: a group has more than one message, so that its later
	// messages can wait behind its earlier ones.
	Repeats bool
	// Skewed: one group has a large share of the messages, so that its
	// backlog waits behind it on its lane whatever the lanes' pace.
	Skewed bool
}

// Workloads returns the workloads: keyless; 100 groups taken in turn
// (uniform, each group's messages 100 apart); one group per message; and
// 100 groups drawn from a Zipf distribution (s = 1.1, so the commonest
// group has about a fifth of the messages), with a fixed seed.
func Workloads() []Workload {
	return []Workload{
		{Name: "keyless", Groups: func(n int) []string { return make([]string, n) }},
		{Name: "uniform100", Repeats: true, Groups: func(n int) []string {
			g := make([]string, n)
			for i := range g {
				g[i] = fmt.Sprintf("g%02d", i%100)
			}
			return g
		}},
		{Name: "onePerMessage", Groups: func(n int) []string {
			g := make([]string, n)
			for i := range g {
				g[i] = fmt.Sprintf("m%d", i)
			}
			return g
		}},
		{Name: "zipf100", Repeats: true, Skewed: true, Groups: func(n int) []string {
			z := rand.NewZipf(rand.New(rand.NewPCG(1, 2)), 1.1, 1, 99) //nolint:gosec // G404: a fixed test workload, not a secret
			g := make([]string, n)
			for i := range g {
				g[i] = fmt.Sprintf("z%02d", z.Uint64())
			}
			return g
		}},
	}
}
