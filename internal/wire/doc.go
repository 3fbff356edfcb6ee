// Package wire is the net.Conn that amqpsub hands to go-amqp: it coalesces
// outbound frames into fewer syscalls, can be torn down within a bound
// whatever go-amqp is doing, and reads the peer's SASL outcome off the wire.
//
// # Why
//
// go-amqp's connWriter goroutine writes every frame (each disposition, each
// flow, each transfer) with its own Write on the socket. Where a syscall is
// expensive that dominates the client's CPU per message. Conn.Write only
// copies the bytes into a queue and returns; one flusher goroutine writes
// everything queued while its previous syscall was in progress in a single
// Write on the connection under it. There is no timer: a Write on an idle
// connection goes out at once, so latency is never traded for batching, and
// batches form exactly when the socket is the bottleneck.
//
// go-amqp's Conn.Close writes a close frame and then closes the net.Conn,
// and a frame write may block for the whole write timeout (30 s by default)
// on a peer that does not read. Abort closes the socket at once, so the
// library can bound its shutdown.
//
// go-amqp reports a refused SASL outcome only as text (and names PLAIN for
// ANONYMOUS and EXTERNAL too). Conn parses the first inbound bytes and
// records the sasl-outcome code the peer sent; HandshakeError turns a failed
// handshake into a typed *SASLError.
//
// # Merging
//
// Under receiver-settle-mode first (Artemis, RabbitMQ) go-amqp writes one
// disposition frame per AcceptMessage, and the broker reads and handles
// each as a frame of its own. AMQP lets one disposition settle a range of
// deliveries (first..last), which is what Qpid Proton sends. Write merges a
// settled accepted disposition of the receiver role into one still queued
// (not yet taken by a flush) on the same channel whose range it continues
// at either end; otherwise it queues it as a frame later ones may extend.
// Only flows, dispositions and heartbeats may lie between the two: a
// merged acceptance then reaches the broker ahead of them, which changes
// nothing (credit counts transfers, not settlements, and a delivery is
// settled once). Any other frame is a barrier, and nothing is merged into
// bytes a flush has taken. Unsettled dispositions (receiver-settle-mode
// second, as on Service Bus, where the peer answers each), other outcomes
// and anything the parser does not recognise pass through as written.
// Options.NoMerge turns merging off.
//
// # Layering
//
// The library stacks raw TCP → *tls.Conn → wire.Conn → go-amqp, so frames
// are coalesced before encryption (one TLS record per flush) and Abort closes
// the TCP socket under the TLS layer. Pass go-amqp no TLSConfig in that case:
// amqp.NewConn does not negotiate TLS itself.
//
// # Guarantees
//
//   - Ordering: bytes reach the connection in the order of the Write calls
//     that accepted them, whole and never interleaved.
//   - Coalescing without a timer: while the flusher is idle a Write is
//     written at once; while a syscall is in progress later Writes
//     accumulate and go out together in the next one. Two buffers are
//     swapped under a mutex, so a Write allocates nothing in the steady
//     state.
//   - Back-pressure: at most Options.MaxQueued bytes are accepted and not
//     yet written; a Write that would exceed it waits for room, up to the
//     write deadline.
//   - Errors: once a write on the connection fails, every later Write
//     returns that error (as the connection returned it, so errors.Is with
//     net.ErrClosed or os.ErrDeadlineExceeded holds as it did), and the
//     socket is closed so that a Read blocked in go-amqp's reader fails too.
//     Err reports that error, which go-amqp keeps only as text.
//   - Deadlines: the write deadline bounds a Write waiting for room (and a
//     Write whose deadline has passed fails at once, as on a socket). The
//     flusher sets on the connection, before each syscall, the latest
//     deadline set before it took the batch, which go-amqp sets to
//     now+timeout before each frame: one deadline change per syscall, not
//     per frame. A deadline earlier than the one bounding the flush in
//     progress reaches it at once. A flush that times out is a write error.
//   - Lifetimes: the flusher is started by New and ended by Close, Abort or
//     a write error; Close and Abort wait for it, so no goroutine outlives
//     them. Close flushes (bounded by the write deadline), Abort does not;
//     both are idempotent and safe from any goroutine.
//   - SASL sniffing never alters, delays or withholds the bytes Read returns,
//     and allocates nothing once it has stopped.
package wire
