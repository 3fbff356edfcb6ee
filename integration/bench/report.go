package main

import (
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/amqpsub/amqpsub/lanes"
)

// series is every run of one scenario on one broker and payload.
type series struct {
	sc   scenario
	runs []result
	// ratios[i] is run i's rate over the loop's rate in the same run.
	ratios []float64
}

func median(xs []float64) float64 {
	if len(xs) == 0 {
		return 0
	}
	s := slices.Clone(xs)
	slices.Sort(s)
	m := len(s) / 2
	if len(s)%2 == 1 {
		return s[m]
	}
	return (s[m-1] + s[m]) / 2
}

func (s *series) rates() []float64 {
	out := make([]float64, len(s.runs))
	for i, r := range s.runs {
		out[i] = r.rate()
	}
	return out
}

// perSec returns the median of f(run) over the runs.
func (s *series) med(f func(r result) float64) float64 {
	xs := make([]float64, len(s.runs))
	for i, r := range s.runs {
		xs[i] = f(r)
	}
	return median(xs)
}

// num formats x with thousands separators.
func num(x float64) string {
	s := fmt.Sprintf("%.0f", x)
	neg := strings.HasPrefix(s, "-")
	s = strings.TrimPrefix(s, "-")
	var b strings.Builder
	for i, c := range s {
		if i > 0 && (len(s)-i)%3 == 0 {
			b.WriteByte(',')
		}
		b.WriteRune(c)
	}
	if neg {
		return "-" + b.String()
	}
	return b.String()
}

// table renders the series of one broker and payload as Markdown. loop is
// the reference series, nil if it was not run.
func table(all []*series, loop *series, credit int) string {
	var b strings.Builder
	b.WriteString("| | scenario | msgs | msgs/s median (min–max) | × (a), same run | client CPU cores · µs/msg | broker CPU cores · µs/msg | max held | target |\n")
	b.WriteString("|---|---|--:|--:|--:|--:|--:|--:|---|\n")
	loopRate := 0.0
	if loop != nil && len(loop.runs) > 0 {
		loopRate = median(loop.rates())
	}
	refs := false
	for _, s := range all {
		if len(s.runs) == 0 {
			continue
		}
		refs = refs || s.sc.ref != ""
		rates := s.rates()
		lo, hi := slices.Min(rates), slices.Max(rates)
		ratio := "–"
		if len(s.ratios) > 0 {
			ratio = fmt.Sprintf("%.2f", median(s.ratios))
		}
		client := fmt.Sprintf("%.2f · %.1f",
			s.med(func(r result) float64 { return r.client.Seconds() / r.elapsed.Seconds() }),
			s.med(func(r result) float64 { return float64(r.client.Microseconds()) / float64(r.msgs) }))
		broker := "n/a"
		if s.runs[0].brokerOK {
			broker = fmt.Sprintf("%.2f · %.1f",
				s.med(func(r result) float64 { return r.broker.Seconds() / r.elapsed.Seconds() }),
				s.med(func(r result) float64 { return float64(r.broker.Microseconds()) / float64(r.msgs) }))
		}
		held := "–"
		if !s.sc.loop && s.sc.ref == "" {
			m := 0
			for _, r := range s.runs {
				m = max(m, r.maxHeld)
			}
			held = fmt.Sprintf("%d / %d", m, credit)
		}
		fmt.Fprintf(&b, "| (%s) | %s | %s | %s (%s–%s) | %s | %s | %s | %s | %s |\n",
			s.sc.group, s.sc.title, num(float64(s.runs[0].msgs)), num(median(rates)), num(lo), num(hi),
			ratio, client, broker, held, target(s, median(rates), loopRate))
	}
	if refs {
		b.WriteString("\n(r): another client, run as a child process. Its clock runs from when its connection is open " +
			"(before its session and link, as (a)'s) to its last acceptance, by its own monotonic clock: " +
			"JVM or interpreter start-up is left out; client CPU is the child's (/proc/<pid>/stat) over that span.\n")
	}
	return b.String()
}

// target says where the scenario stands against issue 5's targets.
func target(s *series, rate, loopRate float64) string {
	switch {
	case s.sc.loop:
		return "reference"
	case s.sc.ref != "":
		return "other client"
	case s.sc.slow:
		bound := float64(s.sc.lanes) * 1000
		what := fmt.Sprintf("%d·1000", s.sc.lanes)
		if loopRate > 0 && loopRate < bound {
			bound, what = loopRate, "(a)"
		}
		pct := 100 * rate / bound
		return fmt.Sprintf("%.0f%% of %s = %s (≥ 95%%): %s", pct, what, num(bound), yesNo(pct >= 95))
	case len(s.ratios) > 0:
		return fmt.Sprintf("≥ 1.25× (a): %s", yesNo(median(s.ratios) >= 1.25))
	}
	return "–"
}

func yesNo(ok bool) string {
	if ok {
		return "met"
	}
	return "not met"
}

// keyNotes says, for each 1 ms scenario chosen, how far the hash spread of
// the groups over the lanes lets it go: the lane with the most groups gets
// the most messages, and at one sleep per message it bounds the rate.
func keyNotes(chosen []scenario, groups int, sleep time.Duration) string {
	var b strings.Builder
	for _, sc := range chosen {
		if !sc.slow {
			continue
		}
		n := sc.lanes
		if groups == 0 {
			fmt.Fprintf(&b, "- WorkersByKey(%d), no group-id: deliveries rotate over the lanes: at most %s msgs/s\n",
				n, num(float64(n)/sleep.Seconds()))
			continue
		}
		per := make([]int, n)
		for g := range groups {
			per[lanes.LaneOf(groupName(g), n)]++
		}
		busiest, idle := slices.Max(per), 0
		for _, c := range per {
			if c == 0 {
				idle++
			}
		}
		fmt.Fprintf(&b, "- WorkersByKey(%d), %d groups: the busiest lane has %d groups (%.0f%% of the messages), %d lanes have none: at most %s msgs/s\n",
			n, groups, busiest, 100*float64(busiest)/float64(groups), idle,
			num(float64(groups)/float64(busiest)/sleep.Seconds()))
	}
	return b.String()
}

func groupName(i int) string { return fmt.Sprintf("g%03d", i) }
