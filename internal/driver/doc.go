// Package driver is the one seam between the core (package amqpsub) and a
// broker: the [Driver] and [Pipe] interfaces each broker's driver
// implements, the interfaces through which a driver reaches the core
// ([PipeEnv], [EngineEnv], [Link]), and what the core, the engine and every
// driver share. Of the module it imports only internal/loglimit.
//
// The engine (the pump, the lanes, the credit) books every delivery it
// holds in a [Delivery] and hands consumers a [Ticket] for it; a consumer
// settles the ticket with an [Outcome]. A broker's code receives and
// settles through a [Source], and answers the engine with [SentAs],
// [Resting], [ErrSourceDone] and [ErrNotSent], without importing the
// engine.
//
// A lease is a broker's hold on one delivery it sent: while it lasts, the
// broker sends the delivery to no other consumer and takes its
// settlement. On some brokers a lease expires unless renewed, and may
// outlive the link the delivery came on; a broker's driver keeps them
// through [Leases], which the engine tells of every delivery it holds.
//
// Some methods of Delivery and Ticket, and the type [Links], are for the
// engine alone (their docs say so): they move a book entry from one
// [State] to the next. Nothing else calls them.
package driver
