// Package servicebus is Azure Service Bus's driver (Driver, and its
// driver.Pipe in pipe.go), with what it adds to an AMQP 1.0 link:
// claims-based security on $cbs with its token refresher, the
// request/response link pair to a node, the entity's $management
// operations (renew-lock, update-disposition, session lock and state),
// session receivers, the connection string and SAS signing, and the lease
// book that keeps the locks of held deliveries. It imports, of amqpsub's
// packages, only the leaf package internal/driver (and small helpers:
// backoff, loglimit, wait); the core calls it through the driver seam
// only, and amqpsub's servicebus.go holds the public API; nothing here is
// public API.
//
// # Lock renewal
//
// In peek-lock mode Service Bus locks each message it delivers for the
// queue's lock duration (30 s to 5 min), from the moment it sends it. A
// consumer that holds a credit's worth of deliveries — waiting in the
// pump's channel, in a lane, or in a handler — loses the locks of those
// that wait longest, and the service delivers them again to someone else.
// [Leases] knows every delivery the pump holds (the pump feeds it through
// driver.Leases) with its lock token and expiry, and Run renews the locks:
// for as long as a delivery waits for its handler, and up to MaxRenewal
// after its handler began (Bind).
//
// # When a lock is renewed
//
// A lock is renewed once half the time it had left when it was received or
// last renewed has passed: a 60 s lock every 30 s, a 30 s lock every 15 s, a
// 2 s lock every second. Every lock that falls due within a round's window
// of the earliest one (1 s, or half the time that lock has left, if less)
// goes in the same request, up to MaxBatch tokens a request, so deliveries
// that arrived close together cost one request a round, not one each.
//
// Each request is bounded by a third of the time left on the earliest lock
// in it (and by Timeout), so a request that is never answered ends with two
// thirds of that time still left, and its locks are asked again within a
// second. The .NET processor renews at remaining − min(remaining/2, 10 s),
// that is 10 s before expiry for any lock of 20 s or more; with a 10 s
// request timeout, an unanswered request would end just as its locks
// expire, with no time left to try again. Renewing at half costs more
// renewals: two per lock duration, where the .NET rule makes 1.2 for a
// 60 s lock (every 50 s) and 1.5 for a 30 s one (every 20 s).
//
// Run has at most MaxInFlight requests out at once, each on a goroutine
// that Run starts and waits for before it returns, so one request that
// hangs delays only the locks in it: locks falling due meanwhile go out in
// requests of their own.
//
// # Losses
//
// A lock that is lost (the service says so, or it expired unrenewed) is
// reported to OnLost once, with why; a handler's context bound to the
// delivery is cancelled.
//
// No official client sends more than one token per renew-lock request
// (azservicebus, Azure.Messaging.ServiceBus), so no source says how the
// service answers a batch that holds one lost lock among live ones. The
// book is safe whichever way it does: a batch refused whole (410, 400:
// [ErrLockLost], [ErrBadRequest]) or answered with fewer expirations than
// tokens ([ErrIncomplete]) is asked again without the locks settled
// meanwhile, then token by token, and only a token refused on its own
// (410) is a lost lock. With one lost lock in a batch of 256 that costs
// 257 requests and 512 tokens for the round ([LeasesStats.Split] counts such
// batches).
//
// A server-busy answer (ErrServerBusy: the service is throttling) holds
// every renewal back for [ServerBusyWait], 10 s, as Microsoft's .NET client
// waits; other failures (no answer, a timeout, status 500) are tried
// again within a second, until the lock expires. azservicebus retries a
// renewal 3 times (its RetryOptions default); the book goes on trying for
// as long as the lock lives.
//
// # Logs
//
// The book logs each lost lock at debug only: OnLost is where a loss is
// reported (amqpsub logs it, limited, and passes it to OnEvent). A
// delivery without a usable lock and a failed renewal request are logged
// at warn at most once a minute each, and at debug otherwise (see package
// internal/loglimit). A delivery whose settlement is being sent
// (driver.Ticket.Sending) is neither renewed nor declared lost by the book,
// and one whose settlement waits to be sent is renewed but not declared
// lost: the settlement's answer decides, and the pump then removes it from
// the book.
package servicebus
