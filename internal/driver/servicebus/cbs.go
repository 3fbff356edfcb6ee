package servicebus

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strconv"
	"time"

	"github.com/Azure/go-amqp"
	"github.com/amqpsub/amqpsub/internal/backoff"
	"go.uber.org/zap"
)

// Token is a credential for one audience, as amqpsub.Token.
type Token struct {
	Type   string
	Value  string
	Expiry time.Time // zero: never refreshed
}

// TokenFunc gives the token for an audience (amqpsub.TokenProvider's
// [Token]). It is called concurrently, and may ignore ctx: see tokenWithin.
type TokenFunc func(ctx context.Context, audience string) (Token, error)

// How tokens are refreshed (see amqpsub.TokenProvider).
const (
	// refreshTimeout bounds each refresh: the TokenProvider's call and the
	// put-token.
	refreshTimeout = 30 * time.Second
	// A failed refresh is tried again after a wait between half and all of
	// a ceiling that doubles from refreshRetryFloor up to refreshRetryMax.
	refreshRetryFloor = time.Second
	refreshRetryMax   = 30 * time.Second
	// refreshGiveUp is how long before a token expires the connection is
	// dropped when no refresh has succeeded (at most a tenth of the
	// token's lifetime).
	refreshGiveUp = 30 * time.Second
)

// claim is one audience's token on a connection.
type claim struct {
	audience string
	issued   time.Time // when the token in place was asked for
	expiry   time.Time // when it expires; zero: never
	next     time.Time // when to put the next one; zero: never
	failures int       // refreshes failed in a row
}

func newClaim(audience string, issued, expiry time.Time) claim {
	c := claim{audience: audience, issued: issued, expiry: expiry}
	if !expiry.IsZero() {
		c.next = refreshAt(issued, expiry)
	}
	return c
}

// giveUpAt is when the connection is dropped if no refresh has succeeded.
func (c *claim) giveUpAt() time.Time {
	return c.expiry.Add(-min(refreshGiveUp, max(0, c.expiry.Sub(c.issued))/10))
}

// refreshAt is when a token issued at issued and expiring at expiry is
// replaced: 10 minutes before it expires (as azservicebus does,
// internal/namespace.go nextClaimRefreshDuration; .NET's
// AmqpConnectionScope.cs, as read, 7 minutes before), or, for a token
// shorter-lived than 20 minutes, halfway (our own).
func refreshAt(issued, expiry time.Time) time.Time {
	return expiry.Add(-min(10*time.Minute, max(0, expiry.Sub(issued))/2))
}

// retryWait is the wait before the failures-th retry of a refresh: "equal
// jitter", between half the backoff ceiling and all of it.
func retryWait(failures int) time.Duration {
	c := backoff.Ceiling(failures-1, refreshRetryFloor, refreshRetryMax)
	return c/2 + rand.N(c/2+1) //nolint:gosec // G404: jitter spreads retries; nothing secret depends on it
}

// Refresher keeps a connection's tokens on $cbs: it puts each again before
// it expires, tries a failed refresh again until shortly before the token
// in place expires, and drops the connection (abort) then, or at once when
// the service refuses a token (it will not take the next either); the
// subscriber then reconnects, which claims anew. Its goroutine is started
// by startRefresher and ended by Stop.
type Refresher struct {
	// put gets a token for audience and puts it; it returns the token's
	// expiry.
	put    func(ctx context.Context, audience string) (time.Time, error)
	abort  func()
	log    *zap.Logger
	cancel context.CancelFunc
	done   chan struct{}
	// now carries PutNow's requests to the refresher's goroutine, which
	// owns the claims.
	now chan putNow
}

// putNow is a request of PutNow: put every claim's token again, within
// ctx, and answer on done (buffered).
type putNow struct {
	ctx  context.Context
	done chan error
}

// NewRefresher puts a token for each audience on conn's $cbs node, within
// ctx, and starts the [Refresher]; abort drops the connection. On an error
// the caller aborts conn.
func NewRefresher(ctx context.Context, conn *amqp.Conn, tp TokenFunc, audiences []string, abort func(), log *zap.Logger) (*Refresher, error) {
	sess, err := conn.NewSession(ctx, nil)
	if err != nil {
		return nil, fmt.Errorf("amqpsub: session for $cbs: %w", err)
	}
	cbs, err := newRPC(ctx, sess, "$cbs")
	if err != nil {
		return nil, fmt.Errorf("%w (%s)", err, notServiceBus)
	}
	p := &cbsPutter{cbs: cbs, tp: tp}
	claims := make([]claim, len(audiences))
	for i, a := range audiences {
		issued := time.Now()
		expiry, err := p.put(ctx, a)
		if err != nil {
			if errors.As(err, new(noAnswer)) {
				err = fmt.Errorf("%w (%s)", err, notServiceBus)
			}
			return nil, err
		}
		claims[i] = newClaim(a, issued, expiry)
	}
	return startRefresher(claims, p.put, abort, log), nil
}

// notServiceBus is the hint of an error that a server which is not Service
// Bus would cause.
const notServiceBus = "no answer to claims-based security: is this a Service Bus endpoint?"

// startRefresher starts refreshing claims with put; abort drops the
// connection. log (nil: none) hears of failed refreshes.
func startRefresher(claims []claim, put func(context.Context, string) (time.Time, error), abort func(), log *zap.Logger) *Refresher {
	ctx, cancel := context.WithCancel(context.Background())
	if log == nil {
		log = zap.NewNop()
	}
	r := &Refresher{put: put, abort: abort, log: log, cancel: cancel, done: make(chan struct{}), now: make(chan putNow)}
	go r.run(ctx, claims)
	return r
}

func (r *Refresher) run(ctx context.Context, claims []claim) {
	defer close(r.done)
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	for {
		var c *claim
		for i := range claims {
			if !claims[i].next.IsZero() && (c == nil || claims[i].next.Before(c.next)) {
				c = &claims[i]
			}
		}
		var due <-chan time.Time
		if c != nil {
			timer.Reset(time.Until(c.next))
			due = timer.C
		}
		select {
		case <-ctx.Done():
			return
		case req := <-r.now:
			timer.Stop()
			// Stop cuts it short too.
			pctx, cancel := context.WithCancel(req.ctx)
			stop := context.AfterFunc(ctx, cancel)
			req.done <- r.putAll(pctx, claims)
			stop()
			cancel()
			continue
		case <-due:
		}
		issued := time.Now()
		// No later than the token in place expires: a refresh that ends
		// after it is of no use.
		pctx, cancel := context.WithDeadline(ctx, minTime(issued.Add(refreshTimeout), c.expiry))
		expiry, err := r.put(pctx, c.audience)
		cancel()
		if ctx.Err() != nil {
			return
		}
		if err == nil {
			*c = newClaim(c.audience, issued, expiry)
			continue
		}
		c.failures++
		now := time.Now()
		if giveUp := c.giveUpAt(); IsCond(err, amqp.ErrCondUnauthorizedAccess) || !now.Before(giveUp) {
			// The links would be detached when the token expires (or the
			// service refuses our tokens): start afresh on a new
			// connection now, which claims anew, and fails for good if
			// the token is refused.
			r.log.Error("token refresh failed and the token in place is about to expire (or was refused); reconnecting",
				zap.String("audience", c.audience), zap.Int("attempt", c.failures), zap.Time("expiry", c.expiry), zap.Error(err))
			r.abort()
			return
		}
		c.next = minTime(now.Add(retryWait(c.failures)), c.giveUpAt())
		r.log.Warn("token refresh failed; trying again", zap.String("audience", c.audience),
			zap.Int("attempt", c.failures), zap.Duration("wait", time.Until(c.next)), zap.Time("expiry", c.expiry), zap.Error(err))
	}
}

// putAll puts a fresh token for every claim, within ctx, and returns the
// first error; each claim put anew starts its refresh schedule afresh.
func (r *Refresher) putAll(ctx context.Context, claims []claim) error {
	for i := range claims {
		issued := time.Now()
		expiry, err := r.put(ctx, claims[i].audience)
		if err != nil {
			return err
		}
		claims[i] = newClaim(claims[i].audience, issued, expiry)
	}
	return nil
}

// errRefresherStopped is PutNow's error once the Refresher has stopped.
var errRefresherStopped = errors.New("amqpsub: the connection's token refresher has stopped")

// PutNow puts a fresh token for every audience on the connection now, and
// returns once $cbs has answered them all, or ctx ends (the tokens are then
// in doubt). The service detaches a link with amqp:unauthorized-access
// when the token it was attached under expired or was revoked: the link is
// attached again on the same connection after this (see
// pipe.ReattachOn).
func (r *Refresher) PutNow(ctx context.Context) error {
	req := putNow{ctx: ctx, done: make(chan error, 1)}
	select {
	case r.now <- req:
	case <-r.done:
		return errRefresherStopped
	case <-ctx.Done():
		return ctx.Err()
	}
	select {
	case err := <-req.done:
		return err
	case <-ctx.Done():
		return ctx.Err()
	}
}

func minTime(a, b time.Time) time.Time {
	if b.Before(a) {
		return b
	}
	return a
}

// Stop ends the Refresher and waits for it. That is quick: a refresh in
// progress is cancelled, and a TokenProvider that does not return is left
// behind (tokenWithin). The $cbs session ends with the connection, which
// the caller closes next.
func (r *Refresher) Stop() {
	r.cancel()
	<-r.done
}

// cbsPutter puts tokens on a connection's $cbs node.
type cbsPutter struct {
	cbs *rpc
	tp  TokenFunc
}

// noAnswer wraps put's error when $cbs did not answer (or is gone).
type noAnswer struct{ error }

func (e noAnswer) Unwrap() error { return e.error }

// put gets a token for audience from the TokenProvider and puts it on
// $cbs, both within ctx; it returns the token's expiry (zero: never).
func (p *cbsPutter) put(ctx context.Context, audience string) (time.Time, error) {
	tok, err := tokenWithin(ctx, p.tp, audience)
	if err != nil {
		return time.Time{}, fmt.Errorf("amqpsub: token for %s: %w", audience, err)
	}
	expiration := "0"
	if !tok.Expiry.IsZero() {
		expiration = strconv.FormatInt(tok.Expiry.Unix(), 10)
	}
	req := &amqp.Message{Value: tok.Value, ApplicationProperties: map[string]any{
		"operation": "put-token", "type": tok.Type, "name": audience, "expiration": expiration,
	}}
	resp, err := p.cbs.call(ctx, req)
	if err != nil {
		return time.Time{}, fmt.Errorf("amqpsub: put-token for %s: %w", audience, noAnswer{err})
	}
	code, desc := status(resp)
	switch {
	case code >= 200 && code < 300:
	case code == 401 || code == 403:
		return time.Time{}, fmt.Errorf("amqpsub: Service Bus refused the token for %s (status %d: %s): %w",
			audience, code, desc, &amqp.Error{Condition: amqp.ErrCondUnauthorizedAccess, Description: desc})
	default:
		return time.Time{}, fmt.Errorf("amqpsub: put-token for %s: status %d: %s", audience, code, desc)
	}
	return tok.Expiry, nil
}

// tokenWithin calls tp.Token and returns at ctx's end at the latest. A
// provider that ignores ctx is left to return in its own time, in a
// goroutine that then only hands its result to a buffered channel nobody
// reads: no stop waits on user code.
func tokenWithin(ctx context.Context, tp TokenFunc, audience string) (Token, error) {
	if err := ctx.Err(); err != nil {
		return Token{}, err
	}
	type result struct {
		tok Token
		err error
	}
	ch := make(chan result, 1)
	go func() {
		tok, err := tp(ctx, audience)
		ch <- result{tok, err}
	}()
	select {
	case r := <-ch:
		return r.tok, r.err
	case <-ctx.Done():
		return Token{}, fmt.Errorf("the TokenProvider did not return in time: %w", ctx.Err())
	}
}
