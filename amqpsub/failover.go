package amqpsub

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"strings"
	"time"

	"github.com/Azure/go-amqp"
	"go.uber.org/zap"
)

// DialFailover returns a Connector for a broker reachable at several
// addresses (a live broker and its backups, or the brokers of a cluster
// that all hold the queue), each a URL as Dial takes it, all dialed with
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
// was tried. DialTimeout bounds each address on its own:
// the dial, and then the session and link on the connection it gave; a
// pass through n addresses that do not answer lasts up to n × DialTimeout.
// Within a pass the next address is tried at once; between passes the
// reconnect loop waits its backoff (Backoff), as with Dial.
//
// When no address answers, the error names each address tried, in order,
// with why it failed, and wraps every cause, so errors.Is and errors.As see
// them all. An error the subscriber's FatalErrors calls fatal (the broker
// refusing the credentials, under IsFatal) ends the pass at once, the
// remaining addresses untried: the credentials or the configuration are
// wrong, and another address of the same broker would say the same. So it
// ends Run as it would with Dial, on the first connect as on a reconnect.
//
// The list is checked here: an empty list, an empty URL, one that does not
// parse, one without a host, or a scheme other than amqp, amqps or
// amqp+ssl gives an error wrapping ErrInvalidOption that names each bad
// entry by its index (urls[i]) and never its password. Errors and logs name
// the addresses without their credentials; the log line of each attach and
// EventReconnected (Event.Broker) name the address in use. The subscriber
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
