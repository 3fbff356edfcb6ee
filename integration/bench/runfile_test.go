package main

import (
	"os"
	"path/filepath"
	"runtime/debug"
	"strings"
	"testing"
	"time"
)

func testRecord() runRecord {
	return runRecord{
		args: []string{"-brokers", "artemis", "-payloads", "p100", "-scenarios", "loop,w1", "-out", "docs/runs"},
		rev:  revision{short: "abc1234", dirty: true},
		machine: machine{goos: "linux", goarch: "amd64", cpus: 2, cpu: "AMD EPYC 9B14",
			goVersion: "go1.26.8", kernel: "Linux 6.18.3"},
		date: time.Date(2026, 12, 7, 13, 5, 0, 0, time.UTC),
		what: "artemis-p100-loop-w1",
		body: "### Artemis, 100 B persistent\n\n| | scenario | msgs |\n|---|---|--:|\n| (a) | go-amqp loop | 100,001 |\n",
	}
}

func TestWriteRunFile(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "runs") // made by the writer
	r := testRecord()
	path, err := writeRunFile(dir, r)
	if err != nil {
		t.Fatal(err)
	}
	if got, want := filepath.Base(path), "2026-12-07-abc1234-artemis-p100-loop-w1.md"; got != want {
		t.Errorf("file name %q, want %q", got, want)
	}
	raw, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	text := string(raw)
	for _, want := range []string{
		"| command | `go run ./integration/bench -brokers artemis -payloads p100 -scenarios loop,w1 -out docs/runs` |",
		"| commit | abc1234 (dirty: ",
		"| date | 2026-12-07 13:05 UTC |",
		"| machine | linux/amd64, 2 CPUs (AMD EPYC 9B14), kernel Linux 6.18.3 |",
		"| Go | go1.26.8 |",
	} {
		if !strings.Contains(text, want) {
			t.Errorf("result file lacks %q:\n%s", want, text)
		}
	}
	if !strings.HasSuffix(text, "\n\n"+r.body) {
		t.Errorf("result file does not end with the report as printed:\n%s", text)
	}

	// A second run of the same day, commit and scenarios keeps the first.
	r.body = "second\n"
	again, err := writeRunFile(dir, r)
	if err != nil {
		t.Fatal(err)
	}
	if got, want := filepath.Base(again), "2026-12-07-abc1234-artemis-p100-loop-w1-2.md"; got != want {
		t.Errorf("second file %q, want %q", got, want)
	}
	if raw2, _ := os.ReadFile(path); string(raw2) != text {
		t.Error("the second run rewrote the first run's file")
	}
}

func TestRunFileCleanTree(t *testing.T) {
	r := testRecord()
	r.rev.dirty = false
	if text := r.markdown(); !strings.Contains(text, "| commit | abc1234 |\n") {
		t.Errorf("clean tree: want the bare commit:\n%s", text)
	}
}

func TestRunSlug(t *testing.T) {
	for _, tc := range []struct {
		o    options
		want string
	}{
		{options{brokers: []string{"artemis"}, payloads: []string{"p100"}, scenarios: []string{"loop", "w1", "key8"}},
			"artemis-p100-loop-w1-key8"},
		{options{brokers: brokerNames, payloads: []string{"p100", "t1k"}, allScenarios: true, scenarios: []string{"loop"}},
			"all-brokers-p100-t1k-all"},
		{options{brokers: []string{"rabbitmq4-classic", "rabbitmq4-quorum"}, payloads: []string{"p100"},
			scenarios: []string{"loop", "w1", "w1nomerge", "w1plain", "w8"}},
			"rabbitmq4-classic-rabbitmq4-quorum-p100-loop-w1-w1nomerge-and-2-more"},
		{options{brokers: []string{"artemis"}, payloads: []string{"p100"}, scenarios: []string{"loop", "bal8"}, zipf: 1.2},
			"artemis-p100-loop-bal8-zipf1.2"},
	} {
		if got := runSlug(&tc.o); got != tc.want {
			t.Errorf("runSlug(%+v) = %q, want %q", tc.o, got, tc.want)
		}
	}
}

func TestCommandLineQuotes(t *testing.T) {
	got := commandLine([]string{"-scenarios", "loop,w1", "-artemis", "amqp://u@h:1/?a=b&c", "it's"})
	want := `go run ./integration/bench -scenarios loop,w1 -artemis 'amqp://u@h:1/?a=b&c' 'it'\''s'`
	if got != want {
		t.Errorf("commandLine = %s, want %s", got, want)
	}
}

func TestRevisionFromBuild(t *testing.T) {
	for _, tc := range []struct {
		info *debug.BuildInfo
		want string
	}{
		{nil, "unknown"},
		{&debug.BuildInfo{}, "unknown"},
		{&debug.BuildInfo{Settings: []debug.BuildSetting{
			{Key: "vcs.revision", Value: "68a25b7c0ffee0000000000000000000000000"},
			{Key: "vcs.modified", Value: "false"}}}, "68a25b7"},
		{&debug.BuildInfo{Settings: []debug.BuildSetting{
			{Key: "vcs.revision", Value: "68a25b7c0ffee0000000000000000000000000"},
			{Key: "vcs.modified", Value: "true"}}}, "68a25b7-dirty"},
	} {
		if got := revisionFromBuild(tc.info).String(); got != tc.want {
			t.Errorf("revisionFromBuild = %q, want %q", got, tc.want)
		}
	}
}
