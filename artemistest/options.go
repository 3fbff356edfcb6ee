package artemistest

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"
	"unicode"
)

// Mode chooses how [Run] starts the broker.
type Mode int

const (
	// Auto runs a container when a Docker engine answers a short probe
	// (at most 2 s), and a local process otherwise.
	Auto Mode = iota
	// Local runs the Artemis distribution as a local process. It needs
	// Java 17 or later, and Maven for the one download of the
	// distribution (none if the cache already has it). Unix only.
	Local
	// Container runs the official image apache/activemq-artemis through
	// testcontainers-go. It needs a Docker engine. amqpsub's CI has none,
	// so this path is compiled there but not run.
	Container
)

// String returns "auto", "local" or "container".
func (m Mode) String() string {
	switch m {
	case Auto:
		return "auto"
	case Local:
		return "local"
	case Container:
		return "container"
	default:
		return fmt.Sprintf("Mode(%d)", int(m))
	}
}

// DefaultVersion is the Artemis version [Run] starts unless [WithVersion]
// says otherwise: the one amqpsub is tested against.
const DefaultVersion = "2.40.0"

// ErrInvalidOption is returned (wrapped) by [Run], and reported by [Start],
// when an option has an invalid value or two options do not fit together.
// Nothing has been started then.
var ErrInvalidOption = errors.New("artemistest: invalid option")

// ErrNoDocker is returned (wrapped) by [Run] in mode [Container] when no
// Docker engine answers. Mode [Auto] never returns it: it runs a local
// process instead.
var ErrNoDocker = errors.New("artemistest: no Docker engine reachable")

// An Option configures [Run] and [Start]. Each option checks its value when
// Run applies it and fails with an error wrapping [ErrInvalidOption].
type Option interface {
	apply(c *config) error
}

type optionFunc func(c *config) error

func (f optionFunc) apply(c *config) error { return f(c) }

type config struct {
	mode         Mode
	version      string
	image        string // "" means apache/activemq-artemis:<version>
	user         string
	password     string
	cacheDir     string
	startTimeout time.Duration
	stopTimeout  time.Duration
	heap         string
	addresses    []address // declared in broker.xml, in the order given
	brokerXML    []byte    // nil means DefaultBrokerXML()
	logf         func(format string, args ...any)
}

func defaultConfig() config {
	return config{
		mode:         Auto,
		version:      DefaultVersion,
		user:         "amqpsub",
		password:     "amqpsub",
		cacheDir:     defaultCacheDir(),
		startTimeout: 90 * time.Second,
		stopTimeout:  30 * time.Second,
		heap:         "512M",
		logf:         func(string, ...any) {},
	}
}

// defaultCacheDir is where the repository's broker scripts
// (integration/*.sh) keep the distribution too, so that
// a machine that ran them has nothing to download.
func defaultCacheDir() string {
	if d := os.Getenv("AMQPSUB_CACHE"); d != "" {
		if abs, err := filepath.Abs(d); err == nil {
			return abs
		}
		return d
	}
	if d, err := os.UserCacheDir(); err == nil {
		return filepath.Join(d, "amqpsub")
	}
	return filepath.Join(os.TempDir(), "amqpsub-cache")
}

func invalid(format string, args ...any) error {
	return fmt.Errorf("%w: %s", ErrInvalidOption, fmt.Sprintf(format, args...))
}

// WithMode chooses between a container and a local process.
// Default: Auto.
func WithMode(m Mode) Option {
	return optionFunc(func(c *config) error {
		if m != Auto && m != Local && m != Container {
			return invalid("WithMode(%v): not Auto, Local or Container", m)
		}
		c.mode = m
		return nil
	})
}

var versionRE = regexp.MustCompile(`^[0-9]+\.[0-9]+\.[0-9]+$`)

// WithVersion sets the Artemis version: the Maven artifact
// org.apache.activemq:apache-artemis:VERSION:tar.gz:bin for a local
// process, and the image tag for a container (unless [WithImage] names
// another image). amqpsub is tested with [DefaultVersion] only.
// Default: DefaultVersion ("2.40.0").
func WithVersion(v string) Option {
	return optionFunc(func(c *config) error {
		if !versionRE.MatchString(v) {
			return invalid("WithVersion(%q): want a release number such as 2.40.0", v)
		}
		c.version = v
		return nil
	})
}

// WithImage sets the container image (mode [Container], or [Auto] with a
// Docker engine). The image must behave like the official one: the
// ARTEMIS_USER, ARTEMIS_PASSWORD, ANONYMOUS_LOGIN, EXTRA_ARGS and
// JAVA_ARGS_APPEND variables, and etc-override/.
// Default: "apache/activemq-artemis:" + the version (see [WithVersion]).
func WithImage(ref string) Option {
	return optionFunc(func(c *config) error {
		if ref == "" || strings.ContainsFunc(ref, unicode.IsSpace) {
			return invalid("WithImage(%q): empty or has spaces", ref)
		}
		c.image = ref
		return nil
	})
}

var credentialRE = regexp.MustCompile(`^[A-Za-z0-9._~-]+$`)

// WithCredentials sets the one user the broker knows (role amq, which
// may do everything). Logins without them, or with a wrong password, are
// refused. Both may hold letters, digits and "-._~" only (they go into
// the URL and, in a container, through a shell script unquoted).
// Default: "amqpsub", "amqpsub", as in the repository's
// integration/artemis.sh.
func WithCredentials(user, password string) Option {
	return optionFunc(func(c *config) error {
		if !credentialRE.MatchString(user) || !credentialRE.MatchString(password) {
			return invalid("WithCredentials: user and password must be non-empty and hold only letters, digits and -._~")
		}
		c.user, c.password = user, password
		return nil
	})
}

// WithCacheDir sets the directory that keeps the downloaded distribution
// (apache-artemis-VERSION-bin.tar.gz and its unpacked
// apache-artemis-VERSION/) across runs. Processes that share it download
// once: a lock file in it serializes the download and the unpacking.
// Instances are never created in it.
// Default: $AMQPSUB_CACHE if set, else os.UserCacheDir()/amqpsub
// (~/.cache/amqpsub on Linux), the cache of amqpsub's scripts.
func WithCacheDir(dir string) Option {
	return optionFunc(func(c *config) error {
		if dir == "" {
			return invalid("WithCacheDir: empty")
		}
		abs, err := filepath.Abs(dir)
		if err != nil {
			return invalid("WithCacheDir(%q): %v", dir, err)
		}
		c.cacheDir = abs
		return nil
	})
}

// WithStartTimeout bounds the wait from starting the broker to its AMQP
// port accepting (a local process), or to the container being ready. A
// download, a first image pull and `artemis create` are bounded by [Run]'s
// ctx only.
// Default: 90 s.
func WithStartTimeout(d time.Duration) Option {
	return optionFunc(func(c *config) error {
		if d <= 0 {
			return invalid("WithStartTimeout(%v): not positive", d)
		}
		c.startTimeout = d
		return nil
	})
}

// WithStopTimeout sets how long the cleanup that [Start] registers waits
// for the broker to stop after SIGTERM before it kills it with SIGKILL.
// ([Broker.Stop] takes a ctx instead.)
// Default: 30 s.
func WithStopTimeout(d time.Duration) Option {
	return optionFunc(func(c *config) error {
		if d <= 0 {
			return invalid("WithStopTimeout(%v): not positive", d)
		}
		c.stopTimeout = d
		return nil
	})
}

var heapRE = regexp.MustCompile(`^([1-9][0-9]*)([kKmMgG])$`)

// WithHeap sets the JVM's maximum heap (-Xmx), e.g. "1G"; the initial
// heap (-Xms) is 64M, or the maximum if that is smaller. Small, so that a
// test can start several brokers. At least 32M.
// Default: "512M".
func WithHeap(size string) Option {
	return optionFunc(func(c *config) error {
		if heapBytes(size) < 32<<20 {
			return invalid("WithHeap(%q): want a size of at least 32M, such as 512M or 2G", size)
		}
		c.heap = size
		return nil
	})
}

// heapBytes parses a JVM memory size; 0 if it is not one.
func heapBytes(size string) int64 {
	m := heapRE.FindStringSubmatch(size)
	if m == nil {
		return 0
	}
	n, err := strconv.ParseInt(m[1], 10, 64)
	if err != nil || n > 1<<40 {
		return 0
	}
	shift := map[string]int{"k": 10, "m": 20, "g": 30}[strings.ToLower(m[2])]
	return n << shift
}

// jvmMemoryArgs are the heap options appended to the JVM's (the last
// -Xms and -Xmx win over those of etc/artemis.profile).
func jvmMemoryArgs(heap string) string {
	xms := "64M"
	if heapBytes(heap) < 64<<20 {
		xms = heap
	}
	return "-Xms" + xms + " -Xmx" + heap
}

// WithQueues declares anycast queues, each on an address of the same
// name, in broker.xml, so that they exist (durable, empty) before the
// first client attaches: WithAddress(name, Anycast, Queue{Name: name}) for
// each. The default broker.xml creates queues on first use anyway; this is
// for tests that look at a queue before anyone sends to it. Calls add up.
// It cannot be combined with a [WithBrokerXML] that has its own
// <addresses> element.
// Default: none.
func WithQueues(names ...string) Option {
	return optionFunc(func(c *config) error {
		for _, n := range names {
			if err := checkName("WithQueues", n); err != nil {
				return err
			}
		}
		for _, n := range names {
			c.declare(n, Anycast, Queue{Name: n})
		}
		return nil
	})
}

// Routing is how an address routes what is sent to it: to one of its
// queues (Anycast, a point-to-point queue) or to each (Multicast, a topic
// with its subscriptions).
type Routing string

// The routing types of an address.
const (
	Anycast   Routing = "anycast"
	Multicast Routing = "multicast"
)

// Queue is a durable queue declared on an address with [WithAddress].
type Queue struct {
	// Name is the queue's name; a client reads it as address::name (a
	// fully qualified queue name) or, on an anycast address of the same
	// name, as name.
	Name string
	// Filter, when not "", is the queue's filter: an Artemis filter
	// expression over message properties (a JMS selector), such as
	// "_AMQ_ORIG_ADDRESS = 'orders'". Messages it rejects are not routed to
	// the queue.
	Filter string
}

// WithAddress declares address name with routing, and queues on it, in
// broker.xml, so that they exist before the first client attaches. An
// address declared more than once gets the routings and queues of every
// call, each once. It cannot be combined with a [WithBrokerXML] that has its
// own <addresses> element.
// Default: none.
func WithAddress(name string, routing Routing, queues ...Queue) Option {
	return optionFunc(func(c *config) error {
		if err := checkName("WithAddress", name); err != nil {
			return err
		}
		if routing != Anycast && routing != Multicast {
			return invalid("WithAddress(%q, %q): routing must be Anycast or Multicast", name, routing)
		}
		for _, q := range queues {
			if err := checkName("WithAddress", q.Name); err != nil {
				return err
			}
		}
		c.declare(name, routing, queues...)
		return nil
	})
}

// WithDeadLetterQueues declares, for each of queues, the dead-letter queue
// that the default broker.xml makes only at that queue's first dead letter
// (auto-create-dead-letter-resources): queue DLQ.<queue>, anycast on
// address DLQ, with filter _AMQ_ORIG_ADDRESS = '<queue>'. With it,
// amqpsub's DeadLetterCopy("DLQ::DLQ.{queue}") can attach (without it, Run
// fails with amqp:not-found until the first dead letter) and keeps the
// reason of every rejection, and a reader of DLQ::DLQ.<queue> can attach
// before any message was dead-lettered. For a queue on an address
// of its own name (what WithQueues and the default broker.xml make).
// Default: none.
func WithDeadLetterQueues(queues ...string) Option {
	return optionFunc(func(c *config) error {
		for _, q := range queues {
			if err := checkName("WithDeadLetterQueues", q); err != nil {
				return err
			}
		}
		for _, q := range queues {
			c.declare("DLQ", Anycast, Queue{Name: "DLQ." + q, Filter: "_AMQ_ORIG_ADDRESS = '" + strings.ReplaceAll(q, "'", "''") + "'"})
		}
		return nil
	})
}

// address is one <address> of broker.xml: its queues by routing (a
// routing with no queues is kept as an empty list, so that it is
// declared).
type address struct {
	name   string
	queues map[Routing][]Queue
	order  []Routing
}

// declare adds queues to address name under routing; an address, or a
// queue of it, declared twice is declared once.
func (c *config) declare(name string, routing Routing, queues ...Queue) {
	var a *address
	for i := range c.addresses {
		if c.addresses[i].name == name {
			a = &c.addresses[i]
		}
	}
	if a == nil {
		c.addresses = append(c.addresses, address{name: name, queues: map[Routing][]Queue{}})
		a = &c.addresses[len(c.addresses)-1]
	}
	if _, ok := a.queues[routing]; !ok {
		a.queues[routing] = nil
		a.order = append(a.order, routing)
	}
	for _, q := range queues {
		if !slices.Contains(a.queues[routing], q) {
			a.queues[routing] = append(a.queues[routing], q)
		}
	}
}

func checkName(opt, n string) error {
	if n == "" || strings.ContainsFunc(n, func(r rune) bool { return unicode.IsSpace(r) || unicode.IsControl(r) }) {
		return invalid("%s(%q): empty, or has spaces or control characters", opt, n)
	}
	return nil
}

// WithBrokerXML replaces the broker.xml the broker runs with (see
// [DefaultBrokerXML], which is a good start to edit).
//
// Its acceptors must take their host and port from the system properties
// that [Run] sets: ${amqpsub.host}, ${amqpsub.port} (AMQP; [Broker.URL]) and,
// if it has one, ${amqpsub.coreport} (CORE; [Broker.CoreAddr]). Security
// must stay on with role amq for the user of [WithCredentials], which is
// what `artemis create --require-login` writes into the users and roles
// files.
//
// Default: DefaultBrokerXML().
func WithBrokerXML(xml []byte) Option {
	return optionFunc(func(c *config) error {
		if !bytes.Contains(xml, []byte("${amqpsub.port")) {
			return invalid("WithBrokerXML: no acceptor uses ${amqpsub.port}, so the broker would not listen where Run looks")
		}
		if !bytes.Contains(xml, []byte("</core>")) {
			return invalid("WithBrokerXML: no </core> element")
		}
		c.brokerXML = bytes.Clone(xml)
		return nil
	})
}

// WithLogf sets where [Run] reports what it does (the mode it chose, a
// download, the start-up time, a forced kill). Start passes t.Logf
// unless this option is given.
// Default: discard.
func WithLogf(logf func(format string, args ...any)) Option {
	return optionFunc(func(c *config) error {
		if logf == nil {
			return invalid("WithLogf(nil)")
		}
		c.logf = logf
		return nil
	})
}

// newConfig applies opts over the defaults and checks what no single
// option can check alone.
func newConfig(opts []Option) (config, error) {
	c := defaultConfig()
	for _, o := range opts {
		if o == nil {
			return c, invalid("nil Option")
		}
		if err := o.apply(&c); err != nil {
			return c, err
		}
	}
	if len(c.addresses) > 0 && c.brokerXML != nil && bytes.Contains(c.brokerXML, []byte("<addresses>")) {
		return c, invalid("WithQueues, WithAddress or WithDeadLetterQueues with a WithBrokerXML that has its own <addresses>: declare the queues there")
	}
	if c.image == "" {
		c.image = "apache/activemq-artemis:" + c.version
	}
	return c, nil
}
