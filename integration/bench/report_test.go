package main

import (
	"strings"
	"testing"
	"time"
)

func TestMedian(t *testing.T) {
	for _, tc := range []struct {
		in   []float64
		want float64
	}{
		{nil, 0},
		{[]float64{3}, 3},
		{[]float64{5, 1, 3}, 3},
		{[]float64{4, 1, 3, 2}, 2.5},
	} {
		if got := median(tc.in); got != tc.want {
			t.Errorf("median(%v) = %v, want %v", tc.in, got, tc.want)
		}
	}
}

func TestNum(t *testing.T) {
	for in, want := range map[float64]string{0: "0", 999: "999", 1000: "1,000", 1234567.4: "1,234,567", -12345: "-12,345"} {
		if got := num(in); got != want {
			t.Errorf("num(%v) = %q, want %q", in, got, want)
		}
	}
}

func TestTableRatiosAndTargets(t *testing.T) {
	run := func(msgs int, secs float64) result {
		return result{msgs: msgs, elapsed: time.Duration(secs * float64(time.Second)), maxHeld: 200}
	}
	byName := map[string]scenario{}
	for _, sc := range scenarios(100) {
		byName[sc.name] = sc
	}
	loop := &series{sc: byName["loop"], runs: []result{run(10000, 1)}}
	w1 := &series{sc: byName["w1"], runs: []result{run(10000, 0.5)}, ratios: []float64{2}}
	slow4 := &series{sc: byName["slow4"], runs: []result{run(10000, 2.6)}, ratios: []float64{0.38}}
	out := table([]*series{loop, w1, slow4}, loop, 256)
	for _, want := range []string{
		"| (a) | go-amqp loop", "10,000 (10,000–10,000)", "reference",
		"| 20,000 (20,000–20,000) | 2.00 |", "≥ 1.25× (a): met", "200 / 256",
		"96% of 4·1000 = 4,000 (≥ 90%): met",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("table lacks %q:\n%s", want, out)
		}
	}
	if strings.Contains(out, "(r):") {
		t.Errorf("table without reference consumers has their note:\n%s", out)
	}
}

func TestTableReferenceConsumers(t *testing.T) {
	list := scenarios(100)
	var loop, jms *series
	for _, sc := range list {
		switch sc.name {
		case "loop":
			loop = &series{sc: sc, runs: []result{{msgs: 10000, elapsed: time.Second}}}
		case "jms":
			r := result{msgs: 10000, elapsed: 2 * time.Second, client: time.Second, maxHeld: 99}
			jms = &series{sc: sc, runs: []result{r}, ratios: []float64{0.5}}
		}
	}
	if loop == nil || jms == nil {
		t.Fatal("scenarios lacks loop or jms")
	}
	out := table([]*series{loop, jms}, loop, 256)
	for _, want := range []string{
		"| (r) | Qpid JMS 2.7.0", "| 5,000 (5,000–5,000) | 0.50 | 0.50 · 100.0 |", "| – | other client |",
		"(r): another client, run as a child process",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("table lacks %q:\n%s", want, out)
		}
	}
}

func TestKeyNotesBounds(t *testing.T) {
	byName := func(names ...string) []scenario {
		var out []scenario
		for _, sc := range scenarios(100) {
			for _, n := range names {
				if sc.name == n {
					out = append(out, sc)
				}
			}
		}
		return out
	}
	// Uniform: 100 groups; balanced lanes are bound by n/c alone, hashed
	// ones by their busiest lane, never above n/c.
	chosen := byName("slow8", "bal8", "bal64")
	notes := keyNotes(chosen, groupSequence(100, 0), time.Millisecond)
	if got := chosen[1].bound; got != 8000 || chosen[1].boundWhy != "8/c" {
		t.Errorf("bal8 uniform bound = %v (%s), want 8,000 (8/c)\n%s", got, chosen[1].boundWhy, notes)
	}
	if got := chosen[2].bound; got != 64000 {
		t.Errorf("bal64 uniform bound = %v, want 64,000 (no group above 1%%)\n%s", got, notes)
	}
	if got := chosen[0].bound; got > 8000 || got < 1000 || chosen[0].boundWhy != "hottest lane" {
		t.Errorf("slow8 uniform bound = %v (%s), want the hottest lane's, below 8,000\n%s", got, chosen[0].boundWhy, notes)
	}
	// Zipf s = 1.2 over 100 groups: the hottest group has about 28 % of
	// the messages, so no placement passes about 3,600 msgs/s at c = 1 ms.
	chosen = byName("bal8", "bal64")
	seq := groupSequence(100, 1.2)
	notes = keyNotes(chosen, seq, time.Millisecond)
	for _, sc := range chosen {
		if sc.boundWhy != "hottest group" || sc.bound < 3000 || sc.bound > 4500 {
			t.Errorf("%s zipf bound = %v (%s), want the hottest group's, 3,000–4,500\n%s", sc.name, sc.bound, sc.boundWhy, notes)
		}
	}
	if again := groupSequence(100, 1.2); strings.Join(again, ",") != strings.Join(seq, ",") {
		t.Error("groupSequence with a Zipf exponent is not the same from run to run")
	}
}

// A 1 ms scenario whose lanes were always busy but whose sleeps took 25 %
// longer in the run than before it: 80 % of n/c, 100 % of the bound with
// the sleep the run saw.
func TestTargetCountsTheSleepOfTheRun(t *testing.T) {
	var chosen []scenario
	for _, sc := range scenarios(100) {
		if sc.name == "bal8" {
			chosen = append(chosen, sc)
		}
	}
	keyNotes(chosen, groupSequence(100, 0), time.Millisecond)
	r := result{msgs: 8000, elapsed: 1250 * time.Millisecond, busy: 8000 * 1250 * time.Microsecond}
	s := &series{sc: chosen[0], runs: []result{r}}
	got := target(s, r.rate(), 0)
	for _, want := range []string{"80% of 8/c = 8,000 (≥ 90%): not met", "lanes busy 100%", "c in the run 1.25 ms", "(100% of 6,400 with it)"} {
		if !strings.Contains(got, want) {
			t.Errorf("target %q lacks %q", got, want)
		}
	}
}
