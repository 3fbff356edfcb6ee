package amqpsub

import (
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"net"
	"net/url"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/Azure/go-amqp"
	"go.uber.org/zap"

	"github.com/amqpsub/amqpsub/internal/backoff"
	"github.com/amqpsub/amqpsub/internal/wire"
	"github.com/amqpsub/amqpsub/lease"
)

// ServiceBus returns a Connector for Azure Service Bus from a connection
// string as the Azure portal gives it:
//
//	Endpoint=sb://<namespace>.servicebus.windows.net/;SharedAccessKeyName=<rule>;SharedAccessKey=<key>
//
// or with SharedAccessSignature=<token> in place of the key name and key,
// EntityPath=<entity> and UseDevelopmentEmulator=true optional. It connects
// with TLS to the Endpoint's port, 5671 when it names none (the emulator:
// plain AMQP to the Endpoint's port or 5672, on any host, such as
// localhost or the emulator's service name in a compose file),
// authenticates with SASL ANONYMOUS and claims-based security: a SAS token
// for the entity and one for its $management node, put on $cbs at once and
// again before they expire (tokens signed with the key last 2 h; a pre-made
// SharedAccessSignature is used as it is, never refreshed). See
// TokenProvider for when tokens are refreshed and what a failed refresh
// does. A refused token ends Run with an error naming the entity (never the
// key), which IsFatal takes as fatal.
//
// Subscribers made with it use the AzureServiceBus profile. A connection
// string with EntityPath takes that entity only: New must be given it as
// the queue. An invalid connection string gives an error wrapping
// ErrConnectionString that names the key at fault and quotes none of the
// string's values.
func ServiceBus(connectionString string) (Connector, error) {
	cs, err := parseSBConnString(connectionString)
	if err != nil {
		return nil, err
	}
	var tp TokenProvider = staticSAS(cs.sas)
	if cs.sas == "" {
		tp = SASTokenProvider(cs.keyName, cs.key, 2*time.Hour)
	}
	return newSBConnector(cs.host, cs.emulator, cs.entity, tp), nil
}

// ServiceBusWithToken returns a Connector for the Service Bus namespace at
// endpoint ("sb://<namespace>.servicebus.windows.net", or, for the
// emulator, "amqp://localhost:5672") that authenticates with the tokens tp
// gives: an Entra ID (JWT) source, say (see TokenProvider), or
// SASTokenProvider with a lifetime of your choice. sb:// and amqps://
// connect with TLS, to the endpoint's port or 5671; amqp:// (the emulator,
// on any host: localhost, or its service name in a compose file) without,
// to its port or 5672. The endpoint is a URL,
// not a connection string (give that to ServiceBus). See ServiceBus. Errors
// wrap ErrInvalidOption and quote nothing of endpoint.
func ServiceBusWithToken(endpoint string, tp TokenProvider) (Connector, error) {
	if tp == nil {
		return nil, fmt.Errorf("%w: nil TokenProvider", ErrInvalidOption)
	}
	// The endpoint is never quoted: a connection string given here by
	// mistake holds the key.
	if strings.ContainsAny(endpoint, ";=") {
		return nil, fmt.Errorf("%w: the endpoint holds ';' or '=': it looks like a connection string; give that to ServiceBus, "+
			"and ServiceBusWithToken only the namespace's URL, sb://<namespace>.servicebus.windows.net", ErrInvalidOption)
	}
	u, err := url.Parse(endpoint)
	if err != nil || u.Host == "" {
		return nil, fmt.Errorf("%w: the endpoint is not a URL like sb://<namespace>.servicebus.windows.net%s", ErrInvalidOption, separatorHint(endpoint))
	}
	if u.User != nil {
		return nil, fmt.Errorf("%w: the endpoint must not hold credentials", ErrInvalidOption)
	}
	if !validHost(u.Hostname()) {
		return nil, fmt.Errorf("%w: the endpoint's host is not a host name or an IP address", ErrInvalidOption)
	}
	switch u.Scheme {
	case "sb", "amqps":
		return newSBConnector(u.Host, false, "", tp), nil
	case "amqp":
		return newSBConnector(u.Host, true, "", tp), nil
	}
	return nil, fmt.Errorf("%w: the endpoint's scheme must be sb, amqps, or amqp (the emulator, without TLS)", ErrInvalidOption)
}

type sbConnector struct {
	host     string // the Endpoint's host[:port]: the namespace in audiences
	dialHost string // its host
	port     string // its port, or the default (5671; the emulator's 5672)
	emulator bool   // plain AMQP, no TLS
	entity   string // EntityPath; "" when any
	tp       TokenProvider
}

// newSBConnector returns the connector for the endpoint host (host or
// host:port, as a URL's Host).
func newSBConnector(host string, emulator bool, entity string, tp TokenProvider) *sbConnector {
	c := &sbConnector{host: host, dialHost: host, port: "5671", emulator: emulator, entity: entity, tp: tp}
	if emulator {
		c.port = "5672"
	}
	if h, p, err := net.SplitHostPort(host); err == nil {
		c.dialHost, c.port = h, p
	}
	c.dialHost = strings.TrimSuffix(strings.TrimPrefix(c.dialHost, "["), "]")
	return c
}

// String names the endpoint with the port it dials.
func (c *sbConnector) String() string {
	hp := net.JoinHostPort(c.dialHost, c.port)
	if c.emulator {
		return "amqp://" + hp + " (Service Bus emulator)"
	}
	return "sb://" + hp
}

// audience is the name a token is put for: the node's address on the
// namespace.
func (c *sbConnector) audience(path string) string {
	scheme := "amqps"
	if c.emulator {
		scheme = "amqp"
	}
	return scheme + "://" + c.host + "/" + path
}

func (c *sbConnector) connect(ctx context.Context, req connectRequest) (*connection, error) {
	opts := &amqp.ConnOptions{
		SASLType:    amqp.SASLTypeAnonymous(),
		IdleTimeout: req.idle,
		MaxSessions: 65535,
		Properties:  map[string]any{"product": "amqpsub"},
	}
	if !c.emulator {
		opts.HostName = c.dialHost
	}
	// Errors name the connector, whose String says the host and port.
	conn, err := dialAMQP(ctx, c.dialHost, c.port, !c.emulator, opts, wire.Options{})
	if err != nil {
		return nil, err
	}
	// The claims: one for the entity, one for its $management node. A
	// session or subscription path is claimed as a whole.
	entity := strings.TrimSuffix(req.entity, "/$DeadLetterQueue")
	r, err := newRefresher(ctx, conn, c.tp, []string{c.audience(entity), c.audience(entity + "/$management")}, req.log)
	if err != nil {
		conn.abort()
		return nil, err
	}
	conn.stop = r.stop
	return conn, nil
}

// ErrCondDeadLetter is the error condition of a rejected outcome that
// Service Bus takes as "dead-letter this message".
const ErrCondDeadLetter amqp.ErrCond = "com.microsoft:dead-letter"

// How tokens are refreshed (see TokenProvider).
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
// replaced: 10 minutes before it expires (as the Azure SDKs do), or, for a
// token shorter-lived than 20 minutes, halfway.
func refreshAt(issued, expiry time.Time) time.Time {
	return expiry.Add(-min(10*time.Minute, max(0, expiry.Sub(issued))/2))
}

// retryWait is the wait before the failures-th retry of a refresh: "equal
// jitter", between half the backoff ceiling and all of it.
func retryWait(failures int) time.Duration {
	c := backoff.Ceiling(failures-1, refreshRetryFloor, refreshRetryMax)
	return c/2 + rand.N(c/2+1) //nolint:gosec // G404: jitter spreads retries; nothing secret depends on it
}

// refresher keeps a connection's tokens on $cbs: it puts each again before
// it expires, tries a failed refresh again until shortly before the token
// in place expires, and drops the connection (abort) then, or at once when
// the service refuses a token (it will not take the next either); the
// subscriber then reconnects, which claims anew. Its goroutine is started
// by startRefresher and ended by stop.
type refresher struct {
	// put gets a token for audience and puts it; it returns the token's
	// expiry.
	put    func(ctx context.Context, audience string) (time.Time, error)
	abort  func()
	log    *zap.Logger
	cancel context.CancelFunc
	done   chan struct{}
}

// newRefresher puts a token for each audience on conn's $cbs node, within
// ctx, and starts the refresher. On an error the caller aborts conn.
func newRefresher(ctx context.Context, conn *connection, tp TokenProvider, audiences []string, log *zap.Logger) (*refresher, error) {
	sess, err := conn.conn.NewSession(ctx, nil)
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
	return startRefresher(claims, p.put, conn.abort, log), nil
}

// notServiceBus is the hint of an error that a server which is not Service
// Bus would cause.
const notServiceBus = "no answer to claims-based security: is this a Service Bus endpoint?"

// startRefresher starts refreshing claims with put; abort drops the
// connection. log (nil: none) hears of failed refreshes.
func startRefresher(claims []claim, put func(context.Context, string) (time.Time, error), abort func(), log *zap.Logger) *refresher {
	ctx, cancel := context.WithCancel(context.Background())
	if log == nil {
		log = zap.NewNop()
	}
	r := &refresher{put: put, abort: abort, log: log, cancel: cancel, done: make(chan struct{})}
	go r.run(ctx, claims)
	return r
}

func (r *refresher) run(ctx context.Context, claims []claim) {
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
		if c == nil {
			<-ctx.Done()
			return
		}
		timer.Reset(time.Until(c.next))
		select {
		case <-ctx.Done():
			return
		case <-timer.C:
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
		if giveUp := c.giveUpAt(); isCond(err, amqp.ErrCondUnauthorizedAccess) || !now.Before(giveUp) {
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

func minTime(a, b time.Time) time.Time {
	if b.Before(a) {
		return b
	}
	return a
}

// stop ends the refresher and waits for it. That is quick: a refresh in
// progress is cancelled, and a TokenProvider that does not return is left
// behind (tokenWithin). The $cbs session ends with the connection, which
// the caller closes next.
func (r *refresher) stop() {
	r.cancel()
	<-r.done
}

// cbsPutter puts tokens on a connection's $cbs node.
type cbsPutter struct {
	cbs *rpc
	tp  TokenProvider
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
	if tok.Expiry.IsZero() && tok.Type != TokenTypeSAS {
		return time.Time{}, fmt.Errorf("amqpsub: token for %s: the TokenProvider gave a %q token with no Expiry: "+
			"it would never be refreshed, and Service Bus detaches the links when it expires "+
			"(only a pre-made SAS token may have none): %w", audience, tok.Type, ErrInvalidOption)
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
func tokenWithin(ctx context.Context, tp TokenProvider, audience string) (Token, error) {
	if err := ctx.Err(); err != nil {
		return Token{}, err
	}
	type result struct {
		tok Token
		err error
	}
	ch := make(chan result, 1)
	go func() {
		tok, err := tp.Token(ctx, audience)
		ch <- result{tok, err}
	}()
	select {
	case r := <-ch:
		return r.tok, r.err
	case <-ctx.Done():
		return Token{}, fmt.Errorf("the TokenProvider did not return in time: %w", ctx.Err())
	}
}

// management is an entity's $management node on a link's session. Its rpc
// attaches a new link pair when one dies; when that fails, abandonLink
// gives up the receive link too (see renewer and sessionSource).
type management struct {
	*rpc
	linkName string // the receive link, named in each request

	abandoned atomic.Bool // abandonLink has run
}

// lockLostStatus is the status code $management answers for a lock that
// is lost (or unknown).
const lockLostStatus = 410

// RenewLocks renews message locks (lease.Renewer). Its errors are
// request's; a 200 whose expirations are not one per token wraps
// lease.ErrIncomplete. The lease book decides what each means for the
// locks.
func (m *management) RenewLocks(ctx context.Context, tokens []amqp.UUID) ([]time.Time, error) {
	const op = "com.microsoft:renew-lock"
	resp, err := m.request(ctx, op, map[string]any{"lock-tokens": tokens})
	if err != nil {
		return nil, err
	}
	body, _ := resp.Value.(map[string]any)
	exp, ok := body["expirations"].([]time.Time)
	if !ok || len(exp) != len(tokens) {
		return nil, fmt.Errorf("amqpsub: %s: %d expirations for %d locks: %w", op, len(exp), len(tokens), lease.ErrIncomplete)
	}
	return exp, nil
}

// errorCondition is the errorCondition application property of a
// $management answer, which Service Bus sets on a failure ("" if none).
func errorCondition(m *amqp.Message) amqp.ErrCond {
	switch v := m.ApplicationProperties["errorCondition"].(type) {
	case amqp.Symbol:
		return amqp.ErrCond(v)
	case string:
		return amqp.ErrCond(v)
	}
	return ""
}

// request sends operation with body and returns the answer, or an error:
// a *statusError for an answer that is not a success (wrapping
// lease.ErrLockLost for status 410, lease.ErrBadRequest for 400, and
// lease.ErrServerBusy for 503 or an errorCondition of
// com.microsoft:server-busy, which the .NET client maps both to
// ServiceBusy), one wrapping errNodeGone when the $management link pair is
// gone for good, or the link's error. ctx bounds it; when ctx ends first,
// the operation is in doubt.
func (m *management) request(ctx context.Context, operation string, body map[string]any) (*amqp.Message, error) {
	props := map[string]any{"operation": operation, "associated-link-name": m.linkName}
	if dl, ok := ctx.Deadline(); ok {
		props["com.microsoft:server-timeout"] = millis32(time.Until(dl))
	}
	resp, err := m.call(ctx, &amqp.Message{Value: body, ApplicationProperties: props})
	if err != nil {
		return nil, err
	}
	code, desc := status(resp)
	if code >= 200 && code < 300 {
		return resp, nil
	}
	e := &statusError{op: operation, code: code, desc: desc}
	switch {
	case code == lockLostStatus:
		e.kind = errLockLost
	case code == 400:
		e.kind = lease.ErrBadRequest
	case code == 503 || errorCondition(resp) == errCondServerBusy:
		e.kind = lease.ErrServerBusy
	}
	return nil, e
}

// statusError is a $management answer with a status that is not a
// success; kind, when not nil, is the sentinel it wraps.
type statusError struct {
	op   string
	code int
	desc string
	kind error
}

func (e *statusError) Error() string {
	if e.kind != nil {
		return fmt.Sprintf("amqpsub: %s: status %d: %s: %v", e.op, e.code, e.desc, e.kind)
	}
	return fmt.Sprintf("amqpsub: %s: status %d: %s", e.op, e.code, e.desc)
}

func (e *statusError) Unwrap() error { return e.kind }

// transientStatus reports whether a $management request that failed with
// err may succeed if sent again: the service was busy (503), failed
// inside (500), or timed out (408), as azservicebus retries them
// (internal/errors.go).
func transientStatus(err error) bool {
	var se *statusError
	if !errors.As(err, &se) {
		return false
	}
	switch se.code {
	case 408, 500, 503:
		return true
	}
	return errors.Is(se, lease.ErrServerBusy)
}

// abandonLink closes rcv, the receive link the node serves, once its
// $management link pair is gone for good: no lock of it can be renewed any
// more, so the pump is made to attach both anew (held deliveries are
// redelivered by the service). ctx bounds the wait for the service's
// answer; the link is closing either way. It reports whether this call
// closed it (false after the first).
func (m *management) abandonLink(ctx context.Context, rcv *amqp.Receiver) bool {
	if rcv == nil || !m.abandoned.CompareAndSwap(false, true) {
		return false
	}
	_ = rcv.Close(ctx)
	return true
}

// errLockLost is the error users see (in events and $management errors)
// for a lock the service says is lost: ErrLockLost.
var errLockLost = lease.ErrLockLost

// millis32 is d in whole milliseconds as an AMQP uint, clamped to its range
// (a negative d is 0; past 49 days, the most a uint holds).
func millis32(d time.Duration) uint32 {
	ms := max(0, d/time.Millisecond)
	if ms > math.MaxUint32 {
		return math.MaxUint32
	}
	return uint32(ms)
}
