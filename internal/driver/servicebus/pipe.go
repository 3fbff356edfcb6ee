package servicebus

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
	"github.com/amqpsub/amqpsub/internal/wait"
)

// pipe is what Service Bus adds to one pipe: peek-lock links with their
// locks kept by a lease book, settlement by lock token once a link is gone
// (queues and subscriptions without sessions), and session links
// (Options.Sessions). The mechanics are in the rest of the package; this
// is where they meet the core's pipe.
type pipe struct {
	env driver.PipeEnv
	cfg driver.PipeConfig
	opt Options
	// session is the session id the pipe asks for ("" for the next
	// available one); used by session consumers only.
	session string
	book    *Leases
	// fallback settles, by lock token, the deliveries of a lost link;
	// nil for session consumers, whose locks end with the session link.
	fallback *Dispositions
	// sourceRenewer renews locks in place of a link's $management node
	// when the pipe receives from a test source that can (package
	// amqpsubtest's Service Bus queue); nil on a broker's link.
	sourceRenewer atomic.Pointer[Renewer]

	// stopMu guards stopLink and stopped.
	stopMu sync.Mutex
	// stopLink is the stop node: a connection of its own with the entity's
	// $management node only, for a pipe that stops without a link whose
	// node can serve (its connection was lost during the grace, or while
	// the link was being replaced). Opened by the first renewal or
	// settlement by lock token that needs it; closed by Start's stop.
	stopLink driver.Link
	stopped  bool
}

// linkState is what Service Bus keeps of one link (driver.Link.Ext).
type linkState struct {
	mgmt *Management // the entity's $management node, on the link's session
	// session is the source of a session link (session consumers only).
	session *Session
}

// stateOf returns what Service Bus keeps of l, nil before its attach did.
func stateOf(l driver.Link) *linkState {
	if l == nil {
		return nil
	}
	v, _ := l.Ext().(*linkState)
	return v
}

// LinkSession returns the session l holds, nil when it holds none (a link
// that is not a session link, or nil).
func LinkSession(l driver.Link) *Session {
	if st := stateOf(l); st != nil {
		return st.session
	}
	return nil
}

// LinkManagement returns the $management node beside l, nil when there is
// none (for tests).
func LinkManagement(l driver.Link) *Management {
	if st := stateOf(l); st != nil {
		return st.mgmt
	}
	return nil
}

func newPipe(env driver.PipeEnv) *pipe {
	cfg := env.Config()
	opt, ok := cfg.Options.(Options)
	if !ok {
		opt = DefaultOptions()
	}
	return &pipe{env: env, cfg: cfg, opt: opt, session: cfg.Key}
}

// Engine makes the lease book, and, without sessions, the dispositions by
// lock token: a message's lock outlives its link.
func (k *pipe) Engine() driver.Engine {
	bc := LeasesConfig{
		MaxRenewal: k.opt.MaxRenewal,
		OnLost:     k.lockLost,
		OnRenewed:  k.env.OnRenewed(),
		Logger:     k.env.Log(),
	}
	if !k.opt.Sessions {
		// A session's messages are covered by the session's lock, which
		// the session link renews.
		bc.Renewer = renewer{k}
	}
	k.book = NewLeases(bc)
	e := driver.Engine{
		Leases: k.book,
		// Enough settlements in flight that a round trip of a few
		// milliseconds does not cap the rate (32 at 5 ms: 6,400/s).
		Settlers:      max(1, min(k.cfg.Credit, 64)),
		SettleTimeout: k.opt.SettleTimeout,
	}
	if !k.opt.Sessions {
		// A message's lock outlives its link (see Receiver): what a lost
		// link held is kept, and settled by lock token.
		e.LeasesOutliveLinks = true
		e.DropBufferedOn = connectionLost
		k.fallback = NewDispositions(k.management, k.env.Log())
	}
	return e
}

// connectionLost reports whether a link ended with err because its
// connection was lost (a *amqp.ConnError), or with a condition after which
// azservicebus makes a new connection (amqp:connection:forced,
// amqp:internal-error: internal/errors.go, RecoveryKindConn).
//
// What the link had delivered and no handler has taken yet is then
// dropped (driver.Engine.DropBufferedOn), since the two readings of what
// the service keeps differ. Learn's "Message transfers, locks, and
// settlement" says that the locks are dropped when the connection breaks:
// the service may already have delivered those messages to another
// receiver, and handling them here would handle them twice. The JavaScript
// SDK settles such messages through $management after it "recovers from a
// broken link or connection" (azure-sdk-for-js PR 8406), so the locks may
// survive: dropping them then costs their redelivery at lock expiry,
// counted, and for a group the order of those messages behind its later
// ones. What handlers have already is kept either way: their settlements
// go by lock token on the next connection, and a lock the service dropped
// answers 410 there, counted as a lock lost at settlement.
func connectionLost(err error) bool {
	var ce *amqp.ConnError
	return errors.As(err, &ce) || IsCond(err, amqp.ErrCondConnectionForced) ||
		IsCond(err, amqp.ErrCondInternalError)
}

// Start runs the lease book and, without sessions, the dispositions by
// lock token. The dispositions end first: the engine's settlers use them
// until the engine has returned, which is before stop is called.
func (k *pipe) Start(ctx context.Context) func() {
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

// closeBy is when a link of the stop node must be closed by, from now.
func (k *pipe) closeBy() time.Time { return time.Now().Add(k.cfg.CloseTimeout / 4) }

// stopNode returns the $management node of the stop node (see
// pipe.stopLink), opening it within ctx and DialTimeout when there is
// none, or the one there is was lost: while a pipe stops, what was decided
// is settled, and what handlers still have renewed, on a connection of its
// own when the pipe's was lost. Under the reading that the service drops a
// connection's locks with it (Learn), the service answers those with 410,
// counted as locks lost; under the other (azure-sdk-for-js PR 8406) it
// takes them.
func (k *pipe) stopNode(ctx context.Context) (*Management, error) {
	k.stopMu.Lock()
	defer k.stopMu.Unlock()
	if l := k.stopLink; l != nil {
		if m := LinkManagement(l); l.Conn().Err() == nil && !wait.Closed(m.Done()) {
			return m, nil
		}
		k.stopLink = nil
		k.env.CloseLink(l, k.closeBy())
	}
	if k.stopped {
		return nil, errNoLink
	}
	l, by, err := k.env.OpenSession(ctx)
	if err != nil {
		if errors.Is(err, driver.ErrNoBroker) {
			return nil, errNoLink
		}
		return nil, fmt.Errorf("%w: stopping, and could not connect for $management: %w", errNoLink, err)
	}
	cctx, cancel := context.WithDeadline(ctx, by)
	defer cancel()
	mgmt, err := NewManagement(cctx, l.Session(), k.cfg.Address, "")
	if err != nil {
		k.env.CloseLink(l, k.closeBy())
		return nil, fmt.Errorf("%w: stopping, and could not attach $management: %w", errNoLink, err)
	}
	l.SetExt(&linkState{mgmt: mgmt})
	k.stopLink = l
	k.env.Log().Info("stopping without a connection: opened one for $management, to settle what was decided",
		zap.String("broker", l.Broker()))
	return mgmt, nil
}

// closeStopNode closes the stop node, if it was opened, within a quarter
// of CloseTimeout; none opens after it.
func (k *pipe) closeStopNode() {
	k.stopMu.Lock()
	l := k.stopLink
	k.stopLink, k.stopped = nil, true
	k.stopMu.Unlock()
	if l != nil {
		k.env.CloseLink(l, k.closeBy())
	}
}

// ReceiverOptions: peek-lock, and for a session consumer the session
// filter.
func (k *pipe) ReceiverOptions(ro *amqp.ReceiverOptions) {
	ro.SettlementMode = amqp.ReceiverSettleModeSecond.Ptr()
	if k.opt.Sessions {
		// The service answers with com.microsoft:timeout when no session
		// became free within this; the attacher asks again.
		SessionReceiverOptions(ro, k.session, k.cfg.DialTimeout/2)
	}
}

// Attached attaches the $management node beside l's receiver and, for a
// session consumer, accepts the session the service granted.
func (k *pipe) Attached(ctx context.Context, l driver.Link) (driver.Source, string, error) {
	mgmt, err := NewManagement(ctx, l.Session(), k.cfg.Address, l.Receiver().LinkName())
	if err != nil {
		return nil, "attach $management", err
	}
	st := &linkState{mgmt: mgmt}
	l.SetExt(st)
	if !k.opt.Sessions {
		return NewReceiver(l.Receiver(), k.fallback), "", nil
	}
	src, err := AcceptSession(l.Receiver(), mgmt, SessionConfig{
		Idle: k.opt.SessionIdle, Slot: k.cfg.Index, Leases: k.book, Held: k.env.Engine().Held,
		Log: k.env.Log(), Limited: k.env.Limited(),
	})
	if err != nil {
		return nil, "accept session", err
	}
	st.session = src
	return src, "", nil
}

// Ready waits, within ctx (Run's, not the attach's DialTimeout), until no
// handler of l's session runs here any more (awaitSession): a handler of
// the session from its lost link may outlive any attach timeout.
func (k *pipe) Ready(ctx context.Context, l driver.Link) error {
	if src := LinkSession(l); src != nil {
		return k.awaitSession(ctx, src)
	}
	return nil
}

// CheckSource finds nothing to check on a test source: what Service Bus
// adds to it is made by SourceAttached.
func (*pipe) CheckSource(driver.Source) (string, error) { return "", nil }

// SourceAttached keeps a test source's own renewer, if it has one.
func (k *pipe) SourceAttached(src driver.Source) {
	if rn, ok := src.(Renewer); ok {
		// A test source that renews its own locks (see renewer).
		k.sourceRenewer.Store(&rn)
		return
	}
	k.sourceRenewer.Store(nil)
}

// Release ends a session's lock renewal before the link closes, and waits
// for the $management node's routing goroutine, which ends with the
// session, after.
func (k *pipe) Release(ctx context.Context, l driver.Link, why error, detach func()) {
	if src := LinkSession(l); src != nil {
		src.Stop()
		// An idle session (driver.ErrSourceDone) is let go as it should be:
		// no error to report, only the reason.
		reason, err := "link lost", why
		switch {
		case why == nil:
			reason = "stop"
		case errors.Is(why, driver.ErrSourceDone):
			reason, err = "idle", nil
		}
		k.env.Log().Info("session released", zap.String("session_id", src.ID()), zap.Int("slot", src.Slot()),
			zap.String("reason", reason), zap.Error(err))
	}
	detach()
	if m := LinkManagement(l); m != nil {
		select {
		case <-m.Done():
		case <-ctx.Done():
		}
	}
}

// ReattachOn: a link the service detached, or that the subscriber gave up
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
// cost the very locks the engine keeps and renews.
//
// A link detached with amqp:unauthorized-access (its token expired or was
// revoked) is attached again only once fresh tokens are on the connection
// (reclaim, within DialTimeout); if they cannot be put, the connection is
// made anew, which claims anew, and a token the service refuses then ends
// Run. So is an attach on the connection refused with
// amqp:unauthorized-access (refused): the fresh tokens did not help. Other
// refusals of that attach are asked again there, after the backoff, as
// azservicebus recovers its links on the connection it has.
func (k *pipe) ReattachOn(ctx context.Context, reclaim func(context.Context) error, lost error, refused bool) bool {
	var le *amqp.LinkError
	var se *amqp.SessionError
	var ae *amqp.Error
	// A link's or session's end; or, for a refused attach, the refusal. A
	// link the engine gave up by itself (go-amqp refused IssueCredit)
	// ended on a live connection too: what it held goes to the lanes, so
	// its locks must stay, and so must the connection. An attach that
	// failed with no answer (a timeout) may be on a connection that hangs.
	linkLevel := errors.As(lost, &le) || errors.As(lost, &se) || refused && errors.As(lost, &ae) || !refused
	switch {
	case connectionLost(lost) || !linkLevel:
		return false
	case refused && IsCond(lost, amqp.ErrCondUnauthorizedAccess):
		return false
	case IsCond(lost, amqp.ErrCondUnauthorizedAccess):
		if reclaim == nil {
			return false
		}
		rctx, cancel := context.WithTimeout(ctx, k.cfg.DialTimeout)
		defer cancel()
		if err := reclaim(rctx); err != nil {
			k.env.Log().Warn("could not put fresh tokens on the connection for a link detached for its token; connecting anew",
				zap.Error(err))
			return false
		}
	}
	return true
}

// Refused reads the attach errors of a session consumer that mean
// "wait": no session became free before the service's timeout
// (com.microsoft:timeout: ask again at once), or the session asked for is
// held by another receiver (com.microsoft:session-cannot-be-locked: ask
// again after SessionLockedWait).
//
// Either way the next attach goes on the same connection, with its claims
// and their refresher, as azservicebus asks for the next session on the
// connection it has (its amqpLinks.go closes the refused link's AMQP
// session, never the connection).
func (k *pipe) Refused(err error, attempt int) (driver.Refusal, time.Duration) {
	switch {
	case !k.opt.Sessions:
		return driver.RefusedNot, 0
	case IsCond(err, CondTimeout):
		return driver.RefusedNoneFree, 0
	case IsCond(err, CondSessionCannotBeLocked):
		return driver.RefusedHeld, SessionLockedWait(attempt)
	}
	return driver.RefusedNot, 0
}

// HandlerContext returns a context that is cancelled (cause ErrLockLost)
// when the lock of any of ts is lost.
func (k *pipe) HandlerContext(ctx context.Context, ts ...driver.Ticket) (context.Context, func()) {
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

// Outcome sends o as it is.
func (*pipe) Outcome(o driver.Outcome) driver.Outcome { return o }

// SettleOrder: the engine sends settlements concurrently
// (driver.Engine.Settlers), so those of one group go out in the order they
// were decided, each once the one before was answered: a lost link cannot
// leave a group's earlier message to come back after a later one was
// settled. Keyless deliveries under WorkersByKey are ordered by lane; the
// others not at all.
func (k *pipe) SettleOrder(t driver.Ticket, lane int) (uint64, bool) {
	switch g := groupID(t.Message()); {
	case g != "":
		return xxhash.Sum64String(g), true
	case k.cfg.ByKey && lane >= 0:
		return uint64(lane), true
	}
	return 0, false
}

// groupID is m's AMQP group-id, "" when it has none (a session's id, on
// Service Bus).
func groupID(m *amqp.Message) string {
	if m == nil || m.Properties == nil || m.Properties.GroupID == nil {
		return ""
	}
	return *m.Properties.GroupID
}

// ReturnsCounted: Service Bus does not count a release.
func (*pipe) ReturnsCounted() bool { return false }

// Locks are the lease book's counters and, without sessions, those of the
// dispositions by lock token.
func (k *pipe) Locks() driver.Locks {
	b := k.book.Stats()
	l := driver.Locks{
		Held: b.Held, RenewRequests: b.Requests, Renewed: b.Renewed, RenewFailures: b.Failures,
		Lost: b.Lost, Unrenewable: b.Unrenewable,
	}
	if k.fallback != nil {
		l.SettledByToken, l.DispositionRequests = k.fallback.Taken(), k.fallback.Requests()
	}
	return l
}

// lockLost is told by the lease book of a lost lock, and why (wrapping
// ErrLockLost): the delivery is dropped if no handler has it, its
// settlement skipped if one has (the book has cancelled the handler's
// context).
func (k *pipe) lockLost(t driver.Ticket, m *amqp.Message, why error) { k.env.LeaseLost(t, m, why) }

var errNoLink = errors.New("amqpsub: no link to renew locks on")

// renewer renews the locks of a pipe's current link (Renewer).
type renewer struct{ k *pipe }

// RenewLocks renews tokens on the current link's $management node, within
// ctx. When that node's link pair is gone for good (it could not be
// attached again), no lock of the link can be renewed any more: the receive
// link is closed too, so that the engine attaches both anew, and the
// service delivers again what the link held.
//
// A test source attached in place of a link renews its own locks, if it
// can: SourceAttached sets sourceRenewer then. A broker's link never
// reaches that branch.
func (r renewer) RenewLocks(ctx context.Context, tokens []amqp.UUID) ([]time.Time, error) {
	k := r.k
	l, _ := k.env.Current()
	stopping := wait.Closed(k.env.Engine().Stopping())
	m := LinkManagement(l)
	if m == nil || stopping && l.Conn().Err() != nil {
		if sr := k.sourceRenewer.Load(); sr != nil {
			return (*sr).RenewLocks(ctx, tokens)
		}
		if stopping && k.fallback != nil {
			// Stopping without a live link: what handlers still have is
			// renewed on the stop node.
			m, err := k.stopNode(ctx)
			if err != nil {
				return nil, err
			}
			return m.RenewLocks(ctx, tokens)
		}
		return nil, errNoLink
	}
	exp, err := m.RenewLocks(ctx, tokens)
	if errors.Is(err, ErrNodeGone) {
		if now, _ := k.env.Current(); now == l && m.AbandonLink(ctx, l.Receiver()) {
			k.env.Log().Warn("the $management link is gone and could not be attached again; closing the receive link to attach both anew",
				zap.Error(err))
		}
	}
	return exp, err
}

// management returns the $management node of the pipe's current link,
// waiting, within ctx, for a link while none is attached, or while the one
// recorded is of a lost connection. While the pipe stops no link comes:
// the lost link's node serves while its connection is open (the core's
// attacher keeps it), and the stop node (stopNode) once it is not.
func (k *pipe) management(ctx context.Context) (*Management, error) {
	for {
		l, next := k.env.Current()
		if m := LinkManagement(l); m != nil && l.Conn().Err() == nil && !wait.Closed(m.Done()) {
			return m, nil
		}
		// None, or the one still recorded is of a connection that is gone
		// (the attacher has not replaced it yet): wait for the next.
		select {
		case <-next:
		case <-k.env.Engine().Stopping():
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

// awaitSession returns once no handler of src's session runs in this
// process, before the session's link is handed to the engine. ctx ends
// the wait with its error.
//
// A session whose link was lost while a handler of it ran goes back to the
// service, which gives it to the first receiver that asks (another slot,
// or this one again), and its messages, the one in that handler first,
// would otherwise run beside it. Those handlers' contexts were cancelled
// with the loss (see Session.Receive); one that does not return keeps the
// session's messages waiting here, its lock renewed, until it does.
func (k *pipe) awaitSession(ctx context.Context, src *Session) error {
	n := k.env.HandlersOf(src.ID())
	if n == 0 {
		return nil
	}
	k.env.Log().Info("the session's handlers from its lost link still run here; waiting for them before taking its messages",
		zap.String("session_id", src.ID()), zap.Int("slot", src.Slot()), zap.Int("handlers", n))
	t := time.NewTicker(sessionBusyPoll)
	defer t.Stop()
	for k.env.HandlersOf(src.ID()) > 0 {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-t.C:
		}
	}
	return nil
}
