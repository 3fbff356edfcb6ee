package amqpsub

// Stats are a Subscriber's counters: totals since New, and a census of the
// deliveries the process holds now.
type Stats struct {
	// Held is the number of deliveries held in the process now: waiting in
	// the pump's channel, in a lane, in a handler, or waiting for their
	// settlement. It never exceeds the credit on a broker that keeps within
	// the credit it was given.
	Held int
	// MaxHeld is the most deliveries held at once.
	MaxHeld int
	// Buffered and Handling split Held: waiting for a handler, and in one.
	Buffered int
	Handling int

	Received uint64 // deliveries received
	Accepted uint64 // settled as accepted
	Released uint64 // settled as released: Release(), stop, RabbitMQ3 retries
	Modified uint64 // settled as modified: retries on Artemis and Generic
	Rejected uint64 // settled as rejected

	Retries  uint64 // handler results that meant Retry, panics included
	Panics   uint64 // handler panics
	Releases uint64 // handler results that were Release()
	Rejects  uint64 // handler results that were Reject()

	// SettleErrors counts settlements the broker did not take (the link was
	// gone); the broker redelivers those deliveries.
	SettleErrors uint64
	// Overshoot counts deliveries the broker sent past the credit.
	Overshoot int64
	// Links counts links attached; LinksLost those lost; Reconnects the
	// links attached in place of a lost one.
	Links, LinksLost, Reconnects uint64
	// LocalRetries counts handler calls repeated in the lane (LocalRetry).
	LocalRetries uint64
	// Poisoned counts deliveries rejected for their delivery count
	// (MaxDeliveryCount).
	Poisoned uint64
	// Stale counts settlements skipped because their link was lost; the
	// broker redelivers those deliveries.
	Stale uint64
	// Dropped counts deliveries of a lost link dropped before a handler saw
	// them.
	Dropped uint64
}

// Stats returns the subscriber's counters. It may be called at any time from
// any goroutine.
func (s *Subscriber) Stats() Stats {
	p := s.pump.Stats()
	return Stats{
		Held:         p.Held,
		MaxHeld:      p.MaxHeld,
		Buffered:     p.Buffered,
		Handling:     p.Handling,
		Received:     p.Received,
		Accepted:     p.Accepted,
		Released:     p.Released,
		Modified:     p.Modified,
		Rejected:     p.Rejected,
		Retries:      s.retries.Load(),
		Panics:       s.panics.Load(),
		Releases:     s.releases.Load(),
		Rejects:      s.rejects.Load(),
		SettleErrors: p.SettleErrors,
		Overshoot:    p.Overshoot,
		Links:        p.Links,
		LinksLost:    p.LinksLost,
		Reconnects:   s.reconnects.Load(),
		LocalRetries: s.localRetries.Load(),
		Poisoned:     s.poisoned.Load(),
		Stale:        p.Stale,
		Dropped:      p.Dropped,
	}
}
