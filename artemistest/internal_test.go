//go:build unix

package artemistest

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"context"
	"encoding/xml"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"
)

// serve answers every connection on l with answer (nothing if empty)
// until l is closed; the returned func closes l and waits.
func serve(t *testing.T, l net.Listener, answer string) func() {
	t.Helper()
	var wg sync.WaitGroup
	var conns []net.Conn
	wg.Go(func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			conns = append(conns, c)
			if answer != "" {
				_, _ = c.Write([]byte(answer))
			}
		}
	})
	return func() {
		_ = l.Close()
		wg.Wait()
		for _, c := range conns {
			_ = c.Close()
		}
	}
}

func TestProbeDocker(t *testing.T) {
	dir := t.TempDir()
	listen := func(name, answer string) string {
		p := filepath.Join(dir, name)
		l, err := net.Listen("unix", p)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(serve(t, l, answer))
		return "unix://" + p
	}
	engine := listen("engine.sock", "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nOK")
	silent := listen("silent.sock", "")
	garbage := listen("garbage.sock", "SSH-2.0-OpenSSH\r\n")
	tcpL, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(serve(t, tcpL, "HTTP/1.0 400 Bad Request\r\n\r\nClient sent an HTTP request to an HTTPS server.\n"))
	tlsEngine := "tcp://" + tcpL.Addr().String()
	missing := "unix://" + filepath.Join(dir, "missing.sock")

	const timeout = 300 * time.Millisecond
	for _, tc := range []struct {
		name       string
		candidates []string
		want       string // "" means an error
	}{
		{"none", nil, ""},
		{"engine", []string{engine}, engine},
		{"TLS engine over tcp", []string{tlsEngine}, tlsEngine},
		{"missing socket", []string{missing}, ""},
		{"silent socket", []string{silent}, ""},
		{"not HTTP", []string{garbage}, ""},
		{"first that answers", []string{missing, garbage, engine}, engine},
		{"cannot probe ssh", []string{"ssh://me@docker.example"}, "ssh://me@docker.example"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t0 := time.Now()
			got, err := probeDocker(t.Context(), tc.candidates, timeout)
			if d := time.Since(t0); d > timeout+time.Second {
				t.Errorf("probe took %v, bound %v", d, timeout)
			}
			if tc.want == "" {
				if err == nil {
					t.Fatalf("probe = %q, want an error", got)
				}
				t.Logf("error: %v", err)
				return
			}
			if err != nil || got != tc.want {
				t.Fatalf("probe = %q, %v; want %q", got, err, tc.want)
			}
		})
	}
	t.Run("silent socket bounded by ctx", func(t *testing.T) {
		ctx, cancel := context.WithTimeout(t.Context(), 100*time.Millisecond)
		defer cancel()
		t0 := time.Now()
		if _, err := probeDocker(ctx, []string{silent}, time.Hour); err == nil {
			t.Fatal("no error")
		}
		if d := time.Since(t0); d > time.Second {
			t.Errorf("probe took %v after a 100 ms ctx", d)
		}
	})
}

func TestDockerCandidates(t *testing.T) {
	t.Setenv("DOCKER_HOST", "tcp://127.0.0.1:1")
	if got := dockerCandidates(); len(got) != 1 || got[0] != "tcp://127.0.0.1:1" {
		t.Errorf("with DOCKER_HOST: %q, want it alone", got)
	}
	home := t.TempDir()
	t.Setenv("DOCKER_HOST", "")
	t.Setenv("HOME", home)
	t.Setenv("XDG_RUNTIME_DIR", home)
	props := "# comment\ntc.host = tcp://tc.example:2375\nother=x\ndocker.host=unix:///props.sock\n"
	if err := os.WriteFile(filepath.Join(home, ".testcontainers.properties"), []byte(props), 0o600); err != nil {
		t.Fatal(err)
	}
	l, err := net.Listen("unix", filepath.Join(home, "docker.sock"))
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	got := strings.Join(dockerCandidates(), " ")
	for _, want := range []string{"tcp://tc.example:2375", "unix:///props.sock", "unix://" + filepath.Join(home, "docker.sock")} {
		if !strings.Contains(got, want) {
			t.Errorf("candidates %q lack %q", got, want)
		}
	}
}

func TestFreePorts(t *testing.T) {
	a, err := freePorts(2)
	if err != nil {
		t.Fatal(err)
	}
	b, err := freePorts(2)
	if err != nil {
		t.Fatal(err)
	}
	defer releasePorts(b)
	seen := map[int]bool{}
	for _, p := range append(append([]int{}, a...), b...) {
		if seen[p] {
			t.Errorf("port %d given twice: %v %v", p, a, b)
		}
		seen[p] = true
	}
	releasePorts(a)
	portsMu.Lock()
	defer portsMu.Unlock()
	for _, p := range a {
		if portsHeld[p] {
			t.Errorf("port %d still held after releasePorts", p)
		}
	}
}

func TestRenderBrokerXML(t *testing.T) {
	c := defaultConfig()
	c.declare("orders", Anycast, Queue{Name: "orders"})
	c.declare(`a&b"<c>`, Anycast, Queue{Name: `a&b"<c>`})
	out := renderBrokerXML(&c)
	for _, want := range []string{
		`<address name="orders"><anycast><queue name="orders"/></anycast></address>`,
		`<address name="a&amp;b&#34;&lt;c&gt;">`,
	} {
		if !strings.Contains(string(out), want) {
			t.Errorf("no %s in\n%s", want, out)
		}
	}
	if i, j := bytes.Index(out, []byte("<addresses>")), bytes.LastIndex(out, []byte("</core>")); i < 0 || i > j {
		t.Errorf("<addresses> not inside <core>")
	}
	// Well-formed, and the name reads back as given.
	dec := xml.NewDecoder(bytes.NewReader(out))
	var names []string
	for {
		tok, err := dec.Token()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatalf("not well-formed: %v", err)
		}
		if se, ok := tok.(xml.StartElement); ok && se.Name.Local == "queue" {
			for _, a := range se.Attr {
				names = append(names, a.Value)
			}
		}
	}
	if strings.Join(names, "|") != `orders|a&b"<c>` {
		t.Errorf("queue names read back as %q", names)
	}
	c.addresses = nil
	if !bytes.Equal(renderBrokerXML(&c), defaultBrokerXML) {
		t.Error("without queues, the broker.xml is not the default")
	}
}

// Our broker.xml keeps the security and address settings of
// integration/artemis/broker.xml (comments aside), so that a user's test
// broker behaves like amqpsub's. The file is in the repository, not in
// the module: the test skips outside a checkout.
func TestBrokerXMLInStepWithIntegration(t *testing.T) {
	theirs, err := os.ReadFile(filepath.Join("..", "integration", "artemis", "broker.xml"))
	if err != nil {
		t.Skipf("no integration/artemis/broker.xml: %v", err)
	}
	comments := regexp.MustCompile(`(?s)<!--.*?-->`)
	space := regexp.MustCompile(`\s+`)
	section := func(doc []byte, tag string) string {
		s := comments.ReplaceAllString(string(doc), "")
		i, j := strings.Index(s, "<"+tag+">"), strings.Index(s, "</"+tag+">")
		if i < 0 || j < i {
			t.Fatalf("no <%s>", tag)
		}
		return space.ReplaceAllString(s[i:j], " ")
	}
	for _, tag := range []string{"security-settings", "address-settings"} {
		if ours, want := section(defaultBrokerXML, tag), section(theirs, tag); ours != want {
			t.Errorf("<%s> differs from integration/artemis/broker.xml:\nours:   %s\ntheirs: %s", tag, ours, want)
		}
	}
}

func tarGz(t *testing.T, entries ...*tar.Header) string {
	t.Helper()
	var buf bytes.Buffer
	gz := gzip.NewWriter(&buf)
	tw := tar.NewWriter(gz)
	for _, h := range entries {
		body := "#!/bin/sh\n"
		if h.Typeflag == tar.TypeReg {
			h.Size = int64(len(body))
		}
		if err := tw.WriteHeader(h); err != nil {
			t.Fatal(err)
		}
		if h.Typeflag == tar.TypeReg {
			if _, err := tw.Write([]byte(body)); err != nil {
				t.Fatal(err)
			}
		}
	}
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	if err := gz.Close(); err != nil {
		t.Fatal(err)
	}
	p := filepath.Join(t.TempDir(), "x.tar.gz")
	if err := os.WriteFile(p, buf.Bytes(), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

func TestUntarGz(t *testing.T) {
	good := tarGz(t,
		&tar.Header{Name: "d/", Typeflag: tar.TypeDir, Mode: 0o755},
		&tar.Header{Name: "d/bin/artemis", Typeflag: tar.TypeReg, Mode: 0o755},
		&tar.Header{Name: "d/link", Typeflag: tar.TypeSymlink, Linkname: "bin/artemis"})
	dest := t.TempDir()
	if err := untarGz(t.Context(), good, dest); err != nil {
		t.Fatal(err)
	}
	if !isExecutable(filepath.Join(dest, "d", "bin", "artemis")) || !isExecutable(filepath.Join(dest, "d", "link")) {
		t.Error("bin/artemis is not an executable file (or the link does not lead to it)")
	}
	for name, h := range map[string]*tar.Header{
		"parent":            {Name: "../evil", Typeflag: tar.TypeReg, Mode: 0o644},
		"absolute":          {Name: "/tmp/evil", Typeflag: tar.TypeReg, Mode: 0o644},
		"link outside":      {Name: "d/l", Typeflag: tar.TypeSymlink, Linkname: "../../etc/passwd"},
		"absolute link":     {Name: "d/l", Typeflag: tar.TypeSymlink, Linkname: "/etc/passwd"},
		"parent in the mid": {Name: "d/../../evil", Typeflag: tar.TypeReg, Mode: 0o644},
	} {
		t.Run(name, func(t *testing.T) {
			if err := untarGz(t.Context(), tarGz(t, h), t.TempDir()); err == nil {
				t.Fatal("unpacked an entry that leaves the directory")
			}
		})
	}
}

// The first Run on a machine downloads the distribution with Maven and
// unpacks it; concurrent Runs (here: ensureDist in two goroutines) do it
// once between them, and a tarball already there is not downloaded
// again. mvn is a script that copies a small tarball of the
// distribution's layout and counts its calls: nothing is fetched.
func TestEnsureDistDownloadsOnce(t *testing.T) {
	name := "apache-artemis-" + DefaultVersion
	cached := tarGz(t,
		&tar.Header{Name: name + "/", Typeflag: tar.TypeDir, Mode: 0o755},
		&tar.Header{Name: name + "/bin/artemis", Typeflag: tar.TypeReg, Mode: 0o755},
		&tar.Header{Name: name + "/lib/artemis-boot.jar", Typeflag: tar.TypeReg, Mode: 0o644})
	bin := t.TempDir()
	calls := filepath.Join(bin, "calls")
	script := fmt.Sprintf(`#!/bin/sh
echo "$*" >>%q
for a in "$@"; do
  case "$a" in -DoutputDirectory=*) out="${a#-DoutputDirectory=}" ;; esac
done
mkdir -p "$out" && cp %q "$out/apache-artemis-%s-bin.tar.gz"
`, calls, cached, DefaultVersion)
	if err := os.WriteFile(filepath.Join(bin, "mvn"), []byte(script), 0o700); err != nil {
		t.Fatal(err)
	}
	t.Setenv("PATH", bin+string(os.PathListSeparator)+os.Getenv("PATH"))

	c := defaultConfig()
	c.cacheDir = t.TempDir()
	c.logf = t.Logf
	var wg sync.WaitGroup
	var homes [2]string
	var errs [2]error
	for i := range homes {
		wg.Go(func() { homes[i], errs[i] = ensureDist(t.Context(), &c) })
	}
	wg.Wait()
	if err := errors.Join(errs[:]...); err != nil {
		t.Fatal(err)
	}
	if homes[0] != homes[1] || !isExecutable(filepath.Join(homes[0], "bin", "artemis")) {
		t.Fatalf("homes %q: no bin/artemis", homes)
	}
	countCalls := func() int {
		b, _ := os.ReadFile(calls)
		return strings.Count(string(b), "\n")
	}
	if n := countCalls(); n != 1 {
		t.Errorf("mvn ran %d times, want 1", n)
	}
	b, _ := os.ReadFile(calls)
	if !strings.Contains(string(b), "dependency:copy -Dartifact=org.apache.activemq:apache-artemis:"+DefaultVersion+":tar.gz:bin") {
		t.Errorf("mvn called with %s", b)
	}

	// Unpacked dist gone, tarball kept: unpack again, no download.
	if err := os.RemoveAll(homes[0]); err != nil {
		t.Fatal(err)
	}
	if _, err := ensureDist(t.Context(), &c); err != nil {
		t.Fatal(err)
	}
	if n := countCalls(); n != 1 {
		t.Errorf("mvn ran again (%d calls) with the tarball in the cache", n)
	}
	left, _ := filepath.Glob(filepath.Join(c.cacheDir, ".*-*"))
	if len(left) != 0 {
		t.Errorf("temporary files left in the cache dir: %q", left)
	}
}

// Without Maven, the message says what to do.
func TestEnsureDistWithoutMaven(t *testing.T) {
	t.Setenv("PATH", t.TempDir())
	c := defaultConfig()
	c.cacheDir = t.TempDir()
	_, err := ensureDist(t.Context(), &c)
	if err == nil || !strings.Contains(err.Error(), "Maven (mvn)") {
		t.Fatalf("ensureDist = %v, want a word about Maven", err)
	}
}

// The lock waits for its holder and gives up when ctx ends.
func TestLockFile(t *testing.T) {
	p := filepath.Join(t.TempDir(), "lock")
	unlock, err := lockFile(t.Context(), p)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(t.Context(), 300*time.Millisecond)
	defer cancel()
	if _, err := lockFile(ctx, p); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("second lock while held = %v, want DeadlineExceeded", err)
	}
	unlock()
	unlock2, err := lockFile(t.Context(), p)
	if err != nil {
		t.Fatalf("lock after unlock: %v", err)
	}
	unlock2()
}

// WithDeadLetterQueues declares each dead-letter queue as the broker's
// auto-creation would make it, all on one DLQ address; WithAddress
// declares multicast addresses and filters; a bad routing is refused.
func TestRenderAddresses(t *testing.T) {
	c, err := newConfig([]Option{
		WithQueues("orders"),
		WithDeadLetterQueues("orders", "o'neil"),
		WithAddress("events", Multicast, Queue{Name: "audit"}, Queue{Name: "eu", Filter: "region = 'eu'"}),
		WithQueues("orders"),
		WithAddress("events", Anycast, Queue{Name: "work"}),
	})
	if err != nil {
		t.Fatal(err)
	}
	out := string(renderBrokerXML(&c))
	for _, want := range []string{
		`<address name="orders"><anycast><queue name="orders"/></anycast></address>`,
		`<address name="DLQ"><anycast><queue name="DLQ.orders"><filter string="_AMQ_ORIG_ADDRESS = &#39;orders&#39;"/></queue>` +
			`<queue name="DLQ.o&#39;neil"><filter string="_AMQ_ORIG_ADDRESS = &#39;o&#39;&#39;neil&#39;"/></queue></anycast></address>`,
		`<address name="events"><multicast><queue name="audit"/><queue name="eu"><filter string="region = &#39;eu&#39;"/></queue></multicast>` +
			`<anycast><queue name="work"/></anycast></address>`,
	} {
		if !strings.Contains(out, want) {
			t.Errorf("no %s in\n%s", want, out)
		}
	}
	for _, a := range []string{`<address name="DLQ">`, `<address name="events">`, `<queue name="orders"/>`} {
		if strings.Count(out, a) != 1 {
			t.Errorf("%s is declared %d times, want once:\n%s", a, strings.Count(out, a), out)
		}
	}
	if err := xml.Unmarshal([]byte(out), new(struct{})); err != nil {
		t.Errorf("not well-formed: %v", err)
	}
	for _, o := range []Option{WithAddress("x", "broadcast"), WithAddress("", Anycast), WithAddress("x", Anycast, Queue{}), WithDeadLetterQueues("")} {
		if _, err := newConfig([]Option{o}); !errors.Is(err, ErrInvalidOption) {
			t.Errorf("option accepted: %v", err)
		}
	}
}
