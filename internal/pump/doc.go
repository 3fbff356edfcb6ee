// Package pump owns a receiver link and hands its deliveries on.
//
// One goroutine, the pump, owns the receiver. It receives deliveries, puts
// each in a channel as deep as the credit (Out), applies the settlements that
// consumers send back (Settle) and grants credit back to the broker as the
// deliveries settle. While a delivery waits for room in Out, the pump keeps
// applying settlements, so a stream nobody polls never holds the
// acknowledgements of deliveries already handed out.
//
// Every delivery the process holds, from the moment the pump receives it to
// the moment its settlement is applied, has an entry in the pump's book:
// [Pump.Each] walks it, [Pump.Stats] counts it. The book is the one place that knows what
// the process holds, whether it waits in Out, in a lane, or runs in a
// handler.
//
// The book's entries and the tickets Out hands over are package driver's
// ([driver.Delivery], [driver.Ticket]), so that a broker's code reaches
// them, and settles through a [driver.Source], without importing the
// pump.
//
// Run takes an [AttachFunc], not a receiver, so that after a lost link it can
// attach a new one and go on with the same Out channel and book; deliveries of
// the lost link are then stale and dropped unhandled, since the broker
// redelivers them.
package pump
