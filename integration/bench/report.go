package main

import (
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/amqpsub/amqpsub/internal/lanes"
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

// target says where the scenario stands against the targets: the no-op
// shapes against 1.25 × (a); the 1 ms shapes against 90 % of the lowest
// of n/c (c the measured sleep), (a), and what the key spread allows (the
// hottest lane under hash placement, the hottest group under either).
func target(s *series, rate, loopRate float64) string {
	switch {
	case s.sc.loop:
		return "reference"
	case s.sc.ref != "":
		return "other client"
	case s.sc.slow:
		bound, what := s.sc.bound, s.sc.boundWhy
		if bound == 0 {
			bound, what = float64(s.sc.lanes)*1000, fmt.Sprintf("%d·1000", s.sc.lanes)
		}
		if loopRate > 0 && loopRate < bound {
			bound, what = loopRate, "(a)"
		}
		pct := 100 * rate / bound
		cRun := s.med(func(r result) float64 { return r.busy.Seconds() / float64(max(1, r.msgs)) })
		out := fmt.Sprintf("%.0f%% of %s = %s (≥ 90%%): %s; lanes busy %.0f%%, c in the run %.2f ms",
			pct, what, num(bound), yesNo(pct >= 90),
			100*s.med(func(r result) float64 { return r.laneUse(s.sc.lanes) }), cRun*1000)
		if sleep := s.sc.sleep.Seconds(); cRun > 0 && sleep > 0 && what != "(a)" {
			// The same bound with the sleep as long as it was in the run.
			runBound := bound * sleep / cRun
			out += fmt.Sprintf(" (%.0f%% of %s with it)", 100*rate/runBound, num(runBound))
		}
		return out
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

// keyNotes sets, for each 1 ms scenario chosen, how far one sleep per
// message lets it go (bound, boundWhy), and says why. seq is the group-id
// of message i%len(seq) (nil: no group-id). A lane runs one message at a
// time, so n lanes do at most n/sleep; a group's messages run one at a
// time, so the hottest group, with a share h of the messages, caps the
// whole at 1/(h·sleep); under hash placement the hottest lane, with a share
// l, caps it at 1/(l·sleep).
func keyNotes(chosen []scenario, seq []string, sleep time.Duration) string {
	var b strings.Builder
	share := map[string]float64{}
	for _, g := range seq {
		share[g] += 1 / float64(len(seq))
	}
	hottest := 0.0
	for _, v := range share {
		hottest = max(hottest, v)
	}
	per := func(x float64) float64 { return x / sleep.Seconds() }
	for i := range chosen {
		sc := &chosen[i]
		if !sc.slow {
			continue
		}
		n := sc.lanes
		sc.sleep = sleep
		sc.bound, sc.boundWhy = per(float64(n)), fmt.Sprintf("%d/c", n)
		if len(seq) == 0 {
			fmt.Fprintf(&b, "- %s, no group-id: deliveries go to any lane: at most %s msgs/s\n", sc.title, num(sc.bound))
			continue
		}
		if g := per(1 / hottest); g < sc.bound {
			sc.bound, sc.boundWhy = g, "hottest group"
		}
		if sc.balanced {
			fmt.Fprintf(&b, "- %s, %d groups, the hottest with %.1f%% of the messages: at most %s msgs/s (%s)\n",
				sc.title, len(share), 100*hottest, num(sc.bound), sc.boundWhy)
			continue
		}
		lane := make([]float64, n)
		groupsOn := make([]int, n)
		for g, v := range share {
			l := lanes.LaneOf(g, n)
			lane[l] += v
			groupsOn[l]++
		}
		busiest, idle := slices.Max(lane), 0
		for _, c := range groupsOn {
			if c == 0 {
				idle++
			}
		}
		if l := per(1 / busiest); l < sc.bound {
			sc.bound, sc.boundWhy = l, "hottest lane"
		}
		fmt.Fprintf(&b, "- %s, %d groups: the busiest lane has %.0f%% of the messages, %d lanes have no group: at most %s msgs/s (%s)\n",
			sc.title, len(share), 100*busiest, idle, num(sc.bound), sc.boundWhy)
	}
	return b.String()
}

func groupName(i int) string { return fmt.Sprintf("g%03d", i) }
