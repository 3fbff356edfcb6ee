package amqpsub

import (
	"context"
	"fmt"
	"net"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/Azure/go-amqp"

	"github.com/amqpsub/amqpsub/lease"
)

// ServiceBus returns a Connector for Azure Service Bus from a connection
// string as the Azure portal gives it:
//
//	Endpoint=sb://<namespace>.servicebus.windows.net/;SharedAccessKeyName=<rule>;SharedAccessKey=<key>
//
// or with SharedAccessSignature=<token> in place of the key name and key,
// EntityPath=<entity> and UseDevelopmentEmulator=true optional. It connects
// with TLS to port 5671 (the emulator: plain AMQP, on localhost only, to
// the Endpoint's port or 5672), authenticates with SASL ANONYMOUS and
// claims-based security: a SAS token for the entity and one for its
// $management node, put on $cbs at once and again before they expire
// (tokens signed with the key last 2 h; a pre-made SharedAccessSignature is
// used as it is, never refreshed). A refused token ends Run with an error
// naming the entity (never the key), which IsFatal takes as fatal; a
// refresh that fails otherwise reconnects.
//
// Subscribers made with it use the AzureServiceBus profile. A connection
// string with EntityPath takes that entity only: New must be given it as
// the queue. An invalid connection string gives an error wrapping
// ErrConnectionString that names the key at fault.
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
// gives: an Entra ID (JWT) source, say, or SASTokenProvider with a lifetime
// of your choice. See ServiceBus.
func ServiceBusWithToken(endpoint string, tp TokenProvider) (Connector, error) {
	if tp == nil {
		return nil, fmt.Errorf("%w: nil TokenProvider", ErrInvalidOption)
	}
	u, err := url.Parse(endpoint)
	if err != nil || u.Host == "" {
		return nil, fmt.Errorf("%w: endpoint %q is not a URL like sb://<namespace>.servicebus.windows.net", ErrInvalidOption, endpoint)
	}
	switch u.Scheme {
	case "sb", "amqps":
		return newSBConnector(u.Hostname(), false, "", tp), nil
	case "amqp":
		if !isLoopback(u.Hostname()) {
			return nil, fmt.Errorf("%w: plain amqp:// is for the emulator on localhost only, not %q", ErrInvalidOption, u.Hostname())
		}
		return newSBConnector(u.Host, true, "", tp), nil
	}
	return nil, fmt.Errorf("%w: endpoint %q: the scheme must be sb, amqps, or amqp (emulator)", ErrInvalidOption, endpoint)
}

type sbConnector struct {
	host     string // FQDN; host:port in emulator mode
	emulator bool
	entity   string // EntityPath; "" when any
	tp       TokenProvider
}

func newSBConnector(host string, emulator bool, entity string, tp TokenProvider) *sbConnector {
	return &sbConnector{host: host, emulator: emulator, entity: entity, tp: tp}
}

func (c *sbConnector) String() string {
	if c.emulator {
		return "amqp://" + c.host + " (Service Bus emulator)"
	}
	return "sb://" + c.host
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
	host, port := c.host, "5671"
	if c.emulator {
		port = "5672"
		if h, p, err := net.SplitHostPort(c.host); err == nil {
			host, port = h, p
		}
	}
	opts := &amqp.ConnOptions{
		SASLType:    amqp.SASLTypeAnonymous(),
		IdleTimeout: req.idle,
		MaxSessions: 65535,
		Properties:  map[string]any{"product": "amqpsub"},
	}
	if !c.emulator {
		opts.HostName = host
	}
	conn, err := dialAMQP(ctx, host, port, !c.emulator, opts)
	if err != nil {
		return nil, err
	}
	// The claims: one for the entity, one for its $management node. A
	// session or subscription path is claimed as a whole.
	entity := strings.TrimSuffix(req.entity, "/$DeadLetterQueue")
	r, err := newRefresher(ctx, conn, c.tp, []string{c.audience(entity), c.audience(entity + "/$management")})
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

// refresher puts the connection's tokens on $cbs, and again before each
// expires. Its goroutine is ended by stop.
type refresher struct {
	cbs      *rpc
	sess     *amqp.Session
	tp       TokenProvider
	conn     *connection
	stopOnce sync.Once
	quit     chan struct{}
	done     chan struct{}
}

// newRefresher puts a token for each audience, within ctx, and starts the
// goroutine that refreshes them.
func newRefresher(ctx context.Context, conn *connection, tp TokenProvider, audiences []string) (*refresher, error) {
	sess, err := conn.conn.NewSession(ctx, nil)
	if err != nil {
		return nil, fmt.Errorf("amqpsub: session for $cbs: %w", err)
	}
	cbs, err := newRPC(ctx, sess, "$cbs")
	if err != nil {
		return nil, err
	}
	r := &refresher{cbs: cbs, sess: sess, tp: tp, conn: conn, quit: make(chan struct{}), done: make(chan struct{})}
	due := make([]time.Time, len(audiences))
	for i, a := range audiences {
		if due[i], err = r.put(ctx, a); err != nil {
			r.closeSession()
			return nil, err
		}
	}
	go r.run(audiences, due)
	return r, nil
}

// put gets a token for audience and puts it on $cbs; it returns when to
// put the next one (the zero time: never).
func (r *refresher) put(ctx context.Context, audience string) (time.Time, error) {
	issued := time.Now()
	tok, err := r.tp.Token(ctx, audience)
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
	cctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	resp, err := r.cbs.call(cctx, req)
	if err != nil {
		return time.Time{}, fmt.Errorf("amqpsub: put-token for %s: %w", audience, err)
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
	if tok.Expiry.IsZero() {
		return time.Time{}, nil
	}
	return refreshAt(issued, tok.Expiry), nil
}

// refreshAt is when a token issued at issued and expiring at expiry is
// replaced: 10 minutes before it expires (as the Azure SDKs do), or, for a
// token shorter-lived than 20 minutes, halfway.
func refreshAt(issued, expiry time.Time) time.Time {
	return expiry.Add(-min(10*time.Minute, expiry.Sub(issued)/2))
}

func (r *refresher) run(audiences []string, due []time.Time) {
	defer close(r.done)
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	for {
		next := -1
		for i, d := range due {
			if !d.IsZero() && (next < 0 || d.Before(due[next])) {
				next = i
			}
		}
		if next < 0 {
			<-r.quit
			return
		}
		timer.Reset(time.Until(due[next]))
		select {
		case <-r.quit:
			return
		case <-timer.C:
		}
		ctx, cancel := context.WithCancel(context.Background())
		go func() {
			select {
			case <-r.quit:
				cancel()
			case <-ctx.Done():
			}
		}()
		d, err := r.put(ctx, audiences[next])
		cancel()
		if err != nil {
			select {
			case <-r.quit:
				return
			default:
			}
			// The links would be detached when the token expires: start
			// afresh on a new connection now, which claims anew (and fails
			// for good if the token is refused).
			r.conn.abort()
			return
		}
		due[next] = d
	}
}

// stop ends the refresher and waits for it.
func (r *refresher) stop() {
	r.stopOnce.Do(func() { close(r.quit) })
	<-r.done
	r.closeSession()
}

func (r *refresher) closeSession() {
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	_ = r.sess.Close(ctx)
}

// management is an entity's $management node on a link's session.
type management struct {
	*rpc
	linkName string // the receive link, named in each request
}

// ErrLockLostStatus is the status code $management answers for a lock
// that is lost (or unknown).
const lockLostStatus = 410

// RenewLocks renews message locks (lease.Renewer).
func (m *management) RenewLocks(ctx context.Context, tokens []amqp.UUID) ([]time.Time, error) {
	resp, err := m.request(ctx, "com.microsoft:renew-lock", map[string]any{"lock-tokens": tokens})
	if err != nil {
		return nil, err
	}
	body, _ := resp.Value.(map[string]any)
	exp, ok := body["expirations"].([]time.Time)
	if !ok || len(exp) != len(tokens) {
		return nil, fmt.Errorf("amqpsub: renew-lock: %d expirations for %d locks", len(exp), len(tokens))
	}
	return exp, nil
}

// request sends operation with body and returns the answer, an error
// wrapping lease.ErrLockLost for status 410, or another error.
func (m *management) request(ctx context.Context, operation string, body map[string]any) (*amqp.Message, error) {
	props := map[string]any{"operation": operation, "associated-link-name": m.linkName}
	if dl, ok := ctx.Deadline(); ok {
		props["com.microsoft:server-timeout"] = uint32(max(0, time.Until(dl)/time.Millisecond))
	}
	resp, err := m.call(ctx, &amqp.Message{Value: body, ApplicationProperties: props})
	if err != nil {
		return nil, err
	}
	code, desc := status(resp)
	switch {
	case code >= 200 && code < 300:
		return resp, nil
	case code == lockLostStatus:
		return nil, fmt.Errorf("amqpsub: %s: status %d: %s: %w", operation, code, desc, lease.ErrLockLost)
	}
	return nil, fmt.Errorf("amqpsub: %s: status %d: %s", operation, code, desc)
}
