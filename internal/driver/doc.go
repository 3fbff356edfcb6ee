// Package driver holds what the core, the engine and each broker's driver
// share; it imports nothing of the module.
//
// The engine (the pump, the lanes, the credit) books every delivery it
// holds in a [Delivery] and hands consumers a [Ticket] for it; a consumer
// settles the ticket with an [Outcome]. A broker's code receives and
// settles through a [Source], and answers the engine with [SentAs],
// [Resting], [ErrSourceDone] and [ErrNotSent], without importing the
// engine.
//
// Some methods of Delivery and Ticket, and the type [Links], are for the
// engine alone (their docs say so): they move a book entry from one
// [State] to the next. Nothing else calls them.
package driver
