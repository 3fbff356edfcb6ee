// Package loglimit writes the log lines that can fire once per delivery
// (a poison message, a lost lock, a handler's panic) without letting a bad
// stream flood the log: each line is written at its level the first time
// and then at most once per interval; the occurrences between are written
// at debug, and the next line at its level says how many there were (field
// suppressed); [Logger.Flush], at the end of a run, says it of those no
// later line did. The counters in the subscriber's Stats stay complete.
//
// A line is known by its message, which is constant text, so the state
// kept is one entry per call site.
package loglimit

import (
	"slices"
	"strings"
	"sync"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
)

// Every is the interval the library uses: a line is written at its level at
// most once a minute.
const Every = time.Minute

// Logger writes limited lines to a zap logger. The zero value is not
// usable; make one with New. It is safe for concurrent use.
type Logger struct {
	log   *zap.Logger
	every time.Duration

	mu    sync.Mutex
	lines map[string]*line
}

type line struct {
	level      zapcore.Level
	last       time.Time // when it was last written at its level; zero: never
	suppressed int       // written at debug since
}

// New returns a Logger that writes to log (nil: nowhere), each line at its
// level at most once per every.
func New(log *zap.Logger, every time.Duration) *Logger {
	if log == nil {
		log = zap.NewNop()
	}
	return &Logger{log: log, every: every, lines: map[string]*line{}}
}

// Warn writes msg at warn level, or at debug when it was written at warn
// less than the interval ago.
func (l *Logger) Warn(msg string, fields ...zap.Field) { l.write(zapcore.WarnLevel, msg, fields) }

// Error writes msg at error level, or at debug when it was written at error
// less than the interval ago.
func (l *Logger) Error(msg string, fields ...zap.Field) { l.write(zapcore.ErrorLevel, msg, fields) }

func (l *Logger) write(level zapcore.Level, msg string, fields []zap.Field) {
	now := time.Now()
	l.mu.Lock()
	ln := l.lines[msg]
	if ln == nil {
		ln = &line{level: level}
		l.lines[msg] = ln
	}
	up := ln.last.IsZero() || now.Sub(ln.last) >= l.every
	suppressed := ln.suppressed
	if up {
		ln.last, ln.suppressed = now, 0
	} else {
		ln.suppressed++
		level = zapcore.DebugLevel
	}
	l.mu.Unlock()
	ce := l.log.Check(level, msg)
	if ce == nil {
		return
	}
	if up {
		// Not append(fields, …): fields may be the caller's slice.
		fields = append(fields[:len(fields):len(fields)], zap.Int("suppressed", suppressed))
	}
	ce.Write(fields...)
}

// Flush writes each line with occurrences written at debug since it was
// last written at its level once more at its level, with suppressed their
// count and no other field, so that the count is not lost when no later
// line would carry it (a stop). Lines written since go on as before.
func (l *Logger) Flush() {
	type pending struct {
		msg   string
		level zapcore.Level
		n     int
	}
	now := time.Now()
	var out []pending
	l.mu.Lock()
	for msg, ln := range l.lines {
		if ln.suppressed > 0 {
			out = append(out, pending{msg, ln.level, ln.suppressed})
			ln.last, ln.suppressed = now, 0
		}
	}
	l.mu.Unlock()
	slices.SortFunc(out, func(a, b pending) int { return strings.Compare(a.msg, b.msg) })
	for _, p := range out {
		if ce := l.log.Check(p.level, p.msg); ce != nil {
			ce.Write(zap.Int("suppressed", p.n))
		}
	}
}
