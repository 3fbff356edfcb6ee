package main

import (
	"context"
	"strings"
	"testing"
	"time"
)

func TestParseRefEvent(t *testing.T) {
	for _, tc := range []struct {
		line string
		want refEvent
		ok   bool
	}{
		{"start 123 0", refEvent{"start", 123, 0}, true},
		{"last 9000000000 50001", refEvent{"last", 9000000000, 50001}, true},
		{"progress 5 1000", refEvent{"progress", 5, 1000}, true},
		{"first 7 1", refEvent{"first", 7, 1}, true},
		{"50001 messages received", refEvent{}, false},
		{"last 12", refEvent{}, false},
		{"last x 12", refEvent{}, false},
		{"end 1 2", refEvent{}, false},
		{"", refEvent{}, false},
	} {
		got, ok := parseRefEvent(tc.line)
		if got != tc.want || ok != tc.ok {
			t.Errorf("parseRefEvent(%q) = %+v, %v; want %+v, %v", tc.line, got, ok, tc.want, tc.ok)
		}
	}
}

func TestTailKeepsTheEnd(t *testing.T) {
	tl := &tail{max: 8}
	for _, s := range []string{"abc", "defgh", "ijklmnop", "qr"} {
		if n, err := tl.Write([]byte(s)); n != len(s) || err != nil {
			t.Fatalf("Write(%q) = %d, %v", s, n, err)
		}
	}
	if got := tl.String(); got != "klmnopqr" {
		t.Errorf("tail = %q, want %q", got, "klmnopqr")
	}
}

func TestStallSeconds(t *testing.T) {
	for in, want := range map[time.Duration]int{0: 1, time.Millisecond: 1, time.Second: 1, 1500 * time.Millisecond: 2, 20 * time.Second: 20} {
		if got := stallSeconds(in); got != want {
			t.Errorf("stallSeconds(%v) = %d, want %d", in, got, want)
		}
	}
}

// TestDrainRef runs drainRef on shell scripts standing in for a reference
// consumer: every way a child can fail must fail the drain, and a child that
// hangs (with a grandchild holding its stdout) must be killed at -stall.
func TestDrainRef(t *testing.T) {
	refConsumers["fake"] = refConsumer{args: func(*broker, string, int, int, time.Duration) ([]string, error) {
		return nil, nil
	}}
	defer delete(refConsumers, "fake")
	b := &broker{name: "artemis", url: "amqp://127.0.0.1:1"}
	const want = 5
	for _, tc := range []struct {
		name   string
		script string
		errHas string // "" for success
	}{
		{"ok", `echo "start 1000000000 0"; echo noise; echo "first 1100000000 1"; echo "last 3000000000 5"`, ""},
		{"short", `echo "start 1 0"; echo "last 2 4"`, "last line says 4 messages, want 5"},
		{"exit 1", `echo "start 1 0"; echo "progress 2 3"; echo boom >&2; exit 1`, "boom"},
		{"no last", `echo "start 1 0"`, "without a start and a last line"},
		{"hangs", `echo "start 1 0"; sleep 60; echo "last 2 5"`, "stalled"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			sc := scenario{name: "fake", ref: "fake", cmd: []string{"sh", "-c", tc.script}}
			rc := runConfig{credit: 256, stall: 500 * time.Millisecond, timeout: 30 * time.Second}
			begin := time.Now()
			res, err := drainRef(context.Background(), b, "q", want, sc, rc)
			if took := time.Since(begin); took > 10*time.Second {
				t.Errorf("drainRef took %v", took)
			}
			if tc.errHas == "" {
				if err != nil {
					t.Fatalf("drainRef: %v", err)
				}
				if res.msgs != want || res.elapsed != 2*time.Second {
					t.Errorf("result %+v, want %d messages in 2s", res, want)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tc.errHas) {
				t.Fatalf("drainRef error %v, want one containing %q", err, tc.errHas)
			}
			if testing.Verbose() {
				t.Log(err)
			}
		})
	}
}
