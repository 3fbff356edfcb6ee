package main

import (
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

// Every broker -brokers takes is known, and each RabbitMQ 4 one uses the
// v2 address of a queue of its kind, declared beforehand.
func TestDescribeBrokers(t *testing.T) {
	for _, tc := range []struct {
		name, send, receive, kind, profile string
		windowed, detach                   bool
	}{
		{"artemis", "q", "q", "", "artemis", false, true},
		{"rabbitmq", "/queue/q", "/amq/queue/q", "", "rabbitmq3", true, false},
		{"rabbitmq4-classic", "/queues/q", "/queues/q", "classic", "rabbitmq4", false, true},
		{"rabbitmq4-quorum", "/queues/q", "/queues/q", "quorum", "rabbitmq4", false, true},
	} {
		b, err := describe(tc.name, "amqp://127.0.0.1:1")
		if err != nil {
			t.Fatalf("describe(%q): %v", tc.name, err)
		}
		if got := b.sendAddress("q"); got != tc.send {
			t.Errorf("%s: send address %q, want %q", tc.name, got, tc.send)
		}
		if got := b.receiveAddress("q"); got != tc.receive {
			t.Errorf("%s: receive address %q, want %q", tc.name, got, tc.receive)
		}
		if b.queueKind != tc.kind || b.windowed != tc.windowed || b.detach != tc.detach {
			t.Errorf("%s: kind %q windowed %v detach %v, want %q %v %v",
				tc.name, b.queueKind, b.windowed, b.detach, tc.kind, tc.windowed, tc.detach)
		}
		if got := b.profile.String(); got != tc.profile {
			t.Errorf("%s: profile %q, want %q", tc.name, got, tc.profile)
		}
	}
	for _, name := range brokerNames {
		if _, err := describe(name, ""); err != nil {
			t.Errorf("brokerNames has %q, which describe does not know: %v", name, err)
		}
	}
	if _, err := describe("rabbitmq4", ""); err == nil {
		t.Error("describe(rabbitmq4) succeeded; the queue kind must be named")
	}
}

// The RabbitMQ 4 PID file is the one rabbitmq4.sh has the VM write, under
// $AMQPSUB_CACHE/rabbitmq4/state; a PID that is not a beam is refused.
func TestBeamPID(t *testing.T) {
	cache := t.TempDir()
	t.Setenv("AMQPSUB_CACHE", cache)
	file, err := beamPIDFile("rabbitmq4", "state")
	if err != nil {
		t.Fatal(err)
	}
	if want := filepath.Join(cache, "rabbitmq4", "state", "rabbitmq.pid"); file != want {
		t.Errorf("PID file %s, want %s", file, want)
	}
	if _, err := beamPID("RabbitMQ 4", "rabbitmq4", "state"); err == nil || !strings.Contains(err.Error(), "AMQPSUB_CACHE") {
		t.Errorf("missing PID file: error %v, want one naming AMQPSUB_CACHE", err)
	}
	if err := os.MkdirAll(filepath.Dir(file), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(file, []byte(strconv.Itoa(os.Getpid())+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := beamPID("RabbitMQ 4", "rabbitmq4", "state"); err == nil || !strings.Contains(err.Error(), "not a beam process") {
		t.Errorf("PID of the test: error %v, want \"not a beam process\"", err)
	}
}

// declareQueue and deleteQueue run rabbitmq4.sh declare Q KIND and delete
// Q on RabbitMQ 4, rabbitmq.sh delete Q on RabbitMQ 3.10, nothing on
// Artemis.
func TestQueueScripts(t *testing.T) {
	dir := t.TempDir()
	calls := filepath.Join(dir, "calls")
	fake := func(name string) string {
		path := filepath.Join(dir, name)
		body := "#!/bin/sh\necho \"" + name + " $*\" >>" + calls + "\n"
		if err := os.WriteFile(path, []byte(body), 0o755); err != nil {
			t.Fatal(err)
		}
		return path
	}
	t.Setenv("AMQPSUB_RABBITMQ4_CTL", fake("rabbitmq4.sh"))
	t.Setenv("AMQPSUB_RABBITMQ_CTL", fake("rabbitmq.sh"))
	for _, name := range []string{"artemis", "rabbitmq", "rabbitmq4-classic", "rabbitmq4-quorum"} {
		b, err := describe(name, "")
		if err != nil {
			t.Fatal(err)
		}
		if err := declareQueue(b, "q."+name); err != nil {
			t.Errorf("declareQueue on %s: %v", name, err)
		}
		if err := deleteQueue(b, "q."+name); err != nil {
			t.Errorf("deleteQueue on %s: %v", name, err)
		}
	}
	raw, err := os.ReadFile(calls)
	if err != nil {
		t.Fatal(err)
	}
	want := "rabbitmq.sh delete q.rabbitmq\n" +
		"rabbitmq4.sh declare q.rabbitmq4-classic classic\n" +
		"rabbitmq4.sh delete q.rabbitmq4-classic\n" +
		"rabbitmq4.sh declare q.rabbitmq4-quorum quorum\n" +
		"rabbitmq4.sh delete q.rabbitmq4-quorum\n"
	if string(raw) != want {
		t.Errorf("script calls:\n%s\nwant:\n%s", raw, want)
	}

	t.Setenv("AMQPSUB_RABBITMQ4_CTL", filepath.Join(dir, "missing.sh"))
	b, _ := describe("rabbitmq4-quorum", "")
	if err := declareQueue(b, "q"); err == nil || !strings.Contains(err.Error(), "AMQPSUB_RABBITMQ4_CTL") {
		t.Errorf("declareQueue without the script: error %v, want one naming AMQPSUB_RABBITMQ4_CTL", err)
	}
}
