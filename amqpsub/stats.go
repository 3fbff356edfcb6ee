package amqpsub

import (
	"fmt"
	"strconv"
	"time"

	"go.uber.org/zap/zapcore"

	"github.com/amqpsub/amqpsub/internal/driver"
	"github.com/amqpsub/amqpsub/internal/pump"
)

// Stats are a [Subscriber]'s counters: totals since [New], and a census of the
// deliveries the process holds now.
type Stats struct {
	// Held is the number of deliveries held in the process now: waiting in
	// the pump's channel, in a lane, in a handler, or waiting for their
	// settlement. It stays within the credit on a broker that keeps within
	// the credit it was given (Artemis does; RabbitMQ 3.10 overshoots, see
	// Overshoot).
	Held int
	// MaxHeld is the most deliveries held at once (a session consumer: the
	// sum of each session link's most).
	MaxHeld int
	// Buffered, Handling and Settling are a census of the held deliveries:
	// waiting for a handler, in one, and waiting for the pump to send their
	// settlement. It is taken delivery by delivery while the subscriber
	// runs, so its sum is Held give or take the deliveries that moved
	// meanwhile.
	Buffered, Handling, Settling int
	// BytesHeld is the size of the bodies held now, MaxBytesHeld the most
	// at once (see [MaxHeldBytes]; counted with or without it).
	BytesHeld, MaxBytesHeld int64
	// Credit is the credit now: what the subscriber grants the broker up
	// to (held and outstanding). It follows demand between its floor and
	// CreditLimit, the [Credit] option (a session consumer: the sum of its
	// session links', each with its share of Credit), unless [FixedCredit]
	// holds it there; a byte budget ([MaxHeldBytes]) lowers it too. It is
	// recomputed after each event of a link and every 10 ms while anything
	// is held. Lowered, it takes nothing back: Held stays above it until
	// what was granted is spent. RoundTrip is the round trip measured, from
	// a grant to the first delivery the grant brought (the longest of a
	// session consumer's links; the credit counts it as at least 2 ms); 0
	// with FixedCredit or before any delivery.
	Credit, CreditLimit int
	RoundTrip           time.Duration

	// Lanes is each lane's (or worker's) load now (deliveries waiting for
	// it and in its handler) and deliveries finished in all; a session
	// consumer sums its sessions' lanes. Skew shows here.
	Lanes []LaneStats
	// GroupsHeld is the number of groups (group-ids) with deliveries in the
	// lanes now, under [BalanceKeys]; 0 otherwise.
	GroupsHeld int
	// Parked is the number of held deliveries that wait behind an earlier
	// delivery of their own group (in their lane under [WorkersByKey],
	// queued, in the handler or in the same batch; for the lane that holds
	// their group under [BalanceKeys]), or behind a handler call that has
	// run for over four times the mean and at least 1 ms (under
	// WorkersByKey, all that is queued in its lane; a call counts from
	// the first reading that sees it: see docs/design.md); 0 under [Workers]. A
	// hot, slow or stuck group shows here. The adaptive credit holds them
	// on top of what the lanes need: see docs/design.md for how much on
	// each broker.
	Parked int

	// Received counts deliveries received.
	Received uint64
	// Settled counts the settlements the broker took, by the outcome that
	// went out: on Service Bus a release sent by lock token once its link
	// is gone goes as an abandon, and counts as Modified.
	Settled Settlements
	// Results counts what handlers decided, one per delivery (the final
	// result, after any [LocalRetry]).
	Results Results

	// SettleErrors counts settlements the broker did not take (the link was
	// gone); the broker redelivers those deliveries.
	SettleErrors uint64
	// Stale counts settlements not sent because the delivery's link was
	// lost while a handler had it; the broker redelivers those deliveries.
	Stale uint64
	// Dropped counts deliveries of a lost link dropped before a handler saw
	// them; the broker redelivers those deliveries.
	Dropped uint64
	// Unsent counts settlements decided (a handler's result, or a release
	// at a stop) but never sent, because the stop's bound came first: a
	// broker slow to answer, or Close. The broker redelivers those
	// deliveries.
	Unsent uint64
	// Overshoot counts deliveries the broker sent past the credit.
	Overshoot int64
	// Links counts links attached; LinksLost those lost; Reconnects the
	// links attached in place of a lost one.
	Links, LinksLost, Reconnects uint64
	// Locks counts Service Bus message locks (all zero elsewhere).
	Locks Locks
	// DeadLetterCopies counts rejections kept as a copy on the dead-letter
	// address ([DeadLetterCopy]); their originals are in Settled.Accepted.
	DeadLetterCopies uint64
	// DeadLetterCopyFailures counts [DeadLetterCopy] copies the broker did
	// not take ([EventDeadLetterCopyFailed]); those deliveries were rejected
	// instead, and lost their reason.
	DeadLetterCopyFailures uint64
	// Abandoned counts handlers that had not returned when Run returned.
	Abandoned uint64
	// EventsDropped counts events [OnEvent]'s function fell too far behind
	// to get.
	EventsDropped uint64
}

// Settlements count settlements by outcome.
type Settlements struct {
	Accepted uint64 // accepted: handled
	Released uint64 // released: Release(), a stop, Retry under RabbitMQ3 (on Service Bus, on the link only)
	Modified uint64 // modified: Retry on Artemis, Generic and RabbitMQ4, abandon (Retry) on Service Bus and a release it took by lock token (an abandon, counted), Reject, MaxDeliveryCount and MaxMessageSize on a RabbitMQ 4 quorum queue
	Rejected uint64 // rejected: Reject, RejectWith, MaxDeliveryCount, MaxMessageSize (not a DeadLetterCopy: accepted; on a RabbitMQ 4 quorum queue: modified)
}

// LaneStats are one lane's figures.
type LaneStats struct {
	Load     int    // deliveries waiting for the lane and in its handler
	Finished uint64 // deliveries handled (or dropped) by the lane, in all
}

// LongestLane returns the highest load of any lane.
func (st Stats) LongestLane() int {
	m := 0
	for _, l := range st.Lanes {
		m = max(m, l.Load)
	}
	return m
}

// Locks count what happened to Service Bus message locks.
type Locks struct {
	// Held is the number of deliveries whose locks are kept now.
	Held int
	// RenewRequests counts renew-lock requests; Renewed the locks they
	// renewed (several per request); RenewFailures the requests that failed
	// for another reason than a lost lock.
	RenewRequests, Renewed, RenewFailures uint64
	// Lost counts locks lost: refused by the service, or expired. Of
	// those, Dropped were of deliveries no handler had taken, Skipped of
	// deliveries in a handler, whose settlement was then not sent.
	Lost, Dropped, Skipped uint64
	// LostAtSettle counts settlements the service answered with
	// message-lock-lost; SettleTimeouts those it did not answer within
	// [SettleTimeout]. The service delivers those messages again.
	LostAtSettle, SettleTimeouts uint64
	// Unrenewable counts deliveries without a lock token or expiry (never
	// renewed).
	Unrenewable uint64
	// SettledByToken counts settlements the service took by lock token
	// (com.microsoft:update-disposition on $management), in
	// DispositionRequests requests: those of deliveries whose link was
	// lost while they were held, and those the service answered on the
	// link as busy or timed out. They are in Settled too.
	SettledByToken, DispositionRequests uint64
}

// Results count what handlers decided.
type Results struct {
	Accept  uint64 // nil
	Release uint64 // Release()
	Retry   uint64 // Retry(err), any other error, or a panic
	Reject  uint64 // Reject or RejectWith (not MaxDeliveryCount or MaxMessageSize: Poisoned, Oversize)
	// Panics counts handler calls that panicked (each is also a Retry).
	Panics uint64
	// LocalRetries counts handler calls repeated in the lane ([LocalRetry]).
	LocalRetries uint64
	// Poisoned counts deliveries rejected for their delivery count before
	// a handler saw them ([MaxDeliveryCount]); they are not in Reject.
	Poisoned uint64
	// Oversize counts deliveries rejected for their size before a handler
	// saw them ([MaxMessageSize]); they are not in Reject.
	Oversize uint64
}

// Stats returns the subscriber's counters. It may be called at any time from
// any goroutine.
func (s *Subscriber) Stats() Stats {
	st := Stats{Lanes: make([]LaneStats, s.cfg.workers)}
	now := time.Now()
	for _, pp := range s.pipes {
		g := pp.gauge.Read()
		for i := range st.Lanes {
			st.Lanes[i].Load += g.Load[i]
			st.Lanes[i].Finished += g.Finished[i]
		}
		st.GroupsHeld += g.Keys
		q := pp.pump.Stats()
		// A lane counts a batch's deliveries until its call returns, some
		// perhaps settled already (LocalRetry): at most what is held.
		group, stalled := pp.gauge.Parked(now)
		st.Parked += min(group+stalled, q.Held)
		st.CreditLimit += pp.pump.Credit()
		addPump(&st, q)
		st.Locks.add(pp.dp.Locks())
	}
	st.Results = Results{
		Accept:       s.results.accept.Load(),
		Release:      s.results.release.Load(),
		Retry:        s.results.retry.Load(),
		Reject:       s.results.reject.Load(),
		Panics:       s.results.panics.Load(),
		LocalRetries: s.results.localRetries.Load(),
		Poisoned:     s.results.poisoned.Load(),
		Oversize:     s.results.oversize.Load(),
	}
	st.Reconnects = s.reconnects.Load()
	st.DeadLetterCopies = s.deadLetterCopies.Load()
	st.DeadLetterCopyFailures = s.deadLetterCopyFailures.Load()
	st.Abandoned = s.abandoned.Load()
	st.EventsDropped = s.events.droppedCount()
	return st
}

// addPump adds one pump's figures to st: the one place that maps the
// engine's numbers to the public ones (a session consumer has a pump per
// session; the round trip is the longest of theirs).
func addPump(st *Stats, q pump.Stats) {
	st.Held += q.Held
	st.MaxHeld += q.MaxHeld
	st.BytesHeld += q.BytesHeld
	st.MaxBytesHeld += q.MaxBytesHeld
	st.Buffered += q.Buffered
	st.Handling += q.Handling
	st.Settling += q.Settling
	st.Credit += q.Credit
	st.RoundTrip = max(st.RoundTrip, q.RoundTrip)
	st.Received += q.Received
	st.Settled.Accepted += q.Accepted
	st.Settled.Released += q.Released
	st.Settled.Modified += q.Modified
	st.Settled.Rejected += q.Rejected
	st.SettleErrors += q.SettleErrors
	st.Stale += q.Stale
	st.Unsent += q.Unsent
	st.Dropped += q.Dropped
	st.Overshoot += q.Overshoot
	st.Links += q.Links
	st.LinksLost += q.LinksLost
	st.Locks.Dropped += q.LockLostDropped
	st.Locks.Skipped += q.LockLostSkipped
	st.Locks.LostAtSettle += q.LockLostAnswers
	st.Locks.SettleTimeouts += q.SettleTimeouts
}

// String returns the counters on one line: held and its census, the
// longest lane's load, received, settlements by outcome
// (accepted/released/modified/rejected), handler results
// (accept/release/retry/reject), then the numbers of [StatFields] that are
// usually zero, only when they are not.
func (st Stats) String() string {
	s := fmt.Sprintf("held=%d max=%d (buffered=%d handling=%d settling=%d) longest_lane=%d received=%d settled(acc/rel/mod/rej)=%d/%d/%d/%d results(acc/rel/retry/rej)=%d/%d/%d/%d",
		st.Held, st.MaxHeld, st.Buffered, st.Handling, st.Settling, st.LongestLane(), st.Received,
		st.Settled.Accepted, st.Settled.Released, st.Settled.Modified, st.Settled.Rejected,
		st.Results.Accept, st.Results.Release, st.Results.Retry, st.Results.Reject)
	for _, f := range statFields {
		if f.show != strTail {
			continue
		}
		v := f.Value(st)
		if f.logAs == logUint64 {
			if v != 0 {
				s += " " + f.Name + "=" + strconv.FormatUint(uint64(v), 10) //nolint:gosec // G115: the uint64 the row converted
			}
		} else if v > 0 { // a signed number below 0 is no count (overshoot never is)
			s += " " + f.Name + "=" + strconv.FormatInt(v, 10)
		}
	}
	return s
}

// MarshalLogObject logs the numbers of [StatFields] as fields of a zap
// object: zap.Object("stats", sub.Stats()). Every one is written, zero or
// not, under its snake_case name and with its Go type (the lanes summed up
// in longest_lane); the "stopped" log line carries them.
func (st Stats) MarshalLogObject(enc zapcore.ObjectEncoder) error {
	for _, f := range statFields {
		v := f.Value(st)
		switch f.logAs {
		case logInt:
			enc.AddInt(f.Name, int(v))
		case logInt64:
			enc.AddInt64(f.Name, v)
		case logDuration:
			enc.AddDuration(f.Name, time.Duration(v))
		default:
			enc.AddUint64(f.Name, uint64(v)) //nolint:gosec // G115: the uint64 the row converted
		}
	}
	return nil
}

// add adds a driver's lease counters to l.
func (l *Locks) add(d driver.Locks) {
	l.Held += d.Held
	l.RenewRequests += d.RenewRequests
	l.Renewed += d.Renewed
	l.RenewFailures += d.RenewFailures
	l.Lost += d.Lost
	l.Unrenewable += d.Unrenewable
	l.SettledByToken += d.SettledByToken
	l.DispositionRequests += d.DispositionRequests
}
