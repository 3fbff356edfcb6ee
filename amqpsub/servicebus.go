package amqpsub

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/url"
	"slices"
	"strings"
	"time"

	"github.com/Azure/go-amqp"

	"github.com/amqpsub/amqpsub/internal/driver/servicebus"
	"github.com/amqpsub/amqpsub/internal/wire"
)

// ServiceBus returns a [Connector] for Azure Service Bus from a connection
// string as the Azure portal gives it:
//
//	Endpoint=sb://<namespace>.servicebus.windows.net/;SharedAccessKeyName=<rule>;SharedAccessKey=<key>
//
// or with SharedAccessSignature=<token> in place of the key name and key,
// EntityPath=<entity> and UseDevelopmentEmulator=true optional.
//
// It connects with TLS to the Endpoint's port, 5671 when it names none (the
// emulator: plain AMQP to the Endpoint's port or 5672, on any host, such as
// localhost or the emulator's service name in a compose file), and
// authenticates with SASL ANONYMOUS and claims-based security: a SAS token
// for the entity and one for its $management node, put on $cbs at once and
// again before they expire (tokens signed with the key last 2 h; a pre-made
// SharedAccessSignature is used as it is, never refreshed). See
// [TokenProvider] for when tokens are refreshed and what a failed refresh
// does. A refused token ends Run with an error naming the entity (never the
// key), which [IsFatal] takes as fatal.
//
// Subscribers made with it use the [AzureServiceBus] profile. A connection
// string with EntityPath reads that entity only: New must be given it as
// the queue or, below it, one of a topic's subscriptions
// (<topic>/Subscriptions/<name>) or a dead-letter queue
// (…/$DeadLetterQueue), names compared case-insensitively; another queue
// is an error wrapping [ErrInvalidOption] (use a namespace-level
// connection string for it). An invalid connection string gives an error wrapping
// [ErrConnectionString] that names the key at fault and quotes none of the
// string's values.
func ServiceBus(connectionString string) (Connector, error) {
	cs, err := servicebus.ParseConnString(connectionString)
	if err != nil {
		return nil, err
	}
	var tp TokenProvider = staticSAS(cs.SAS)
	if cs.SAS == "" {
		tp = SASTokenProvider(cs.KeyName, cs.Key, 2*time.Hour)
	}
	return newSBConnector(cs.Host, cs.Emulator, cs.Entity, tp), nil
}

// ServiceBusWithToken returns a [Connector] for the Service Bus namespace at
// endpoint ("sb://<namespace>.servicebus.windows.net", or, for the
// emulator, "amqp://localhost:5672") that authenticates with the tokens tp
// gives: an Entra ID (JWT) source, say (see [TokenProvider]), or
// [SASTokenProvider] with a lifetime of your choice. See [ServiceBus].
//
// sb:// and amqps:// connect with TLS, to the endpoint's port or 5671;
// amqp:// (the emulator, on any host: localhost, or its service name in a
// compose file) without, to its port or 5672. The endpoint is a URL, not a
// connection string (give that to ServiceBus).
//
// Errors wrap [ErrInvalidOption] and quote nothing of endpoint.
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
		return nil, fmt.Errorf("%w: the endpoint is not a URL like sb://<namespace>.servicebus.windows.net%s", ErrInvalidOption, servicebus.SeparatorHint(endpoint))
	}
	if u.User != nil {
		return nil, fmt.Errorf("%w: the endpoint must not hold credentials", ErrInvalidOption)
	}
	if !servicebus.ValidHost(u.Hostname()) {
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
	// The claims: one for the entity, one for its $management node, at the
	// entity's own path: a dead-letter queue's are
	// <entity>/$DeadLetterQueue[/$management], as azservicebus claims them
	// (internal/amqpLinks.go).
	r, err := servicebus.NewRefresher(ctx, conn.conn, tokenFunc(c.tp),
		[]string{c.audience(req.entity), c.audience(servicebus.ManagementNode(req.entity))}, conn.abort, req.log)
	if err != nil {
		conn.abort()
		return nil, err
	}
	conn.stop, conn.reclaim = r.Stop, r.PutNow
	return conn, nil
}

// MaxLockRenewal bounds, on Azure Service Bus, how long after its handler
// began a delivery's message lock is still renewed ([LocalRetry]'s waits
// included). Set it above the longest handler. After that the lock expires
// (up to one lock duration later), the handler's context is cancelled
// (cause [ErrLockLost]), its result is not sent, and the service delivers
// the message again, counted: its work may be done twice, and under
// [WorkersByKey] its group's order is broken. A delivery waiting for a
// handler has its lock renewed for as long as it waits.
//
// Must be ≥ 0, 0 renewing no lock of a delivery in a handler, and only
// under the [AzureServiceBus] profile ([ErrInvalidOption] otherwise).
// Default: 5 min.
// Why: docs/options.md#maxlockrenewal.
func MaxLockRenewal(d time.Duration) Option {
	return checked("MaxLockRenewal", d, d >= 0, "must be ≥ 0", func(c *config) {
		o := sbOptionsOf(c)
		o.given = append(o.given, "MaxLockRenewal")
		if o.o.MaxRenewal = d; d == 0 {
			o.o.MaxRenewal = time.Nanosecond
		}
	})
}

// maxSessions bounds Sessions and SessionIDs: each session held is a
// connection and a pipeline of its own.
const maxSessions = 256

// Sessions makes the subscriber a session consumer of a session-enabled
// Service Bus entity: it holds up to max sessions at once, each on a link
// and a connection of its own with its share of the credit (at least 1),
// accepting the next available session whenever it has room. Each
// session's handlers run as [Workers] or [WorkersByKey] say: with the
// default Workers(1), Sessions(4) runs up to 4 handlers at once, each
// session's messages one at a time, in order. A session's lock is renewed
// while it is held; one with no message for [SessionIdleTimeout] is closed
// and the next accepted. [Delivery.SessionState] and
// [Delivery.SetSessionState] read and write the session's state.
//
// Only with the [AzureServiceBus] profile, not with [SessionIDs], and max
// between 1 and 256; New rejects anything else ([ErrInvalidOption]).
// Default: off (the entity must not require sessions).
// Why: docs/options.md#sessions.
func Sessions(max int) Option {
	return optionFunc(func(c *config) {
		if max < 1 || max > maxSessions {
			c.invalid("Sessions(%d): must be between 1 and %d", max, maxSessions)
			return
		}
		o := sbOptionsOf(c)
		o.maxSessions = max
		c.slots = make([]string, max)
	})
}

// SessionIDs makes the subscriber a session consumer of the named sessions
// only, each on a link of its own, held for as long as the subscriber runs
// (a session left idle for [SessionIdleTimeout] is accepted again). See
// [Sessions]. Not with Sessions; at least one id and at most 256, none empty,
// none twice; New rejects anything else ([ErrInvalidOption]). Default: off.
func SessionIDs(ids ...string) Option {
	return optionFunc(func(c *config) {
		if len(ids) == 0 || len(ids) > maxSessions || slices.Contains(ids, "") {
			c.invalid("SessionIDs(%q): give between 1 and %d ids, none empty", ids, maxSessions)
			return
		}
		seen := make(map[string]bool, len(ids))
		for _, id := range ids {
			if seen[id] {
				c.invalid("SessionIDs: %q given twice (a session is locked by one link at a time)", id)
				return
			}
			seen[id] = true
		}
		o := sbOptionsOf(c)
		o.ids = slices.Clone(ids)
		c.slots = o.ids
	})
}

// SessionIdleTimeout is how long a session consumer keeps a session that
// sends no message (and of which it holds none) before it closes it and
// accepts the next. A finished session holds its slot that long, and the
// sessions beyond [Sessions]' max wait for a slot: with many short sessions,
// a few seconds keeps the consumer moving. Must be > 0, and only under
// the [AzureServiceBus] profile ([ErrInvalidOption] otherwise). Default:
// 1 min.
func SessionIdleTimeout(d time.Duration) Option {
	return checked("SessionIdleTimeout", d, d > 0, "must be > 0", func(c *config) {
		o := sbOptionsOf(c)
		o.given = append(o.given, "SessionIdleTimeout")
		o.o.SessionIdle = d
	})
}

// SettleTimeout bounds, on Azure Service Bus, how long a settlement waits
// for the service's answer; one unanswered by then is counted
// (Stats.Locks.SettleTimeouts) and left to the lock's expiry. The bound
// is also the write deadline of the settlement's frame, and go-amqp ends
// the whole connection on a write that misses its deadline: below a second
// a busy connection would be torn down and handled messages delivered
// again. Must be ≥ 1 s, and only under the [AzureServiceBus] profile
// ([ErrInvalidOption] otherwise). Default: 30 s.
func SettleTimeout(d time.Duration) Option {
	return checked("SettleTimeout", d, d >= time.Second, "must be ≥ 1s (it is also the frame's write deadline)", func(c *config) {
		o := sbOptionsOf(c)
		o.given = append(o.given, "SettleTimeout")
		o.o.SettleTimeout = d
	})
}

// Token is a credential for one audience of Service Bus, put on the
// connection's $cbs node (claims-based security).
type Token struct {
	// Type is [TokenTypeSAS] or [TokenTypeJWT].
	Type string
	// Value is the token itself: "SharedAccessSignature sr=…" for SAS, the
	// JWT for Entra ID.
	Value string
	// Expiry is when the token stops being valid; the subscriber puts a new
	// one before then. The zero time means it is never refreshed, and is
	// for a pre-made SAS token only ([TokenTypeSAS]): a token of any other
	// type with no Expiry is refused with an error wrapping
	// [ErrInvalidOption], since Service Bus would detach the links when it
	// expired.
	Expiry time.Time
}

// The token types Service Bus takes on $cbs.
const (
	TokenTypeSAS = "servicebus.windows.net:sastoken"
	TokenTypeJWT = "jwt"
)

// TokenProvider gives the tokens a Service Bus connector puts on $cbs.
//
// audience is "amqps://<namespace>/<entity path>" ("amqp://" in emulator
// mode), for the entity and for "<entity path>/$management". An Entra ID
// provider returns type [TokenTypeJWT] with the access token for the scope
// "https://servicebus.azure.net/.default" (the same token for every
// audience) and its expiry.
//
// When Token is called: each connection asks for one token per audience
// (two calls, one after the other) when it connects, and again for each
// audience 10 minutes before its token's Expiry (halfway, for a token that
// lives less than 20 minutes). A subscriber has a connection of its own
// for each session it holds ([Sessions], [SessionIDs]) and makes a new one
// after a lost connection, so Token is called concurrently and must be
// safe for concurrent use; a provider that can should cache its token.
//
// Each call is bounded by ctx's deadline: [DialTimeout] when connecting;
// 30 s, and no later than the token in place expires, for a refresh. Token
// should return when ctx ends; one that does not is left to return in its
// own time (its result is dropped), and does not hold up Run or Close. A
// refresh that fails (an error, a deadline, no answer from $cbs) is tried
// again, after waits that double from about 1 s up to 30 s (jittered),
// until 30 s (at most a tenth of the token's lifetime) before the token in
// place expires; then the connection is dropped and made anew, which asks
// for tokens again. A token the service refuses (status 401 or 403) drops the
// connection at once, and the reconnect's refusal ends Run ([IsFatal]).
//
// An adapter for azidentity (any azcore.TokenCredential), kept out of
// amqpsub so that its go.mod stays small:
//
//	type entraTokens struct{ cred azcore.TokenCredential }
//
//	func (e entraTokens) Token(ctx context.Context, _ string) (amqpsub.Token, error) {
//		t, err := e.cred.GetToken(ctx, policy.TokenRequestOptions{
//			Scopes: []string{"https://servicebus.azure.net/.default"},
//		})
//		if err != nil {
//			return amqpsub.Token{}, err
//		}
//		return amqpsub.Token{Type: amqpsub.TokenTypeJWT, Value: t.Token, Expiry: t.ExpiresOn}, nil
//	}
//
//	cred, err := azidentity.NewDefaultAzureCredential(nil) // azidentity caches and refreshes the token
//	...
//	c, err := amqpsub.ServiceBusWithToken("sb://<namespace>.servicebus.windows.net", entraTokens{cred})
type TokenProvider interface {
	Token(ctx context.Context, audience string) (Token, error)
}

// SASTokenProvider returns a [TokenProvider] that signs SAS tokens with a
// shared access key, each valid for lifetime (the Azure SDKs use 2 h; must
// be > 0).
func SASTokenProvider(keyName, key string, lifetime time.Duration) TokenProvider {
	return sasProvider{keyName: keyName, key: key, lifetime: lifetime, now: time.Now}
}

type sasProvider struct {
	keyName, key string
	lifetime     time.Duration
	now          func() time.Time
}

func (p sasProvider) Token(_ context.Context, audience string) (Token, error) {
	expiry := p.now().Add(p.lifetime).Truncate(time.Second)
	return Token{Type: TokenTypeSAS, Value: servicebus.SignSAS(p.keyName, p.key, audience, expiry.Unix()), Expiry: expiry}, nil
}

// staticSAS is a pre-made SharedAccessSignature: used as it is, never
// refreshed.
type staticSAS string

func (s staticSAS) Token(context.Context, string) (Token, error) {
	return Token{Type: TokenTypeSAS, Value: string(s)}, nil
}

// tokenFunc is tp as the refresher calls it. A token with no Expiry that is
// not a pre-made SAS token is refused with an error wrapping
// ErrInvalidOption (IsFatal): it would never be refreshed, and Service Bus
// detaches the links when it expires.
func tokenFunc(tp TokenProvider) servicebus.TokenFunc {
	return func(ctx context.Context, audience string) (servicebus.Token, error) {
		tok, err := tp.Token(ctx, audience)
		if err == nil && tok.Expiry.IsZero() && tok.Type != TokenTypeSAS {
			err = fmt.Errorf("the TokenProvider gave a %q token with no Expiry: "+
				"it would never be refreshed, and Service Bus detaches the links when it expires "+
				"(only a pre-made SAS token may have none): %w", tok.Type, ErrInvalidOption)
		}
		return servicebus.Token(tok), err
	}
}

// validate gives a subscriber on a Service Bus connector the
// AzureServiceBus profile (no other will do), and checks the queue against
// the connection string's EntityPath (servicebus.InEntity).
func (c *sbConnector) validate(cfg *config, queue string) {
	peekLockProfile(cfg)
	if c.entity != "" && !servicebus.InEntity(c.entity, queue) {
		cfg.invalid("queue %q is outside the connection string's EntityPath %q (its subscriptions and dead-letter queues are inside): "+
			"to read another entity, use a namespace-level connection string, without EntityPath", queue, c.entity)
	}
}

// AzureServiceBus is for Azure Service Bus in peek-lock mode; the
// [ServiceBus] connector selects it. The queue name is the entity path: a
// queue, "<topic>/Subscriptions/<subscription>", or either followed by
// "/$DeadLetterQueue" (an entity of its own: its claims, lock renewals
// and settlements by lock token go to its own path and its own
// "<entity>/$DeadLetterQueue/$management" node). Accept completes a message; [Retry] abandons it
// (modified: Service Bus counts it towards [MaxDeliveryCount] and
// dead-letters it there); [Release] releases it (the service does not
// count a release, so the buffered deliveries a stop gives back do not
// count either; a release sent by lock token, once the delivery's link
// is gone, goes as an abandon, counted, and is [OutcomeModified] in
// Stats and OnSettled); [Reject] dead-letters it with DeadLetterReason and
// DeadLetterErrorDescription. Settlements wait for the service's
// answer, many at a time, and the lock of every delivery held is
// renewed ([MaxLockRenewal]).
var AzureServiceBus = azureServiceBus()

func init() { known = append(known, AzureServiceBus) }

func azureServiceBus() Profile { return newProfile(servicebus.Driver{}) }

// sbOptions are Service Bus's options (config.broker).
type sbOptions struct {
	o servicebus.Options
	// maxSessions and ids: Sessions and SessionIDs, of which one may be
	// given (each sets config.slots).
	maxSessions int
	ids         []string
	// given names the other options given, for New to refuse under
	// another profile.
	given []string
}

// sbOptionsOf returns cfg's Service Bus options, made with their defaults
// by the first option that sets one.
func sbOptionsOf(c *config) *sbOptions {
	o, ok := c.broker.(*sbOptions)
	if !ok {
		o = &sbOptions{o: servicebus.DefaultOptions()}
		c.broker = o
	}
	return o
}

// check checks that the options are given under the AzureServiceBus
// profile, and Sessions and SessionIDs.
func (o *sbOptions) check(cfg *config) {
	if len(o.given) > 0 && !cfg.profile.f.PeekLock {
		slices.Sort(o.given)
		cfg.invalid("%s: only for the AzureServiceBus profile, not %s", strings.Join(slices.Compact(o.given), ", "), cfg.profile)
	}
	if o.maxSessions == 0 && len(o.ids) == 0 {
		return
	}
	switch {
	case !cfg.profile.f.PeekLock:
		cfg.invalid("Sessions and SessionIDs need the AzureServiceBus profile")
	case o.maxSessions > 0 && len(o.ids) > 0:
		cfg.invalid("give Sessions or SessionIDs, not both")
	}
	o.o.Sessions = true
}

func (o *sbOptions) driver() any { return o.o }

// peekLockProfile sets the AzureServiceBus profile unless another was
// given, which is an error.
func peekLockProfile(cfg *config) {
	switch {
	case !cfg.profileSet:
		cfg.profile = AzureServiceBus
	case !cfg.profile.f.PeekLock:
		cfg.invalid("WithProfile(%s) with a Service Bus connector: use AzureServiceBus", cfg.profile)
	}
}

// SessionID returns the Service Bus session the delivery belongs to, when
// it came through a session consumer ([Sessions], [SessionIDs]); "" otherwise.
func (d *Delivery) SessionID() string {
	if d.l == nil {
		return ""
	}
	if src := servicebus.LinkSession(d.l); src != nil {
		return src.ID()
	}
	return ""
}

// SessionState returns the state stored with the delivery's session (nil
// when none is set), from the service. It returns an error wrapping
// [ErrNoSession] when the delivery did not come through a session consumer,
// or its session is no longer held. ctx bounds the request.
func (d *Delivery) SessionState(ctx context.Context) ([]byte, error) {
	src, err := d.heldSession()
	if err != nil {
		return nil, err
	}
	state, err := src.State(ctx)
	return state, sessionErr(err)
}

// SetSessionState stores state with the delivery's session (nil clears
// it). Errors as SessionState.
func (d *Delivery) SetSessionState(ctx context.Context, state []byte) error {
	src, err := d.heldSession()
	if err != nil {
		return err
	}
	return sessionErr(src.SetState(ctx, state))
}

func (d *Delivery) heldSession() (*servicebus.Session, error) {
	if d.l == nil {
		return nil, ErrNoSession
	}
	src := servicebus.LinkSession(d.l)
	switch {
	case src == nil:
		return nil, ErrNoSession
	case d.t.Stale():
		return nil, fmt.Errorf("%w: session %q: its link is gone", ErrNoSession, src.ID())
	}
	return src, nil
}

func sessionErr(err error) error {
	if errors.Is(err, ErrLockLost) {
		return fmt.Errorf("%w: %w", ErrNoSession, err)
	}
	return err
}
