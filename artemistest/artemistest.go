package artemistest

import (
	"bytes"
	"context"
	_ "embed" // broker.xml
	"encoding/xml"
	"fmt"
	"net"
	"net/url"
	"strconv"
	"sync"
	"testing"
	"time"
)

//go:embed broker.xml
var defaultBrokerXML []byte

// DefaultBrokerXML returns a copy of the broker.xml that [Run] uses unless
// [WithBrokerXML] gives another: amqpsub's test settings (see the comment
// at its top), with acceptors on ${amqpsub.host}, ${amqpsub.port} and
// ${amqpsub.coreport}. Edit it and pass it to WithBrokerXML to change a
// setting.
func DefaultBrokerXML() []byte { return bytes.Clone(defaultBrokerXML) }

// A Broker is a running Artemis started by [Run] or [Start]. Its methods are
// safe for concurrent use.
type Broker struct {
	mode        Mode
	user        string
	password    string
	host        string
	port        int
	corePort    int
	stopTimeout time.Duration
	be          backend

	mu       sync.Mutex
	stopping bool          // under mu: a Stop has begun
	stopped  chan struct{} // closed when the first Stop has finished
	stopErr  error         // set before stopped is closed
}

// backend is what a local process and a container each do.
type backend interface {
	// stop ends the broker: gracefully until ctx ends, then by force.
	// It returns once the broker is gone and its files are removed.
	stop(ctx context.Context) error
	// logTail returns the last n lines of the broker's console output.
	logTail(n int) string
	pid() int
	dir() string
}

// Run starts an Artemis broker and returns once its AMQP port accepts.
// ctx bounds everything Run does: the Docker probe, a download, `artemis
// create`, an image pull and the start-up (which [WithStartTimeout] bounds
// too); if it ends, Run stops what it started and returns an error
// wrapping ctx.Err(). ctx does not bound the broker's life: Run's caller
// owns the broker and must call Stop, also when its tests fail (a local
// process is also killed if the Go process dies, on Linux).
//
// Run is for TestMain and other code without a [testing.TB]; in a test,
// [Start] does the same and stops the broker at the test's end.
func Run(ctx context.Context, opts ...Option) (*Broker, error) {
	c, err := newConfig(opts)
	if err != nil {
		return nil, err
	}
	if err := ctx.Err(); err != nil {
		return nil, fmt.Errorf("artemistest: %w", err)
	}
	mode := c.mode
	endpoint := ""
	if mode == Auto || mode == Container {
		ep, perr := probeDocker(ctx, dockerCandidates(), dockerProbeTimeout)
		switch {
		case perr == nil:
			mode, endpoint = Container, ep
		case mode == Container:
			return nil, fmt.Errorf("%w: %w", ErrNoDocker, perr)
		default:
			c.logf("artemistest: no Docker engine (%v); running Artemis %s as a local process", perr, c.version)
			mode = Local
		}
	}
	var b *Broker
	if mode == Container {
		b, err = runContainer(ctx, &c, endpoint)
	} else {
		b, err = runLocal(ctx, &c)
	}
	if err != nil {
		return nil, err
	}
	b.mode, b.user, b.password, b.stopTimeout = mode, c.user, c.password, c.stopTimeout
	b.stopped = make(chan struct{})
	return b, nil
}

// Start starts a broker for the test t, as [Run] does, and registers a
// cleanup that stops it (SIGTERM, SIGKILL after [WithStopTimeout]) and
// removes its files; if the test failed, the cleanup first logs the tail
// of the broker's output.
//
// If the broker cannot start, Start fails the test with t.Fatal and a
// message that says why (with the broker's output when it ran). Start
// reports through t.Logf unless [WithLogf] says otherwise. The start-up is
// bounded by t.Context() (and so by go test -timeout) and by
// [WithStartTimeout].
func Start(t testing.TB, opts ...Option) *Broker {
	t.Helper()
	opts = append([]Option{WithLogf(t.Logf)}, opts...)
	b, err := Run(t.Context(), opts...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("artemistest: the test failed; the broker's last output lines:\n%s", b.be.logTail(40))
		}
		ctx, cancel := context.WithTimeout(context.Background(), b.stopTimeout)
		defer cancel()
		if err := b.Stop(ctx); err != nil {
			t.Error(err)
		}
	})
	return b
}

// URL returns the broker's AMQP URL with the credentials, e.g.
// amqp://amqpsub:amqpsub@127.0.0.1:41234. go-amqp's Dial (and so
// amqpsub.Dial) logs in with SASL PLAIN from it.
func (b *Broker) URL() string {
	u := url.URL{Scheme: "amqp", User: url.UserPassword(b.user, b.password), Host: b.Addr()}
	return u.String()
}

// Addr returns host:port of the AMQP acceptor: 127.0.0.1 and a free port
// for a local process, the Docker host and the mapped port for a
// container.
func (b *Broker) Addr() string { return net.JoinHostPort(b.host, strconv.Itoa(b.port)) }

// CoreAddr returns host:port of the acceptor for CORE (and AMQP), for
// Artemis' own tools, e.g. `artemis queue stat --url tcp://ADDR --user U
// --password P`.
func (b *Broker) CoreAddr() string { return net.JoinHostPort(b.host, strconv.Itoa(b.corePort)) }

// User returns the user name in URL (see [WithCredentials]).
func (b *Broker) User() string { return b.user }

// Password returns the password in URL (see [WithCredentials]).
func (b *Broker) Password() string { return b.password }

// Mode returns how the broker runs: Local or [Container], never [Auto].
func (b *Broker) Mode() Mode { return b.mode }

// PID returns the process ID of a local broker's JVM, and 0 for a
// container. Fault tests may kill it; Stop then only cleans up.
func (b *Broker) PID() int { return b.be.pid() }

// Dir returns a local broker's instance directory (etc/, data/,
// log/console.log), which Stop removes; "" for a container.
func (b *Broker) Dir() string { return b.be.dir() }

// Stop stops the broker and removes its files. A local process gets
// SIGTERM, and SIGKILL if it has not exited when ctx ends; a container is
// stopped, with ctx as the bound of the stop, and removed. Stop returns
// once the process is gone (a SIGKILL takes effect at once), so it
// returns a little after ctx ends at worst.
//
// Stop is idempotent and safe for concurrent use: the first call does the
// work, and later ones wait for it (or for their own ctx) and return its
// result. A nil result means the broker is gone and its files removed,
// whether it stopped by itself or was killed.
func (b *Broker) Stop(ctx context.Context) error {
	b.mu.Lock()
	first := !b.stopping
	b.stopping = true
	b.mu.Unlock()
	if first {
		b.stopErr = b.be.stop(ctx)
		close(b.stopped)
	}
	select {
	case <-b.stopped:
		return b.stopErr
	case <-ctx.Done():
		return fmt.Errorf("artemistest: waiting for another Stop: %w", ctx.Err())
	}
}

// renderBrokerXML returns the configured broker.xml with the addresses of
// WithQueues, WithAddress and WithDeadLetterQueues declared before </core>.
func renderBrokerXML(c *config) []byte {
	doc := c.brokerXML
	if doc == nil {
		doc = defaultBrokerXML
	}
	if len(c.addresses) == 0 {
		return bytes.Clone(doc)
	}
	var a bytes.Buffer
	a.WriteString("   <addresses>\n")
	for _, ad := range c.addresses {
		fmt.Fprintf(&a, "         <address name=\"%s\">", escape(ad.name))
		for _, r := range ad.order {
			fmt.Fprintf(&a, "<%s>", r)
			for _, q := range ad.queues[r] {
				if q.Filter == "" {
					fmt.Fprintf(&a, "<queue name=\"%s\"/>", escape(q.Name))
					continue
				}
				fmt.Fprintf(&a, "<queue name=\"%s\"><filter string=\"%s\"/></queue>", escape(q.Name), escape(q.Filter))
			}
			fmt.Fprintf(&a, "</%s>", r)
		}
		a.WriteString("</address>\n")
	}
	a.WriteString("      </addresses>\n\n   ")
	i := bytes.LastIndex(doc, []byte("</core>"))
	out := make([]byte, 0, len(doc)+a.Len())
	out = append(out, doc[:i]...)
	out = append(out, a.Bytes()...)
	return append(out, doc[i:]...)
}

// escape is s as XML character data or an attribute value.
func escape(s string) string {
	var b bytes.Buffer
	_ = xml.EscapeText(&b, []byte(s)) // writes to a bytes.Buffer cannot fail
	return b.String()
}
