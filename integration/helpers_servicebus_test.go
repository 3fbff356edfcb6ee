package integration

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/amqpsub/amqpsub/amqpsub"
)

// Helpers for the Service Bus peer: its control API, the official
// client's sender, connectors and token providers.

// sbPeer is the scripted Service Bus peer (integration/sbpeer), reached
// through the connection string and control API make test exports.
type sbPeer struct {
	conn, ctl string
}

func serviceBusPeer(t testing.TB) *sbPeer {
	t.Helper()
	conn, ctl := os.Getenv("AMQPSUB_SBPEER_CONN"), os.Getenv("AMQPSUB_SBPEER_CONTROL")
	if conn == "" || ctl == "" {
		t.Skip("no Service Bus peer (AMQPSUB_SBPEER_CONN, AMQPSUB_SBPEER_CONTROL): start it with " +
			"`bash integration/sbpeer/sbpeer.sh start` and export its url and ctl-url; `make test` does both")
	}
	return &sbPeer{conn: conn, ctl: strings.TrimRight(ctl, "/")}
}

func (p *sbPeer) call(t testing.TB, method, path string, body, out any) {
	t.Helper()
	var rd io.Reader
	if body != nil {
		b, _ := json.Marshal(body)
		rd = bytes.NewReader(b)
	}
	req, _ := http.NewRequest(method, p.ctl+path, rd)
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatalf("peer %s %s: %v", method, path, err)
	}
	defer resp.Body.Close()
	data, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("peer %s %s: %s: %s", method, path, resp.Status, data)
	}
	if out != nil {
		if err := json.Unmarshal(data, out); err != nil {
			t.Fatalf("peer %s %s: %v", method, path, err)
		}
	}
}

// entity makes a fresh queue named after the test, with spec's settings.
func (p *sbPeer) entity(t testing.TB, spec map[string]any) string {
	t.Helper()
	name := strings.ToLower(queueName(t))
	spec["name"] = name
	p.call(t, "POST", "/entities", spec, nil)
	return name
}

type sbEntity struct {
	Available  int            `json:"available"`
	Locked     int            `json:"locked"`
	DeadLetter int            `json:"dead_letter"`
	Stats      map[string]int `json:"stats"`
}

func (p *sbPeer) info(t testing.TB, name string) sbEntity {
	var e sbEntity
	p.call(t, "GET", "/entity?name="+name, nil, &e)
	return e
}

func (p *sbPeer) counters(t testing.TB) map[string]int {
	m := map[string]int{}
	p.call(t, "GET", "/counters", nil, &m)
	return m
}

type sbMessage struct {
	MessageID     string         `json:"message_id"`
	DeliveryCount int            `json:"delivery_count"`
	State         string         `json:"state"`
	AppProps      map[string]any `json:"application_properties"`
}

func (p *sbPeer) messages(t testing.TB, entity string) []sbMessage {
	var out struct {
		Messages []sbMessage `json:"messages"`
	}
	p.call(t, "GET", "/messages?entity="+entity+"&limit=100000", nil, &out)
	return out.Messages
}

var (
	sbsendOnce sync.Once
	sbsendPath string
	sbsendErr  error
)

// send publishes count messages to entity through the official client
// (integration/sbconformance/cmd/sbsend): ids m-<i>, application properties
// n (index) and seq (place in its session, from 1), body "<session>/<seq>".
func (p *sbPeer) send(t testing.TB, entity string, count int, args ...string) {
	t.Helper()
	sbsendOnce.Do(func() {
		dir, err := os.MkdirTemp("", "sbsend")
		if err != nil {
			sbsendErr = err
			return
		}
		sbsendPath = filepath.Join(dir, "sbsend")
		cmd := exec.Command("go", "build", "-o", sbsendPath, "./cmd/sbsend")
		cmd.Dir = filepath.Join("sbconformance")
		if out, err := cmd.CombinedOutput(); err != nil {
			sbsendErr = fmt.Errorf("go build sbsend: %v\n%s", err, out)
		}
	})
	if sbsendErr != nil {
		t.Fatal(sbsendErr)
	}
	cmd := exec.Command(sbsendPath, append([]string{"-conn", p.conn, "-entity", entity, "-count", fmt.Sprint(count)}, args...)...)
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("sbsend: %v\n%s", err, out)
	}
}

func sbConnector(t testing.TB, p *sbPeer) amqpsub.Connector {
	t.Helper()
	c, err := amqpsub.ServiceBus(p.conn)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// n is the index sbsend gave a message.
func sbIndex(d *amqpsub.Delivery) int {
	v, _ := d.ApplicationProperties()["n"].(int64)
	return int(v)
}

// fxEntity makes a fresh queue named fx-<test>-<n> with spec's settings,
// deleted when the test ends.
func (p *sbPeer) fxEntity(t testing.TB, spec map[string]any) string {
	t.Helper()
	name := fmt.Sprintf("fx-%s-%d-%d", strings.ToLower(strings.NewReplacer("/", "-", " ", "-", "_", "-").Replace(t.Name())),
		time.Now().UnixNano(), queueSeq.Add(1))
	spec["name"] = name
	p.call(t, "POST", "/entities", spec, nil)
	t.Cleanup(func() { p.call(t, "POST", "/entities/delete", map[string]any{"name": name}, nil) })
	return name
}

// tokenEndpoint is the peer's address for ServiceBusWithToken (emulator
// mode), and a SAS token provider with the peer's key and lifetime life.
func (p *sbPeer) tokenEndpoint(life time.Duration) (string, amqpsub.TokenProvider) {
	host := strings.TrimRight(strings.TrimPrefix(connValue(p.conn, "Endpoint"), "sb://"), "/")
	return "amqp://" + host, amqpsub.SASTokenProvider(connValue(p.conn, "SharedAccessKeyName"), connValue(p.conn, "SharedAccessKey"), life)
}

// tokenScript wraps a TokenProvider: the calls numbered in fail (from 1)
// fail; from call blockFrom on (when > 0) Token blocks, ignoring ctx, until
// release is closed, and says so on blocked.
type tokenScript struct {
	amqpsub.TokenProvider
	fail      map[int]bool
	blockFrom int
	blocked   chan struct{}
	release   chan struct{}

	mu sync.Mutex
	n  int
}

func (s *tokenScript) Token(ctx context.Context, audience string) (amqpsub.Token, error) {
	s.mu.Lock()
	s.n++
	n := s.n
	s.mu.Unlock()
	if s.fail[n] {
		return amqpsub.Token{}, errors.New("identity endpoint: 503 Service Unavailable")
	}
	if s.blockFrom > 0 && n >= s.blockFrom {
		if n == s.blockFrom {
			close(s.blocked)
		}
		<-s.release
	}
	return s.TokenProvider.Token(ctx, audience)
}

func (s *tokenScript) calls() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.n
}

// connectionLossLocks sets what the peer does to a lost connection's
// message locks for the rest of the test: "survive" or "drop" (see
// sbpeer's README, POST /settings).
func connectionLossLocks(t *testing.T, p *sbPeer, reading string) {
	t.Helper()
	p.call(t, "POST", "/settings", map[string]any{"connection_loss_locks": reading}, nil)
	t.Cleanup(func() { p.call(t, "POST", "/settings", map[string]any{"connection_loss_locks": "survive"}, nil) })
}

func connValue(cs, key string) string {
	for _, seg := range strings.Split(cs, ";") {
		if k, v, ok := strings.Cut(seg, "="); ok && strings.EqualFold(k, key) {
			return v
		}
	}
	return ""
}
