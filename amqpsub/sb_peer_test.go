package amqpsub

// Helpers for the tests that run against the scripted Service Bus peer
// (integration/sbpeer), for the internals a black-box test cannot reach.
// They skip without AMQPSUB_SBPEER_CONN and AMQPSUB_SBPEER_CONTROL.

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"
)

type sbTestPeer struct{ conn, ctl string }

func sbTestPeerOrSkip(t *testing.T) *sbTestPeer {
	t.Helper()
	c, ctl := os.Getenv("AMQPSUB_SBPEER_CONN"), os.Getenv("AMQPSUB_SBPEER_CONTROL")
	if c == "" || ctl == "" {
		t.Skip("no Service Bus peer (AMQPSUB_SBPEER_CONN, AMQPSUB_SBPEER_CONTROL): start it with `bash integration/sbpeer/sbpeer.sh start`")
	}
	return &sbTestPeer{c, strings.TrimRight(ctl, "/")}
}

func (p *sbTestPeer) call(t *testing.T, method, path string, body any) map[string]any {
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
		t.Fatalf("peer %s %s: %s %s", method, path, resp.Status, data)
	}
	out := map[string]any{}
	_ = json.Unmarshal(data, &out)
	return out
}

// entity creates a queue named fx-<test>-<n> with spec's settings, deleted
// when the test ends.
func (p *sbTestPeer) entity(t *testing.T, spec map[string]any) string {
	t.Helper()
	name := fmt.Sprintf("fx-%s-%d", strings.ToLower(strings.NewReplacer("/", "-", "_", "-").Replace(t.Name())), time.Now().UnixNano())
	spec["name"] = name
	p.call(t, "POST", "/entities", spec)
	t.Cleanup(func() {
		p.call(t, "POST", "/entities/delete", map[string]any{"name": name})
		http.DefaultClient.CloseIdleConnections()
	})
	return name
}

// enqueue puts n messages on q (ids <q>-<i>).
func (p *sbTestPeer) enqueue(t *testing.T, q string, n int, extra map[string]any) {
	t.Helper()
	body := map[string]any{"entity": q, "count": n, "message_id_prefix": q}
	for k, v := range extra {
		body[k] = v
	}
	p.call(t, "POST", "/messages", body)
}

// stat returns one of q's counters (completed, delivered, lock_expired…).
func (p *sbTestPeer) stat(t *testing.T, q, name string) int {
	t.Helper()
	st, _ := p.call(t, "GET", "/entity?name="+q, nil)["stats"].(map[string]any)
	n, _ := st[name].(float64)
	return int(n)
}

func sbTestLog(t *testing.T) *zap.Logger { return zaptest.NewLogger(t, zaptest.Level(zap.WarnLevel)) }

// waitUntil polls cond until it holds, failing the test after within.
func waitUntil(t *testing.T, within time.Duration, what string, cond func() bool) {
	t.Helper()
	end := time.Now().Add(within)
	for !cond() {
		if time.Now().After(end) {
			t.Fatalf("timed out after %v waiting for %s", within, what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}
