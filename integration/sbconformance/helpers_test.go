package sbconformance

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/Azure/azure-sdk-for-go/sdk/messaging/azservicebus"
	"github.com/Azure/go-amqp"
)

// peer is the scripted Service Bus peer under test, reached through its
// connection string and control API.
type peer struct {
	conn string
	ctl  string
	http *http.Client
}

var nameSeq atomic.Int64

// needPeer returns the peer or skips the test when the env vars are unset.
func needPeer(t *testing.T) *peer {
	t.Helper()
	conn, ctl := os.Getenv("AMQPSUB_SBPEER_CONN"), os.Getenv("AMQPSUB_SBPEER_CONTROL")
	if conn == "" || ctl == "" {
		t.Skip("AMQPSUB_SBPEER_CONN and AMQPSUB_SBPEER_CONTROL are not set; start the peer with " +
			"integration/sbpeer/sbpeer.sh start and export them (see integration/sbpeer/README.md)")
	}
	return &peer{conn: conn, ctl: strings.TrimRight(ctl, "/"), http: &http.Client{Timeout: 30 * time.Second}}
}

// call sends a control request; body may be nil; out may be nil.
func (p *peer) call(method, path string, body, out any) error {
	var rd io.Reader
	if body != nil {
		b, err := json.Marshal(body)
		if err != nil {
			return err
		}
		rd = bytes.NewReader(b)
	}
	req, err := http.NewRequest(method, p.ctl+path, rd)
	if err != nil {
		return err
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := p.http.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(resp.Body)
	if err != nil {
		return err
	}
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("%s %s: %s: %s", method, path, resp.Status, strings.TrimSpace(string(data)))
	}
	if out != nil {
		return json.Unmarshal(data, out)
	}
	return nil
}

func (p *peer) must(t *testing.T, method, path string, body, out any) {
	t.Helper()
	if err := p.call(method, path, body, out); err != nil {
		t.Fatal(err)
	}
}

// entity creates an entity with a name unique to the test; the spec's
// "name" (if any) is used as a prefix. It is deleted when the test ends.
func (p *peer) entity(t *testing.T, spec map[string]any) string {
	t.Helper()
	base := strings.NewReplacer("/", "-", " ", "-").Replace(t.Name())
	name := fmt.Sprintf("conf-%s-%d", strings.ToLower(base), nameSeq.Add(1))
	if prefix, ok := spec["name"].(string); ok {
		name = prefix + "-" + name
	}
	s := map[string]any{}
	for k, v := range spec {
		s[k] = v
	}
	s["name"] = name
	p.must(t, "POST", "/entities", s, nil)
	t.Cleanup(func() { _ = p.call("POST", "/entities/delete", map[string]any{"name": name}, nil) })
	return name
}

type entityInfo struct {
	Name       string         `json:"name"`
	Available  int            `json:"available"`
	Locked     int            `json:"locked"`
	DeadLetter int            `json:"dead_letter"`
	Receivers  int            `json:"receivers"`
	Stats      map[string]int `json:"stats"`
	Sessions   map[string]struct {
		Available     int    `json:"available"`
		Locked        bool   `json:"locked"`
		LockedUntilMS *int64 `json:"locked_until_ms"`
	} `json:"sessions"`
}

func (p *peer) info(t *testing.T, name string) entityInfo {
	t.Helper()
	var e entityInfo
	p.must(t, "GET", "/entity?name="+url.QueryEscape(name), nil, &e)
	return e
}

type peerMessage struct {
	SequenceNumber        int64          `json:"sequence_number"`
	MessageID             string         `json:"message_id"`
	SessionID             *string        `json:"session_id"`
	DeliveryCount         int            `json:"delivery_count"`
	State                 string         `json:"state"`
	LockedUntilMS         int64          `json:"locked_until_ms"`
	LockToken             string         `json:"lock_token"`
	ApplicationProperties map[string]any `json:"application_properties"`
	Body                  any            `json:"body"`
}

func (p *peer) messages(t *testing.T, entity string) []peerMessage {
	t.Helper()
	var r struct {
		Messages []peerMessage `json:"messages"`
	}
	p.must(t, "GET", "/messages?entity="+url.QueryEscape(entity), nil, &r)
	return r.Messages
}

func (p *peer) counters(t *testing.T) map[string]int {
	t.Helper()
	c := map[string]int{}
	p.must(t, "GET", "/counters", nil, &c)
	return c
}

// waitFor polls cond until it holds or the timeout passes.
func waitFor(t *testing.T, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", timeout, what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// waitCounter waits until the peer's counter has grown by at least n from
// the value in before.
func (p *peer) waitCounter(t *testing.T, before map[string]int, name string, n int, timeout time.Duration) {
	t.Helper()
	waitFor(t, timeout, fmt.Sprintf("counter %s to grow by %d", name, n), func() bool {
		return p.counters(t)[name]-before[name] >= n
	})
}

// restoreAuth puts the peer's authentication settings back when the test ends.
func (p *peer) restoreAuth(t *testing.T) {
	var before struct {
		MaxTokenLifetime *float64 `json:"max_token_lifetime_s"`
		CBSDeadline      *float64 `json:"cbs_deadline_s"`
	}
	p.must(t, "GET", "/auth", nil, &before)
	t.Cleanup(func() {
		_ = p.call("POST", "/auth", map[string]any{
			"max_token_lifetime_s": before.MaxTokenLifetime,
			"cbs_deadline_s":       before.CBSDeadline,
			"jwt_tokens":           []string{},
		}, nil)
	})
}

func newClient(t *testing.T, conn string) *azservicebus.Client {
	t.Helper()
	c, err := azservicebus.NewClientFromConnectionString(conn, &azservicebus.ClientOptions{
		RetryOptions: azservicebus.RetryOptions{MaxRetries: 2, RetryDelay: 100 * time.Millisecond, MaxRetryDelay: 500 * time.Millisecond},
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_ = c.Close(ctx)
	})
	return c
}

func ctxFor(t *testing.T, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

func send(t *testing.T, c *azservicebus.Client, entity string, msgs ...*azservicebus.Message) {
	t.Helper()
	s, err := c.NewSender(entity, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close(context.Background())
	ctx := ctxFor(t, 20*time.Second)
	for _, m := range msgs {
		if err := s.SendMessage(ctx, m, nil); err != nil {
			t.Fatalf("send to %s: %v", entity, err)
		}
	}
}

func textMsg(id, body string) *azservicebus.Message {
	return &azservicebus.Message{MessageID: &id, Body: []byte(body)}
}

// receiveN receives exactly n messages (several calls if needed).
type messageReceiver interface {
	ReceiveMessages(ctx context.Context, maxMessages int, options *azservicebus.ReceiveMessagesOptions) ([]*azservicebus.ReceivedMessage, error)
}

func receiveN(t *testing.T, r messageReceiver, n int, timeout time.Duration) []*azservicebus.ReceivedMessage {
	t.Helper()
	ctx := ctxFor(t, timeout)
	var got []*azservicebus.ReceivedMessage
	for len(got) < n {
		ms, err := r.ReceiveMessages(ctx, n-len(got), nil)
		if err != nil {
			t.Fatalf("received %d of %d messages: %v", len(got), n, err)
		}
		got = append(got, ms...)
	}
	return got
}

func sbCode(err error) azservicebus.Code {
	var e *azservicebus.Error
	if errors.As(err, &e) {
		return e.Code
	}
	return ""
}

func str(p *string) string {
	if p == nil {
		return "<nil>"
	}
	return *p
}

func asAMQPError(err error, target **amqp.Error) bool {
	return errors.As(err, target)
}
