package main

import (
	"fmt"
	"os"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// clockTick is the unit of utime and stime in /proc/<pid>/stat (USER_HZ,
// 100 on every Linux architecture Go supports).
const clockTick = 10 * time.Millisecond

// cpuSample is the CPU time used so far by this process and by the broker.
type cpuSample struct {
	self     time.Duration
	broker   time.Duration
	brokerOK bool
}

// sampleCPU reads this process's user+sys time (getrusage) and, if pid > 0,
// the broker's (/proc/<pid>/stat utime+stime).
func sampleCPU(pid int) cpuSample {
	var s cpuSample
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err == nil {
		s.self = time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
	}
	if pid > 0 {
		if u, k, err := procCPU(pid); err == nil {
			s.broker, s.brokerOK = u+k, true
		}
	}
	return s
}

// procCPU returns the user and system time of process pid.
func procCPU(pid int) (user, sys time.Duration, err error) {
	raw, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, 0, fmt.Errorf("broker CPU: %w", err)
	}
	// The command name, in parentheses, may hold spaces: fields start after
	// its closing parenthesis, with field 3 (state) first.
	s := string(raw)
	i := strings.LastIndexByte(s, ')')
	if i < 0 {
		return 0, 0, fmt.Errorf("broker CPU: unexpected /proc/%d/stat", pid)
	}
	f := strings.Fields(s[i+1:])
	if len(f) < 13 {
		return 0, 0, fmt.Errorf("broker CPU: short /proc/%d/stat", pid)
	}
	ut, err1 := strconv.ParseInt(f[11], 10, 64) // field 14, utime
	st, err2 := strconv.ParseInt(f[12], 10, 64) // field 15, stime
	if err1 != nil || err2 != nil {
		return 0, 0, fmt.Errorf("broker CPU: /proc/%d/stat: utime %q stime %q", pid, f[11], f[12])
	}
	return time.Duration(ut) * clockTick, time.Duration(st) * clockTick, nil
}

// loadAvg returns the 1, 5 and 15 minute load averages as printed by the
// kernel.
func loadAvg() string {
	raw, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return "unknown"
	}
	f := strings.Fields(string(raw))
	if len(f) < 3 {
		return "unknown"
	}
	return strings.Join(f[:3], " ")
}

// cpuModel returns the first model name in /proc/cpuinfo.
func cpuModel() string {
	raw, err := os.ReadFile("/proc/cpuinfo")
	if err != nil {
		return "unknown"
	}
	for line := range strings.SplitSeq(string(raw), "\n") {
		if k, v, ok := strings.Cut(line, ":"); ok && strings.TrimSpace(k) == "model name" {
			return strings.TrimSpace(v)
		}
	}
	return "unknown"
}
