package driver

// Leases keeps the lease of every delivery the engine holds (renews it
// before it expires, say), and tells the engine of one it lost (the
// engine's LoseLease). nil, in the engine's configuration, costs nothing.
type Leases interface {
	// Add is called on the engine's goroutine when a delivery enters the
	// engine's book. It must not block.
	Add(t Ticket)
	// Remove is called when a delivery's entry leaves the book (settled,
	// dropped or released). It must not block.
	Remove(d *Delivery)
	// LostAnswer reports whether err, the broker's answer to a
	// settlement, says that the delivery's lease was gone: the engine
	// counts such answers apart from other failures.
	LostAnswer(err error) bool
}
