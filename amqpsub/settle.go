package amqpsub

import (
	"errors"

	"github.com/amqpsub/amqpsub/internal/driver"
)

// settle maps a handler's result to the broker settlement, and counts it.
//
// A delivery whose lock is gone (the lease book cancelled the handler's
// context) is settled all the same: the pump skips sending it and counts
// it, and the service delivers the message again. Its result still counts,
// and the outcome it would have had is what the Recorder and OnSettled
// hear (with ErrNotSettled); nothing else of it is done (no dead-letter
// copy, no event).
func (s *Subscriber) settle(d *Delivery, err error) {
	if s.cut.Load() {
		if s.debug() {
			s.log.Debug("result of an abandoned handler ignored", s.fields(d, err)...)
		}
		return
	}
	lost := d.t.Entry().LeaseLost()
	if lost && s.debug() {
		s.log.Debug("result of a delivery whose lock was lost not sent", s.fields(d, err)...)
	}
	var o driver.Outcome
	switch result, oe := decide(err); result {
	case ResultAccept:
		s.results.accept.Add(1)
		o = driver.Outcome{Kind: driver.Accept}
	case ResultRelease:
		s.results.release.Add(1)
		o = driver.Outcome{Kind: driver.Release}
	case ResultReject:
		if !oe.poisoned {
			s.results.reject.Add(1)
		}
		o = s.rejection(d, oe, lost)
	default:
		s.results.retry.Add(1)
		o = s.cfg.profile.f.Retry
		if !lost {
			if !errors.Is(err, ErrHandlerPanic) && s.debug() {
				// Debug: a failing handler fails once per delivery. OnEvent
				// and Stats().Results.Retry report it.
				s.log.Debug("handler failed; the delivery goes back to the broker as a failed attempt", s.fields(d, err)...)
			}
			s.events.send(s.event(d, EventHandlerFailed, err))
		}
	}
	d.p.settle(d.t, o, d.lane)
}

// rejection is the settlement of a Reject: with DeadLetterCopy, an accept
// once the copy was taken; otherwise, or when the copy failed, rejected
// with the profile's condition (or the Reject's own). A delivery whose lock
// is gone gets no copy.
func (s *Subscriber) rejection(d *Delivery, oe *OutcomeError, lost bool) driver.Outcome {
	if s.cfg.deadLetterCopy != "" && !lost {
		err := s.copyToDeadLetter(d, oe)
		if err == nil {
			s.deadLetterCopies.Add(1)
			d.dl.Store(&deadLetterNote{address: s.deadLetterAddress()})
			s.events.send(s.event(d, EventDeadLetterCopied, nil))
			return driver.Outcome{Kind: driver.Accept}
		}
		if err != errNoDeadLetterLink && !s.cut.Load() {
			d.dl.Store(&deadLetterNote{address: s.deadLetterAddress(), err: err})
			s.deadLetterCopyFailures.Add(1)
			s.limited.Warn("dead-letter copy not taken; rejecting without keeping the reason", s.fields(d, err)...)
			s.events.send(s.event(d, EventDeadLetterCopyFailed, err))
		}
	}
	cond := s.cfg.profile.f.RejectCond
	if oe.cond != "" {
		cond = oe.cond
	}
	return driver.Outcome{Kind: driver.Reject, Error: oe.rejectError(cond)}
}

// settle hands t's settlement to the pump, with the outcome the pipe's
// driver sends for o, and in the order the driver asks for
// (driver.Pipe.SettleOrder: a broker whose settlements go out
// concurrently keeps a group's in order). lane is the delivery's lane, -1
// when it is not known (a release at a stop).
func (p *pipe) settle(t driver.Ticket, o driver.Outcome, lane int) {
	o = p.dp.Outcome(o)
	if key, ok := p.dp.SettleOrder(t, lane); ok {
		p.pump.SettleInOrder(t, o, key)
		return
	}
	p.pump.Settle(t, o)
}

// decide maps a handler's error to an outcome.
func decide(err error) (Result, *OutcomeError) {
	if err == nil {
		return ResultAccept, nil
	}
	// A nil *OutcomeError returned as an error, or one not made by
	// Release, Retry or Reject (its zero kind), is a non-nil error like
	// any other: Retry.
	var oe *OutcomeError
	if errors.As(err, &oe) && oe != nil && oe.kind != ResultAccept {
		return oe.kind, oe
	}
	return ResultRetry, nil
}
