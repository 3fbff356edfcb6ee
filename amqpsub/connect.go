package amqpsub

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"net/url"
	"strconv"
	"strings"
	"time"

	"github.com/Azure/go-amqp"
	"go.uber.org/zap"

	"github.com/amqpsub/amqpsub/internal/wire"
)

// A Connector gives a [Subscriber] its AMQP connection. Make one with [Dial],
// [DialFailover], [Conn] or [ServiceBus].
type Connector interface {
	// connect returns a connection for a link to req.entity.
	connect(ctx context.Context, req connectRequest) (*connection, error)
	// String names the broker for errors and logs, without credentials.
	String() string
}

// connectRequest is what a connector is told of the link to come.
type connectRequest struct {
	idle   time.Duration // IdleTimeout, for connections whose options leave it 0
	entity string        // the address the link attaches to
	log    *zap.Logger   // for what runs beside the connection (never nil)
	// from is where a connector with several addresses (DialFailover)
	// starts its pass, an index into its list taken modulo its length.
	from int
	// noWrap ends the pass at the end of the list instead of wrapping
	// round: on the first attach, the addresses before from were tried.
	noWrap bool
	// timeout is DialTimeout. A connector with several addresses gives
	// each this long; the others are given a ctx bound by it.
	timeout time.Duration
	// fatal is FatalErrors' test: an address failing with an error it
	// calls fatal ends a DialFailover pass.
	fatal func(error) bool
}

// connection is what a connector gives.
type connection struct {
	conn *amqp.Conn
	// owned says whether the subscriber closes it when it is done, and can
	// dial another after a loss.
	owned bool
	// abort, when not nil, closes the socket at once, for a close that must
	// end within a bound.
	abort func()
	// stop, when not nil, ends what runs beside the connection (a token
	// refresher) and waits for it.
	stop func()
	// reclaim, when not nil, puts fresh credentials on the live connection
	// (Service Bus's CBS tokens), within ctx: for a link the broker
	// detached for an expired or revoked token, before it is attached
	// again there.
	reclaim func(ctx context.Context) error
	// addr names the address connected to, without credentials; index is
	// its place in a DialFailover list (0 for other connectors).
	addr  string
	index int
}

type dialer struct {
	url  string
	opts *amqp.ConnOptions
	wire wire.Options // the zero value, but for the benchmark's comparisons (testhook.DialWire)
}

// Dial returns a [Connector] that dials url (amqp://host:port or
// amqps://host:port, with user:password@ for SASL PLAIN; the port defaults
// to 5672 and 5671) with go-amqp's options (nil for the defaults; for
// amqps, TLSConfig's ServerName defaults to the host). A URL without
// credentials offers SASL ANONYMOUS, unless opts sets a SASLType ([NoSASL]
// for a broker without SASL).
//
// The subscriber owns the connections it dials and closes them when it
// stops; after a lost connection it dials a new one. Errors and logs name
// the address without its credentials. For a broker with several addresses
// (a backup, a cluster), see [DialFailover].
func Dial(url string, opts *amqp.ConnOptions) Connector { return &dialer{url: url, opts: opts} }

func (d *dialer) connect(ctx context.Context, req connectRequest) (*connection, error) {
	c, err := d.dial(ctx, req.idle)
	if err != nil {
		return nil, scrub(err, d.url)
	}
	return c, nil
}

func (d *dialer) dial(ctx context.Context, idle time.Duration) (*connection, error) {
	u, err := url.Parse(d.url)
	if err != nil {
		// url.Parse's error quotes the address, password included, and
		// partly decoded, where scrub cannot find it.
		return nil, errors.New("amqpsub: the address is not a URL (amqp://[user:password@]host[:port])")
	}
	if u.Host == "" || u.Opaque != "" {
		return nil, errors.New("amqpsub: the address has no host (amqp://[user:password@]host[:port])")
	}
	if misparsed(u) {
		return nil, errors.New("amqpsub: the address has an '@' after its host: a password with '/', '?' or '#' must be percent-encoded")
	}
	var opts amqp.ConnOptions
	if d.opts != nil {
		opts = *d.opts
	}
	if opts.IdleTimeout == 0 {
		opts.IdleTimeout = idle
	}
	host, port := u.Hostname(), u.Port()
	secure := false
	switch u.Scheme {
	case "amqp", "":
		if port == "" {
			port = "5672"
		}
	case "amqps", "amqp+ssl":
		secure = true
		if port == "" {
			port = "5671"
		}
	default:
		return nil, fmt.Errorf("unsupported scheme %q", u.Scheme)
	}
	anonymous, credentials := false, u.User != nil
	switch {
	case u.User != nil:
		pw, _ := u.User.Password()
		opts.SASLType = amqp.SASLTypePlain(u.User.Username(), pw)
	case opts.SASLType == nil:
		// As Qpid's clients do: RabbitMQ 4 takes no client without SASL,
		// and Artemis and RabbitMQ 3 take ANONYMOUS where they take a
		// client without credentials at all.
		opts.SASLType, anonymous = amqp.SASLTypeAnonymous(), true
	}
	c, err := dialAMQP(ctx, host, port, secure, &opts, d.wire)
	if err != nil {
		return nil, handshakeHint(err, anonymous, credentials)
	}
	return c, nil
}

// NoSASL returns a go-amqp SASLType that offers no mechanism: as the
// SASLType of [Dial]'s options, the connection opens without SASL, for a
// broker that has no SASL layer. Dial otherwise offers SASL ANONYMOUS for a
// URL without credentials.
func NoSASL() amqp.SASLType { return func(*amqp.Conn) error { return nil } }

// handshakeHint adds what to do to go-amqp's errors for a protocol header
// or SASL mechanism the broker does not take; anonymous says that Dial
// offered SASL ANONYMOUS for want of credentials, credentials that the URL
// has some (they choose SASL PLAIN, whatever opts says).
func handshakeHint(err error, anonymous, credentials bool) error {
	msg := err.Error()
	switch {
	case strings.Contains(msg, "unexpected protocol header 0x3, expected 0x0"):
		return fmt.Errorf("%w (the broker requires SASL: give user:password@ in the URL, or a SASLType in the go-amqp options)", err)
	case credentials && strings.Contains(msg, "unexpected protocol header 0x0, expected 0x3"):
		return fmt.Errorf("%w (the broker does not do SASL: take the credentials out of the URL, and give Dial the go-amqp options &amqp.ConnOptions{SASLType: amqpsub.NoSASL()})", err)
	case strings.Contains(msg, "unexpected protocol header 0x0, expected 0x3"):
		return fmt.Errorf("%w (the broker does not do SASL: give Dial the go-amqp options &amqp.ConnOptions{SASLType: amqpsub.NoSASL()})", err)
	case anonymous && strings.Contains(msg, "no supported auth mechanism"):
		return fmt.Errorf("%w (the URL has no credentials, so SASL ANONYMOUS was offered, which the broker does not take: give user:password@ in the URL)", err)
	}
	return err
}

// dialAMQP opens the socket itself, rather than through amqp.Dial, so that
// the subscriber can close it within CloseTimeout even when go-amqp's own
// close waits on a write to a peer that no longer reads, and so that frames
// go out through a wire.Conn: what go-amqp writes while a write is in
// progress goes out together in the next one, one syscall for several
// frames; and a refused SASL outcome is read off the wire. opts is changed.
func dialAMQP(ctx context.Context, host, port string, secure bool, opts *amqp.ConnOptions, wo wire.Options) (*connection, error) {
	if opts.HostName == "" {
		opts.HostName = host
	}
	var nd net.Dialer
	raw, err := nd.DialContext(ctx, "tcp", net.JoinHostPort(host, port))
	if err != nil {
		return nil, err
	}
	nc := raw
	if secure {
		cfg := &tls.Config{}
		if opts.TLSConfig != nil {
			cfg = opts.TLSConfig.Clone()
		}
		if cfg.ServerName == "" && !cfg.InsecureSkipVerify {
			cfg.ServerName = host
		}
		tc := tls.Client(raw, cfg)
		if err := tc.HandshakeContext(ctx); err != nil {
			_ = raw.Close()
			return nil, err
		}
		nc = tc
	}
	opts.TLSConfig = nil // the socket is already secured, or plain as asked
	wc := wire.New(nc, raw, wo)
	abort := func() { _ = wc.Abort() }
	c, err := amqp.NewConn(ctx, wc, opts)
	if err != nil {
		abort()
		return nil, wire.HandshakeError(wc, err)
	}
	return &connection{conn: c, owned: true, abort: abort}, nil
}

func (d *dialer) String() string { return redact(d.url) }

type given struct{ c *amqp.Conn }

// Conn returns a [Connector] for a connection the caller opened and keeps
// owning: the subscriber opens its own session on it and closes only that
// session. After a lost link it opens a new session on the same connection;
// when the connection itself is lost, Run returns an error wrapping
// [ErrLinkLost], since it cannot dial another.
func Conn(c *amqp.Conn) Connector { return given{c} }

func (g given) connect(context.Context, connectRequest) (*connection, error) {
	if g.c == nil {
		return nil, errors.New("amqpsub: Conn(nil)")
	}
	return &connection{conn: g.c}, nil
}

func (given) String() string { return "the given connection" }

// redact returns the URL without its password.
func redact(raw string) string {
	u, err := url.Parse(raw)
	if err != nil || u.Opaque != "" || u.Host == "" || misparsed(u) {
		// Not an address Dial can use, and where the credentials are is
		// anybody's guess (user:pass@ taken for a scheme, host:port or a
		// path): hide everything before the last '@'.
		return mask(raw)
	}
	if u.User != nil {
		u.User = url.User(u.User.Username())
	}
	return u.String()
}

// mask hides the credentials of raw, taken to be what lies before its last
// '@': with a "scheme://" before them, all but the user name; without, all
// of it. raw without an '@' is returned as it is.
func mask(raw string) string {
	at := strings.LastIndex(raw, "@")
	if at < 0 {
		return raw
	}
	creds, host := raw[:at], raw[at+1:]
	if i := strings.Index(creds, "://"); i >= 0 {
		scheme, userinfo := creds[:i+3], creds[i+3:]
		if user, _, ok := strings.Cut(userinfo, ":"); ok {
			return scheme + user + ":xxxxx@" + host
		}
		return scheme + "xxxxx@" + host
	}
	return "xxxxx@" + host
}

// misparsed reports a URL whose credentials were taken for its host: an
// unescaped '/', '?' or '#' in a password ends the authority early, so the
// '@' lands in the path, query or fragment.
func misparsed(u *url.URL) bool {
	// Escaped forms: an '@' written %40 in a path is a path's, not a lost
	// credential's.
	return strings.Contains(u.EscapedPath(), "@") || strings.Contains(u.RawQuery, "@") || strings.Contains(u.EscapedFragment(), "@")
}

// scrub replaces err by one whose text does not hold the URL's password, if
// it did; errors.Is and errors.As still see the original.
func scrub(err error, raw string) error {
	pw := password(raw)
	if pw == "" {
		return err
	}
	return &scrubbed{err: err, secret: pw}
}

// password returns the password in raw. An address that does not parse is
// quoted whole in go-amqp's error, so for one the password is taken as
// written: after the first ':' of what lies between "//" and the last '@'.
func password(raw string) string {
	if u, err := url.Parse(raw); err == nil {
		if u.User == nil {
			return ""
		}
		pw, _ := u.User.Password()
		return pw
	}
	_, rest, ok := strings.Cut(raw, "//")
	at := strings.LastIndex(rest, "@")
	if !ok || at < 0 {
		return ""
	}
	_, pw, _ := strings.Cut(rest[:at], ":")
	return pw
}

type scrubbed struct {
	err    error
	secret string
}

func (s *scrubbed) Error() string {
	msg := strings.ReplaceAll(s.err.Error(), s.secret, "xxxxx")
	// A url.Error quotes the address with %q.
	if q := strconv.Quote(s.secret); q[1:len(q)-1] != s.secret {
		msg = strings.ReplaceAll(msg, q[1:len(q)-1], "xxxxx")
	}
	return msg
}

func (s *scrubbed) Unwrap() error { return s.err }

// DialFailover returns a [Connector] for a broker reachable at several
// addresses (a live broker and its backups, or the brokers of a cluster
// that all hold the queue), each a URL as [Dial] takes it, all dialed with
// the same go-amqp options (nil for the defaults; for amqps, TLSConfig's
// ServerName defaults to each address's host). Credentials go in each URL.
//
// Each connect is one pass through the list, which wraps around: the first
// connect starts at the first address; after a lost link, the connect
// starts at the address after the one the link was on, so an address that
// has just failed is tried last (and likewise after an attempt that
// connected but could not open the session or attach the link). The first
// address that answers is used; on the first connect, one that answered
// but could not serve the queue is passed over too, until every address
// was tried. [DialTimeout] bounds each address on its own:
// the dial, and then the session and link on the connection it gave; a
// pass through n addresses that do not answer lasts up to n × DialTimeout.
// Within a pass the next address is tried at once; between passes the
// reconnect loop waits its backoff ([Backoff]), as with Dial.
//
// When no address answers, the error names each address tried, in order,
// with why it failed, and wraps every cause, so [errors.Is] and [errors.As] see
// them all. An error the subscriber's [FatalErrors] calls fatal (the broker
// refusing the credentials, under [IsFatal]) ends the pass at once, the
// remaining addresses untried: the credentials or the configuration are
// wrong, and another address of the same broker would say the same. So it
// ends Run as it would with Dial, on the first connect as on a reconnect.
//
// The list is checked here: an empty list, an empty URL, one that does not
// parse, one without a host, or a scheme other than amqp, amqps or
// amqp+ssl gives an error wrapping [ErrInvalidOption] that names each bad
// entry by its index (urls[i]) and never its password. Errors and logs name
// the addresses without their credentials; the log line of each attach and
// [EventReconnected] ([Event.Broker]) name the address in use. The subscriber
// owns the connections it dials, as with Dial.
func DialFailover(urls []string, opts *amqp.ConnOptions) (Connector, error) {
	if len(urls) == 0 {
		return nil, fmt.Errorf("%w: DialFailover: no address", ErrInvalidOption)
	}
	f := &failover{addrs: make([]*dialer, len(urls))}
	var errs []error
	for i, raw := range urls {
		if why := checkURL(raw); why != "" {
			errs = append(errs, fmt.Errorf("%w: DialFailover: urls[%d] (%s): %s", ErrInvalidOption, i, quoteRedacted(raw), why))
			continue
		}
		f.addrs[i] = &dialer{url: raw, opts: opts}
	}
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	return f, nil
}

// checkURL says what is wrong with raw as an address, or "".
func checkURL(raw string) string {
	if raw == "" {
		return "empty"
	}
	u, err := url.Parse(raw)
	if err != nil {
		// url.Error's text quotes raw, password and all, and its cause
		// may quote part of the password (an invalid escape in it).
		return "not a URL (characters such as % : / @ in a user name or password must be percent-encoded)"
	}
	if misparsed(u) {
		return "an '@' after the host: a password with '/', '?' or '#' must be percent-encoded"
	}
	if u.Opaque != "" || u.Host == "" {
		return "no host: want amqp://host:port or amqps://host:port"
	}
	switch u.Scheme {
	case "amqp", "amqps", "amqp+ssl", "":
	default:
		return fmt.Sprintf("unsupported scheme %q: use amqp or amqps", u.Scheme)
	}
	if u.Hostname() == "" {
		return "no host: want amqp://host:port or amqps://host:port"
	}
	return ""
}

// quoteRedacted quotes raw without its password, even when it does not
// parse.
func quoteRedacted(raw string) string { return fmt.Sprintf("%q", redact(raw)) }

// failover is DialFailover's Connector. It keeps no state between connects:
// where a pass starts comes with each request (the attacher's), so one
// failover may serve several subscribers, and a session consumer's pipes,
// each on its own way round the list.
type failover struct {
	addrs []*dialer // in the order given
	// dial, when not nil, connects to addrs[i] in place of dialing it: for
	// tests of the pass.
	dial func(ctx context.Context, i int, req connectRequest) (*connection, error)
}

func (f *failover) connect(ctx context.Context, req connectRequest) (*connection, error) {
	c, _, err := f.pass(ctx, req)
	return c, err
}

// pass tries the addresses once around, from req.from (taken modulo their
// number), each within req.timeout of its own (no bound but ctx's when 0),
// until one answers, ctx ends, or one fails with an error req.fatal calls
// fatal. by is when the timeout of the address that answered ends: the
// session and link are to be opened by then.
func (f *failover) pass(ctx context.Context, req connectRequest) (c *connection, by time.Time, err error) {
	n := len(f.addrs)
	tried := make([]addrError, 0, n)
	start := (req.from%n + n) % n
	limit := n // addresses in this pass
	if req.noWrap {
		limit = n - start
	}
	for k := range limit {
		i := (start + k) % n
		actx, cancel := ctx, context.CancelFunc(func() {})
		if req.timeout > 0 {
			by = time.Now().Add(req.timeout)
			actx, cancel = context.WithDeadline(ctx, by)
		}
		if f.dial != nil {
			c, err = f.dial(actx, i, req)
		} else {
			c, err = f.addrs[i].connect(actx, req)
		}
		if err != nil {
			err = timeoutError(actx, err)
		}
		cancel()
		if err == nil {
			c.index, c.addr = i, f.addrs[i].String()
			if len(tried) > 0 && req.log != nil {
				// A dead address goes unnoticed until it is needed: say so
				// once per connect that had to pass it over.
				req.log.Warn("connected past addresses that did not answer", zap.String("broker", c.addr),
					zap.Error(&failoverError{tried: tried}))
			}
			return c, by, nil
		}
		tried = append(tried, addrError{addr: f.addrs[i].String(), err: err})
		if ctx.Err() != nil || req.fatal != nil && req.fatal(err) {
			break // stopping; or the credentials or configuration are wrong
		}
	}
	return nil, time.Time{}, &failoverError{tried: tried, untried: limit - len(tried)}
}

// String names the addresses, without credentials.
func (f *failover) String() string {
	names := make([]string, len(f.addrs))
	for i, d := range f.addrs {
		names[i] = d.String()
	}
	return "[" + strings.Join(names, ", ") + "]"
}

type addrError struct {
	addr string // redacted
	err  error  // scrubbed of the address's password
}

// failoverError is the error of a pass that reached no address: each one
// tried with its error, in order. Unwrap gives the errors, for errors.Is
// and errors.As.
type failoverError struct {
	tried   []addrError
	untried int // left after a fatal error or the end of ctx
}

func (e *failoverError) Error() string {
	var b strings.Builder
	for i, t := range e.tried {
		if i > 0 {
			b.WriteString("; ")
		}
		b.WriteString(t.addr)
		b.WriteString(": ")
		b.WriteString(t.err.Error())
	}
	if e.untried > 0 {
		fmt.Fprintf(&b, " (%d more not tried)", e.untried)
	}
	return b.String()
}

func (e *failoverError) Unwrap() []error {
	errs := make([]error, len(e.tried))
	for i, t := range e.tried {
		errs[i] = t.err
	}
	return errs
}

// connect opens a connection for an attach, from the address at index from
// on for a DialFailover connector, each address within DialTimeout (see
// failover.pass), or else within DialTimeout; by is when the DialTimeout of
// the address that answered ends.
func (s *Subscriber) connect(ctx context.Context, from int, first bool) (c *connection, by time.Time, err error) {
	req := connectRequest{idle: s.cfg.idleTimeout, entity: s.cfg.profile.drv.Address(s.queue), log: s.log,
		from: from, noWrap: first, timeout: s.cfg.dialTimeout, fatal: s.cfg.isFatal}
	if f, ok := s.connector.(*failover); ok {
		return f.pass(ctx, req)
	}
	by = time.Now().Add(s.cfg.dialTimeout)
	cctx, cancel := context.WithDeadline(ctx, by)
	defer cancel()
	if c, err = s.connector.connect(cctx, req); err != nil {
		return nil, by, timeoutError(cctx, err)
	}
	if c.addr == "" {
		c.addr = s.connector.String()
	}
	return c, by, nil
}

// timeoutError returns err, the error of a connect within ctx, marked as
// ctx's when ctx ended. go-amqp sets the socket's deadline from ctx's, so a
// dial timeout shows as the socket's i/o timeout or as ctx's, whichever
// fires first: it is reported as ctx's either way.
func timeoutError(ctx context.Context, err error) error {
	var nerr net.Error
	if cerr := ctx.Err(); cerr != nil && !errors.Is(err, cerr) {
		return fmt.Errorf("%w: %w", cerr, err)
	} else if _, ok := ctx.Deadline(); ok && cerr == nil && errors.As(err, &nerr) && nerr.Timeout() {
		return fmt.Errorf("%w: %w", context.DeadlineExceeded, err)
	}
	return err
}
