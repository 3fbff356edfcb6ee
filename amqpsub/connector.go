package amqpsub

import (
	"context"
	"errors"
	"net/url"
	"strconv"
	"strings"
	"time"

	"github.com/Azure/go-amqp"
)

// A Connector gives a Subscriber its AMQP connection. Make one with Dial or
// Conn.
type Connector interface {
	// connect returns a connection; owned says whether the subscriber closes
	// it when it is done, and also whether it can dial a new one after a
	// loss.
	connect(ctx context.Context, idle time.Duration) (conn *amqp.Conn, owned bool, err error)
	// redials says whether connect can make a new connection after one was
	// lost.
	redials() bool
	// String names the broker for errors and logs, without credentials.
	String() string
}

type dialer struct {
	url  string
	opts *amqp.ConnOptions
}

// Dial returns a Connector that dials url (amqp://host:port or
// amqps://host:port, with user:password@ for SASL PLAIN) with go-amqp's
// options (nil for the defaults). The subscriber owns the connections it
// dials and closes them when it stops. Errors and logs name the address
// without its credentials.
func Dial(url string, opts *amqp.ConnOptions) Connector { return &dialer{url: url, opts: opts} }

func (d *dialer) connect(ctx context.Context, idle time.Duration) (*amqp.Conn, bool, error) {
	var opts amqp.ConnOptions
	if d.opts != nil {
		opts = *d.opts
	}
	if opts.IdleTimeout == 0 {
		opts.IdleTimeout = idle
	}
	c, err := amqp.Dial(ctx, d.url, &opts)
	if err != nil {
		return nil, false, scrub(err, d.url)
	}
	return c, true, nil
}

func (d *dialer) String() string { return redact(d.url) }

func (d *dialer) redials() bool { return true }

type given struct{ c *amqp.Conn }

// Conn returns a Connector for a connection the caller opened and keeps
// owning: the subscriber opens its own session on it and closes only that
// session. After a lost link it opens a new session on the same connection;
// when the connection itself is lost, Run returns an error wrapping
// ErrLinkLost, since it cannot dial another.
func Conn(c *amqp.Conn) Connector { return given{c} }

func (g given) connect(context.Context, time.Duration) (*amqp.Conn, bool, error) {
	if g.c == nil {
		return nil, false, errors.New("amqpsub: Conn(nil)")
	}
	return g.c, false, nil
}

func (given) String() string { return "the given connection" }

func (given) redials() bool { return false }

// redact returns the URL without its password.
func redact(raw string) string {
	u, err := url.Parse(raw)
	if err != nil {
		return "(unparsable address)"
	}
	if u.User != nil {
		u.User = url.User(u.User.Username())
	}
	return u.String()
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
