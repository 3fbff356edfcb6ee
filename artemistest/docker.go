package artemistest

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"time"
)

// dockerProbeTimeout bounds the whole probe of mode Auto and Container.
const dockerProbeTimeout = 2 * time.Second

// dockerCandidates lists where a Docker engine may listen, as the Docker
// CLI and testcontainers look for it. DOCKER_HOST, when set, is the only
// candidate, as for the Docker CLI.
func dockerCandidates() []string {
	if h := os.Getenv("DOCKER_HOST"); h != "" {
		return []string{h}
	}
	var out []string
	home, _ := os.UserHomeDir()
	if home != "" {
		out = append(out, testcontainersHosts(filepath.Join(home, ".testcontainers.properties"))...)
	}
	socks := []string{"/var/run/docker.sock"}
	if d := os.Getenv("XDG_RUNTIME_DIR"); d != "" {
		socks = append(socks, filepath.Join(d, "docker.sock"))
	}
	if home != "" {
		socks = append(socks,
			filepath.Join(home, ".docker", "run", "docker.sock"),
			filepath.Join(home, ".docker", "desktop", "docker.sock"))
	}
	socks = append(socks, fmt.Sprintf("/run/user/%d/docker.sock", os.Getuid()))
	for _, s := range socks {
		if fi, err := os.Stat(s); err == nil && fi.Mode()&os.ModeSocket != 0 { //nolint:gosec // G703: only looks whether the socket is there
			out = append(out, "unix://"+s)
		}
	}
	return out
}

// testcontainersHosts reads tc.host and docker.host from testcontainers'
// properties file, if there is one.
func testcontainersHosts(path string) []string {
	f, err := os.Open(path) //nolint:gosec // G304: the user's own testcontainers config, read as testcontainers reads it
	if err != nil {
		return nil
	}
	defer func() { _ = f.Close() }()
	var out []string
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		k, v, ok := strings.Cut(sc.Text(), "=")
		k, v = strings.TrimSpace(k), strings.TrimSpace(v)
		if ok && v != "" && (k == "tc.host" || k == "docker.host") {
			out = append(out, v)
		}
	}
	return out
}

// errNoCandidate is the probe's error when nothing suggests a Docker
// engine at all.
var errNoCandidate = errors.New("DOCKER_HOST is not set and no Docker socket exists")

// probeDocker returns the first candidate whose engine answers an HTTP
// request, trying each in turn, all within timeout (and ctx). A candidate
// it cannot probe (ssh://, npipe://) counts as answering: testcontainers
// will tell. It never takes longer than timeout.
func probeDocker(ctx context.Context, candidates []string, timeout time.Duration) (string, error) {
	if len(candidates) == 0 {
		return "", errNoCandidate
	}
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	var errs []error
	for _, c := range candidates {
		err := pingDocker(ctx, c)
		if err == nil {
			return c, nil
		}
		errs = append(errs, fmt.Errorf("%s: %w", c, err))
	}
	return "", errors.Join(errs...)
}

// pingDocker sends GET /_ping and takes any HTTP answer as an engine
// (a TLS endpoint answers a plain request with 400, which still proves
// something listens there; testcontainers does the TLS).
func pingDocker(ctx context.Context, endpoint string) error {
	u, err := url.Parse(endpoint)
	if err != nil {
		return err
	}
	var network, addr string
	switch u.Scheme {
	case "unix":
		network, addr = "unix", u.Path
	case "tcp", "http", "https":
		network, addr = "tcp", u.Host
		if u.Port() == "" {
			addr = net.JoinHostPort(u.Hostname(), "2375")
		}
	default:
		return nil
	}
	var d net.Dialer
	conn, err := d.DialContext(ctx, network, addr)
	if err != nil {
		return err
	}
	defer func() { _ = conn.Close() }()
	if dl, ok := ctx.Deadline(); ok {
		if err := conn.SetDeadline(dl); err != nil {
			return err
		}
	}
	if _, err := conn.Write([]byte("GET /_ping HTTP/1.1\r\nHost: docker\r\nConnection: close\r\n\r\n")); err != nil {
		return err
	}
	line, err := bufio.NewReader(conn).ReadString('\n')
	if err != nil {
		return fmt.Errorf("no answer: %w", err)
	}
	if !strings.HasPrefix(line, "HTTP/") {
		return fmt.Errorf("not an HTTP answer: %q", strings.TrimSpace(line))
	}
	return nil
}
