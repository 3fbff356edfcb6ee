package amqpsub

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/Azure/go-amqp"
	"github.com/cespare/xxhash/v2"
	"go.uber.org/zap"

	"github.com/amqpsub/amqpsub/internal/driver"

	"github.com/amqpsub/amqpsub/internal/pump"
	"github.com/amqpsub/amqpsub/internal/servicebus"
	"github.com/amqpsub/amqpsub/internal/wait"
)

// sbDriver is Service Bus's driver: its facts, the conditions its clients
// take as fatal, and the throttling wait. What it adds to a pipe is
// sbKind, which the profile makes in place of a driver's pipe part.
type sbDriver struct{ driver.Plain }

func (sbDriver) Facts() driver.Facts {
	return driver.Facts{
		Name:         "servicebus",
		System:       "servicebus",
		Retry:        driver.Outcome{Kind: driver.Modify},
		Detach:       true,
		RejectCond:   ErrCondDeadLetter,
		PeekLock:     true,
		CountBase:    1,
		NamedReasons: true,
	}
}

// FatalCond: an entity an operator disabled stays so until one enables it.
func (sbDriver) FatalCond(err error) bool { return isCond(err, servicebus.CondEntityDisabled) }

// DefaultFatal: under the AzureServiceBus profile the default test of
// FatalErrors is [IsFatal] and amqp:not-allowed. For the two
// conditions azservicebus takes as fatal beyond IsFatal's
// (internal/errors.go, RecoveryKindFatal), on a receiver's reconnect:
//
//   - amqp:not-allowed is fatal. The .NET client turns it into an
//     InvalidOperationException (Amqp/AmqpExceptionHelper.cs), which
//     Learn's "Service Bus messaging exceptions (.NET)" describes as an
//     operation not valid for the client's configuration, mended by
//     changing its options: the same attach is refused again.
//   - amqp:resource-limit-exceeded is retried, with the backoff. On the
//     receive path it is a quota (the .NET client's QuotaExceeded): per
//     Learn's "Service Bus messaging exceptions (.NET)", too many
//     concurrent receives on the entity, or too many connections to the
//     namespace, which frees as other clients close. azservicebus's
//     entry is about a full entity, which only a sender meets; and the
//     .NET ServiceBusProcessor receives again after any receive error
//     (ServiceBusProcessor.cs), as a subscriber here reconnects.
func (sbDriver) DefaultFatal(err error) bool { return isCond(err, amqp.ErrCondNotAllowed) }

// Wait is 10 s (servicebus.ServerBusyWait, the ServerBusyBaseSleepTime of
// Microsoft's .NET clients) after the service said it is throttling
// (com.microsoft:server-busy, or a $management answer that wraps
// servicebus.ErrServerBusy), 0 otherwise.
func (sbDriver) Wait(err error) time.Duration {
	if servicebus.Busy(err) {
		return servicebus.ServerBusyWait
	}
	return 0
}

// sb returns what Service Bus keeps of l, nil before its attach did.
func (l *link) sb() *sbLink {
	v, _ := l.ext.(*sbLink)
	return v
}

// sbKind is Service Bus's brokerKind for one pipe: peek-lock links with
// their locks kept by a lease book, settlement by lock token once a link
// is gone (queues and subscriptions without sessions), and session links
// (Sessions, SessionIDs). The mechanics are in package internal/servicebus;
// this is where they meet the pipe.
type sbKind struct {
	s *Subscriber
	p *pipe
	// session is the session id the pipe asks for ("" for the next
	// available one); used by session consumers only.
	session  string
	sessions bool // a session consumer
	book     *servicebus.Leases
	// fallback settles, by lock token, the deliveries of a lost link;
	// nil for session consumers, whose locks end with the session link.
	fallback *servicebus.Dispositions
	// sourceRenewer renews locks in place of a link's $management node
	// when the pipe receives from a test source that can (package
	// amqpsubtest's Service Bus queue); nil on a broker's link.
	sourceRenewer atomic.Pointer[servicebus.Renewer]

	// stopMu guards stopLink and stopped.
	stopMu sync.Mutex
	// stopLink is the stop node: a connection of its own with the entity's
	// $management node only, for a pipe that stops without a link whose
	// node can serve (its connection was lost during the grace, or while
	// the link was being replaced). Opened by the first renewal or
	// settlement by lock token that needs it; closed by start's stop.
	stopLink *link
	stopped  bool
}

// sbLink is what Service Bus adds to one link.
type sbLink struct {
	mgmt *servicebus.Management // the entity's $management node, on the link's session
	// session is the source of a session link (session consumers only).
	session *servicebus.Session
}

func newServiceBusKind(p *pipe, session string) brokerKind {
	return &sbKind{s: p.s, p: p, session: session, sessions: p.s.cfg.sessions()}
}

func (k *sbKind) configure(pc *pump.Config) {
	s := k.s
	bc := servicebus.LeasesConfig{
		MaxRenewal: s.cfg.maxLockRenewal,
		OnLost:     k.lockLost,
		Logger:     s.log,
	}
	if s.rec != nil {
		bc.OnRenewed = s.rec.LocksRenewed
	}
	if !k.sessions {
		// A session's messages are covered by the session's lock, which
		// the session link renews.
		bc.Renewer = renewer{k}
	}
	k.book = servicebus.NewLeases(bc)
	pc.Leases = k.book
	// Enough settlements in flight that a round trip of a few
	// milliseconds does not cap the rate (32 at 5 ms: 6,400/s).
	pc.Settlers = max(1, min(pc.Credit, 64))
	pc.SettleTimeout = s.cfg.settleTimeout
	if !k.sessions {
		// A message's lock outlives its link (see servicebus.Receiver):
		// what a lost link held is kept, and settled by lock token.
		pc.LeasesOutliveLinks = true
		pc.DropBufferedOn = connectionLost
		k.fallback = servicebus.NewDispositions(k.management, s.log)
	}
}

// connectionLost reports whether a link ended with err because its
// connection was lost (a *amqp.ConnError), or with a condition after which
// azservicebus makes a new connection (amqp:connection:forced,
// amqp:internal-error: internal/errors.go, RecoveryKindConn).
//
// What the link had delivered and no handler has taken yet is then
// dropped (pump.Config.DropBufferedOn), since the two readings of what the
// service keeps differ. Learn's "Message transfers, locks, and settlement"
// says that the locks are dropped when the connection breaks: the service
// may already have delivered those messages to another receiver, and
// handling them here would handle them twice. The JavaScript SDK settles
// such messages through $management after it "recovers from a broken link
// or connection" (azure-sdk-for-js PR 8406), so the locks may survive:
// dropping them then costs their redelivery at lock expiry, counted, and
// for a group the order of those messages behind its later ones. What
// handlers have already is kept either way: their settlements go by lock
// token on the next connection, and a lock the service dropped answers
// 410 there, counted as a lock lost at settlement.
func connectionLost(err error) bool {
	var ce *amqp.ConnError
	return errors.As(err, &ce) || servicebus.IsCond(err, amqp.ErrCondConnectionForced) ||
		servicebus.IsCond(err, amqp.ErrCondInternalError)
}

// start runs the lease book and, without sessions, the dispositions by
// lock token. The dispositions end first: the pump's settlers use them
// until the pump has returned, which is before stop is called.
func (k *sbKind) start(ctx context.Context) func() {
	bctx, stopBook := context.WithCancel(ctx)
	bookDone := make(chan struct{})
	go func() { defer close(bookDone); k.book.Run(bctx) }()
	stopFallback, fallbackDone := func() {}, make(chan struct{})
	if k.fallback != nil {
		var fctx context.Context
		fctx, stopFallback = context.WithCancel(ctx)
		go func() { defer close(fallbackDone); k.fallback.Run(fctx) }()
	} else {
		close(fallbackDone)
	}
	return func() {
		stopFallback()
		<-fallbackDone
		stopBook()
		<-bookDone
		k.closeStopNode()
	}
}

// stopNode returns the $management node of the stop node (see
// sbKind.stopLink), opening it within ctx and DialTimeout when there is
// none, or the one there is was lost: while a pipe stops, what was decided
// is settled, and what handlers still have renewed, on a connection of its
// own when the pipe's was lost. Under the reading that the service drops a
// connection's locks with it (Learn), the service answers those with 410,
// counted as locks lost; under the other (azure-sdk-for-js PR 8406) it
// takes them.
func (k *sbKind) stopNode(ctx context.Context) (*servicebus.Management, error) {
	k.stopMu.Lock()
	defer k.stopMu.Unlock()
	if l := k.stopLink; l != nil {
		if l.conn.Err() == nil && !wait.Closed(l.sb().mgmt.Done()) {
			return l.sb().mgmt, nil
		}
		k.stopLink = nil
		k.s.closeWithin(l, time.Now().Add(k.s.cfg.closeTimeout/4))
	}
	if k.stopped {
		return nil, errNoLink
	}
	s := k.s
	if _, ok := s.connector.(sourceConnector); ok {
		return nil, errNoLink // a test source: no broker to connect to
	}
	c, by, err := s.connect(ctx, 0, false)
	if err != nil {
		return nil, fmt.Errorf("%w: stopping, and could not connect for $management: %w", errNoLink, err)
	}
	l := &link{connection: c, kind: k}
	cctx, cancel := context.WithDeadline(ctx, by)
	defer cancel()
	if l.sess, err = c.conn.NewSession(cctx, nil); err == nil {
		var mgmt *servicebus.Management
		if mgmt, err = servicebus.NewManagement(cctx, l.sess, s.cfg.profile.drv.Address(s.queue), ""); err == nil {
			l.ext = &sbLink{mgmt: mgmt}
			k.stopLink = l
			s.log.Info("stopping without a connection: opened one for $management, to settle what was decided",
				zap.String("broker", c.addr))
			return mgmt, nil
		}
	}
	s.closeWithin(l, time.Now().Add(s.cfg.closeTimeout/4))
	return nil, fmt.Errorf("%w: stopping, and could not attach $management: %w", errNoLink, err)
}

// closeStopNode closes the stop node, if it was opened, within a quarter
// of CloseTimeout; none opens after it.
func (k *sbKind) closeStopNode() {
	k.stopMu.Lock()
	l := k.stopLink
	k.stopLink, k.stopped = nil, true
	k.stopMu.Unlock()
	if l != nil {
		k.s.closeWithin(l, time.Now().Add(k.s.cfg.closeTimeout/4))
	}
}

func (k *sbKind) receiverOptions(ro *amqp.ReceiverOptions) {
	ro.SettlementMode = amqp.ReceiverSettleModeSecond.Ptr()
	if k.sessions {
		// The service answers with com.microsoft:timeout when no session
		// became free within this; the attacher asks again.
		servicebus.SessionReceiverOptions(ro, k.session, k.s.cfg.dialTimeout/2)
	}
}

// attached attaches the $management node beside l's receiver and, for a
// session consumer, accepts the session the service granted.
func (k *sbKind) attached(ctx context.Context, l *link) (driver.Source, string, error) {
	s := k.s
	mgmt, err := servicebus.NewManagement(ctx, l.sess, s.cfg.profile.drv.Address(s.queue), l.rcv.LinkName())
	if err != nil {
		return nil, "attach $management", err
	}
	l.ext = &sbLink{mgmt: mgmt}
	if !k.sessions {
		return servicebus.NewReceiver(l.rcv, k.fallback), "", nil
	}
	src, err := servicebus.AcceptSession(l.rcv, mgmt, servicebus.SessionConfig{
		Idle: s.cfg.sessionIdle, Slot: k.p.index, Leases: k.book, Held: k.p.pump.Held, Log: s.log, Limited: s.limited,
	})
	if err != nil {
		return nil, "accept session", err
	}
	l.sb().session = src
	return src, "", nil
}

// ready waits, within ctx (Run's, not the attach's DialTimeout), until no
// handler of l's session runs here any more (awaitSession): a handler of
// the session from its lost link may outlive any attach timeout.
func (k *sbKind) ready(ctx context.Context, l *link) error {
	if l.sb() == nil || l.sb().session == nil {
		return nil
	}
	return k.awaitSession(ctx, l.sb().session)
}

// checkSource finds nothing to check on a test source: what Service Bus
// adds to it is made by attachedSource.
func (*sbKind) checkSource(driver.Source) (string, error) { return "", nil }

func (k *sbKind) attachedSource(src driver.Source) {
	if rn, ok := src.(servicebus.Renewer); ok {
		// A test source that renews its own locks (see renewer).
		k.sourceRenewer.Store(&rn)
		return
	}
	k.sourceRenewer.Store(nil)
}

// release ends a session's lock renewal before the link closes, and waits
// for the $management node's routing goroutine, which ends with the
// session, after.
func (k *sbKind) release(ctx context.Context, l *link, why error, detach func()) {
	if l.sb() != nil && l.sb().session != nil {
		l.sb().session.Stop()
		// An idle session (driver.ErrSourceDone) is let go as it should be:
		// no error to report, only the reason.
		reason, err := "link lost", why
		switch {
		case why == nil:
			reason = "stop"
		case errors.Is(why, driver.ErrSourceDone):
			reason, err = "idle", nil
		}
		k.s.log.Info("session released", zap.String("session_id", l.sb().session.ID()), zap.Int("slot", l.sb().session.Slot()),
			zap.String("reason", reason), zap.Error(err))
	}
	detach()
	if l.sb() != nil {
		select {
		case <-l.sb().mgmt.Done():
		case <-ctx.Done():
		}
	}
}

// reattachOn: a link the service detached, or that the subscriber gave up
// on (its $management node could not be attached again), is attached again
// on its connection while that is open, as azservicebus recovers a link
// (internal/amqpLinks.go, recoverLink: the links and their AMQP session are
// made anew on the connection in place); only a lost connection, or the
// conditions azservicebus recovers with a new connection
// (amqp:connection:forced, amqp:internal-error: internal/errors.go,
// RecoveryKindConn), get a new one. Learn's "Message transfers, locks, and
// settlement" says that a lock is dropped when the connection breaks,
// "since Service Bus does not support recovery of existing AMQP links on a
// different connection": closing a live connection to replace a link could
// cost the very locks the pump keeps and renews.
//
// A link detached with amqp:unauthorized-access (its token expired or was
// revoked) is attached again only once fresh tokens are on the connection
// (within DialTimeout); if they cannot be put, the connection is made anew,
// which claims anew, and a token the service refuses then ends Run. So is
// an attach on the connection refused with amqp:unauthorized-access
// (refused): the fresh tokens did not help. Other refusals of that attach
// are asked again there, after the backoff, as azservicebus recovers its
// links on the connection it has.
func (k *sbKind) reattachOn(ctx context.Context, c *connection, lost error, refused bool) bool {
	var le *amqp.LinkError
	var se *amqp.SessionError
	var ae *amqp.Error
	// A link's or session's end; or, for a refused attach, the refusal. A
	// link the pump gave up by itself (go-amqp refused IssueCredit) ended
	// on a live connection too: what it held goes to the lanes, so its
	// locks must stay, and so must the connection. An attach that failed
	// with no answer (a timeout) may be on a connection that hangs.
	linkLevel := errors.As(lost, &le) || errors.As(lost, &se) || refused && errors.As(lost, &ae) || !refused
	switch {
	case connectionLost(lost) || !linkLevel:
		return false
	case refused && servicebus.IsCond(lost, amqp.ErrCondUnauthorizedAccess):
		return false
	case servicebus.IsCond(lost, amqp.ErrCondUnauthorizedAccess):
		if c.reclaim == nil {
			return false
		}
		rctx, cancel := context.WithTimeout(ctx, k.s.cfg.dialTimeout)
		defer cancel()
		if err := c.reclaim(rctx); err != nil {
			k.s.log.Warn("could not put fresh tokens on the connection for a link detached for its token; connecting anew",
				zap.Error(err))
			return false
		}
	}
	return true
}

// refused reads the attach errors of a session consumer that mean
// "wait": no session became free before the service's timeout
// (com.microsoft:timeout: ask again at once), or the session asked for is
// held by another receiver (com.microsoft:session-cannot-be-locked: ask
// again after servicebus.SessionLockedWait).
//
// Either way the next attach goes on the same connection, with its claims and their refresher, as
// azservicebus asks for the next session on the connection it has (its
// amqpLinks.go closes the refused link's AMQP session, never the
// connection).
func (k *sbKind) refused(err error, attempt int) (refusal, time.Duration) {
	switch {
	case !k.sessions:
		return refusedNot, 0
	case servicebus.IsCond(err, servicebus.CondTimeout):
		return refusedNoneFree, 0
	case servicebus.IsCond(err, servicebus.CondSessionCannotBeLocked):
		return refusedHeld, servicebus.SessionLockedWait(attempt)
	}
	return refusedNot, 0
}

// handlerContext returns a context that is cancelled (cause ErrLockLost)
// when the lock of any of ts is lost.
func (k *sbKind) handlerContext(ctx context.Context, ts ...driver.Ticket) (context.Context, func()) {
	hctx, cancel := context.WithCancelCause(ctx)
	for _, t := range ts {
		if !k.book.Bind(t, cancel) {
			// Out of the book already: its lock was lost between the
			// lane's Begin and now (or went with its link). The handler
			// must hear of it as it would have a moment later.
			cancel(ErrLockLost)
		}
	}
	return hctx, func() { cancel(nil) }
}

// returnsCounted: Service Bus does not count a release.
func (*sbKind) returnsCounted() bool { return false }

func (k *sbKind) addLocks(l *Locks) {
	b := k.book.Stats()
	l.Held += b.Held
	l.RenewRequests += b.Requests
	l.Renewed += b.Renewed
	l.RenewFailures += b.Failures
	l.Lost += b.Lost
	l.Unrenewable += b.Unrenewable
	if k.fallback != nil {
		l.SettledByToken += k.fallback.Taken()
		l.DispositionRequests += k.fallback.Requests()
	}
}

// lockLost is told by the lease book of a lost lock, and why (wrapping
// ErrLockLost): the delivery is dropped if no handler has it, its
// settlement skipped if one has (the book has cancelled the handler's
// context).
func (k *sbKind) lockLost(t driver.Ticket, m *amqp.Message, why error) {
	// Reported only when it changed anything: a delivery already settling
	// or settled hears of its lock from the settlement's answer.
	if k.p.pump.LoseLease(t) && m != nil {
		s := k.s
		d := &Delivery{msg: m, lane: -1}
		s.limited.Warn("message lock lost; the service delivers the message again", s.fields(d, why)...)
		s.events.send(s.event(d, EventLockLost, why))
	}
}

var errNoLink = errors.New("amqpsub: no link to renew locks on")

// renewer renews the locks of a pipe's current link (servicebus.Renewer).
type renewer struct{ k *sbKind }

// RenewLocks renews tokens on the current link's $management node, within
// ctx. When that node's link pair is gone for good (it could not be
// attached again), no lock of the link can be renewed any more: the receive
// link is closed too, so that the pump attaches both anew, and the service
// delivers again what the link held.
//
// A test source attached in place of a link renews its own locks, if it
// can: attachedSource sets sourceRenewer then. A broker's link never
// reaches that branch.
func (r renewer) RenewLocks(ctx context.Context, tokens []amqp.UUID) ([]time.Time, error) {
	p := r.k.p
	l := p.current.Load()
	if l == nil || l.sb() == nil || wait.Closed(p.pump.Stopping()) && l.conn.Err() != nil {
		if sr := r.k.sourceRenewer.Load(); sr != nil {
			return (*sr).RenewLocks(ctx, tokens)
		}
		if wait.Closed(p.pump.Stopping()) && r.k.fallback != nil {
			// Stopping without a live link: what handlers still have is
			// renewed on the stop node.
			m, err := r.k.stopNode(ctx)
			if err != nil {
				return nil, err
			}
			return m.RenewLocks(ctx, tokens)
		}
		return nil, errNoLink
	}
	exp, err := l.sb().mgmt.RenewLocks(ctx, tokens)
	if errors.Is(err, servicebus.ErrNodeGone) && p.current.Load() == l && l.sb().mgmt.AbandonLink(ctx, l.rcv) {
		r.k.s.log.Warn("the $management link is gone and could not be attached again; closing the receive link to attach both anew",
			zap.Error(err))
	}
	return exp, err
}

// management returns the $management node of the pipe's current link,
// waiting, within ctx, for a link while none is attached, or while the one
// recorded is of a lost connection. While the pipe stops no link comes:
// the lost link's node serves while its connection is open (see
// attacher.endRetired), and the stop node (stopNode) once it is not.
func (k *sbKind) management(ctx context.Context) (*servicebus.Management, error) {
	p := k.p
	for {
		up := p.linkUp.Load()
		if l := p.current.Load(); l != nil && l.sb() != nil && l.conn.Err() == nil && !wait.Closed(l.sb().mgmt.Done()) {
			return l.sb().mgmt, nil
		}
		// None, or the one still recorded is of a connection that is gone
		// (the attacher has not replaced it yet): wait for the next.
		select {
		case <-*up:
		case <-p.pump.Stopping():
			// No link will come: the attacher is cancelled.
			return k.stopNode(ctx)
		case <-ctx.Done():
			return nil, fmt.Errorf("%w: %w", errNoLink, ctx.Err())
		}
	}
}

// sessionBusyPoll is how often a slot that waits for a session's old
// handlers looks again.
const sessionBusyPoll = 20 * time.Millisecond

// handlersOf counts the handlers of session id running in this process, in
// any slot.
func (s *Subscriber) handlersOf(id string) int {
	n := 0
	for _, p := range s.pipes {
		p.pump.Each(func(d *driver.Delivery) bool {
			if m := d.Message(); m != nil && d.State() == driver.Handling && groupID(m) == id {
				n++
			}
			return true
		})
	}
	return n
}

// awaitSession returns once no handler of src's session runs in this
// process, before the session's link is handed to the pump. ctx ends the
// wait with its error.
//
// A session whose link was lost while a handler of it ran goes back to the
// service, which gives it to the first receiver that asks (another slot,
// or this one again), and its messages, the one in that handler first,
// would otherwise run beside it. Those handlers' contexts were cancelled
// with the loss (see servicebus.Session.Receive); one that does not return
// keeps the session's messages waiting here, its lock renewed, until it
// does.
func (k *sbKind) awaitSession(ctx context.Context, src *servicebus.Session) error {
	s := k.s
	n := s.handlersOf(src.ID())
	if n == 0 {
		return nil
	}
	s.log.Info("the session's handlers from its lost link still run here; waiting for them before taking its messages",
		zap.String("session_id", src.ID()), zap.Int("slot", src.Slot()), zap.Int("handlers", n))
	t := time.NewTicker(sessionBusyPoll)
	defer t.Stop()
	for s.handlersOf(src.ID()) > 0 {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-t.C:
		}
	}
	return nil
}

// settle hands t's settlement to the pump. The pump sends settlements
// concurrently (pump.Config.Settlers), so those of one group go out in the
// order they were decided, each once the one before was answered: a lost
// link cannot leave a group's earlier message to come back after a later
// one was settled. Keyless deliveries under WorkersByKey are ordered by
// lane; the others not at all.
func (k *sbKind) settle(t driver.Ticket, o driver.Outcome, lane int) {
	switch g := groupID(t.Message()); {
	case g != "":
		k.p.pump.SettleInOrder(t, o, xxhash.Sum64String(g))
	case k.s.cfg.byKey && lane >= 0:
		k.p.pump.SettleInOrder(t, o, uint64(lane))
	default:
		k.p.pump.Settle(t, o)
	}
}
