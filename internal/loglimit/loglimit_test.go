package loglimit_test

import (
	"testing"
	"testing/synctest"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/amqpsub/amqpsub/internal/loglimit"
)

// A line is written at its level the first time and once per interval
// after, carrying the count written at debug meanwhile; lines are limited
// each on its own.
func TestLimited(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		core, logs := observer.New(zapcore.DebugLevel)
		l := loglimit.New(zap.New(core), time.Minute)
		for range 100 {
			l.Warn("a", zap.Int("n", 1))
			l.Error("b")
		}
		time.Sleep(time.Minute)
		l.Warn("a", zap.Int("n", 2))
		var atLevel []observer.LoggedEntry
		for _, e := range logs.All() {
			if e.Level > zapcore.DebugLevel {
				atLevel = append(atLevel, e)
			}
		}
		if logs.Len() != 201 || len(atLevel) != 3 {
			t.Fatalf("%d lines, %d above debug; want 201 and 3", logs.Len(), len(atLevel))
		}
		for i, want := range []struct {
			level      zapcore.Level
			msg        string
			suppressed int64
		}{{zapcore.WarnLevel, "a", 0}, {zapcore.ErrorLevel, "b", 0}, {zapcore.WarnLevel, "a", 99}} {
			e := atLevel[i]
			if e.Level != want.level || e.Message != want.msg || e.ContextMap()["suppressed"] != want.suppressed {
				t.Errorf("line %d: %v %q %v, want %v %q suppressed=%d", i, e.Level, e.Message, e.ContextMap(), want.level, want.msg, want.suppressed)
			}
		}
		if _, ok := logs.All()[2].ContextMap()["suppressed"]; ok {
			t.Errorf("a debug line carries suppressed: %v", logs.All()[2].ContextMap())
		}
	})
}

// A logger at info level costs the suppressed occurrences nothing but the
// count, and a nil logger is no logger.
func TestLimitedQuiet(t *testing.T) {
	core, logs := observer.New(zapcore.InfoLevel)
	l := loglimit.New(zap.New(core), time.Hour)
	for range 10 {
		l.Warn("a")
	}
	if logs.Len() != 1 {
		t.Fatalf("%d lines, want 1", logs.Len())
	}
	loglimit.New(nil, time.Hour).Error("nowhere")
}

// Flush writes what no later line has counted: each line written at debug
// since its last at its level is written once more at its level, with the
// count, and only once.
func TestFlush(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		core, logs := observer.New(zapcore.InfoLevel)
		l := loglimit.New(zap.New(core), time.Minute)
		for range 427 {
			l.Warn("lost", zap.Int("n", 1))
		}
		l.Error("once")
		l.Flush()
		l.Flush()
		got := logs.All()
		if len(got) != 3 {
			t.Fatalf("%d lines, want 3 (lost, once, lost flushed): %v", len(got), got)
		}
		if e := got[2]; e.Level != zapcore.WarnLevel || e.Message != "lost" || e.ContextMap()["suppressed"] != int64(426) || len(e.Context) != 1 {
			t.Fatalf("flushed %v %q %v, want warn \"lost\" suppressed=426 alone", e.Level, e.Message, e.ContextMap())
		}
	})
}
