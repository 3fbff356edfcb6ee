package integration

import (
	"testing"
	"time"
)

// MaxHeldBytes on Artemis with large messages (Artemis streams those of
// more than 100 KiB as large messages): 100 of 1 MiB and 10 of 10 MiB, a
// consumer process with the default credit (256) and a slow handler, once
// with a 16 MiB budget and once without. With the budget the bytes held stay
// within the budget plus one 10 MiB message, the RSS grows by a small
// multiple of that instead of by the whole queue, nothing stalls and the
// order holds.
func TestArtemisByteBudgetBoundsMemory(t *testing.T) {
	url := artemisURL(t)
	const mib = 1 << 20
	const budget = 16 * mib
	var msgs []msgSpec
	for i := range 110 {
		size := mib
		if i%11 == 10 {
			size = 10 * mib
		}
		msgs = append(msgs, msgSpec{seq: i, body: make([]byte, size)})
	}
	type result struct {
		rssGrowthKiB, maxBytesHeld int64
		maxHeld                    int
		took                       time.Duration
	}
	runOnce := func(t *testing.T, maxHeldBytes int64) result {
		q := queueName(t)
		// FixedCredit: the whole credit is held unless the byte budget
		// stops it (the adaptive credit would hold 1 or 2 of these slow
		// deliveries anyway, and leave the budget nothing to do).
		ch := startChild(t, childConfig{URL: url, Queue: q, Credit: 256, FixedCredit: true, Workers: 1, Delay: 100 * time.Millisecond,
			Report: 50 * time.Millisecond, MaxHeldBytes: maxHeldBytes, CheckOrder: true})
		waitFor(t, 30*time.Second, "the consumer's first stats", func() bool { return ch.nstats() >= 3 })
		base := ch.last().RSSKiB
		start := time.Now()
		publishFast(t, dial(t, url), q, true, msgs)
		waitFor(t, 3*time.Minute, "all 111 handled", func() bool { return ch.last().Accepted >= 111 })
		took := time.Since(start)
		ch.sigterm(t, 30*time.Second)
		var r result
		for _, s := range ch.statsSince(0) {
			r.rssGrowthKiB = max(r.rssGrowthKiB, s.RSSKiB-base)
			r.maxBytesHeld = max(r.maxBytesHeld, s.MaxBytesHeld)
			r.maxHeld = max(r.maxHeld, s.MaxHeld)
		}
		if last := ch.last(); last.OrderViolations != 0 || last.Accepted != 111 {
			t.Fatalf("final stats %+v", last)
		}
		r.took = took
		return r
	}
	var with, without result
	t.Run("budget", func(t *testing.T) { with = runOnce(t, budget) })
	t.Run("none", func(t *testing.T) { without = runOnce(t, 0) })
	t.Logf("with MaxHeldBytes(16 MiB): held at most %d deliveries, %.1f MiB; RSS +%.1f MiB; %v",
		with.maxHeld, float64(with.maxBytesHeld)/mib, float64(with.rssGrowthKiB)/1024, with.took.Round(time.Millisecond))
	t.Logf("without: held at most %d deliveries, %.1f MiB; RSS +%.1f MiB; %v",
		without.maxHeld, float64(without.maxBytesHeld)/mib, float64(without.rssGrowthKiB)/1024, without.took.Round(time.Millisecond))
	// Past the budget only by large messages granted while only 1 MiB
	// ones had come lately: at most the budget's worth of them.
	if with.maxBytesHeld > budget+budget/mib*10*mib {
		t.Errorf("with the budget, %d bytes held", with.maxBytesHeld)
	}
	if without.maxBytesHeld < 2*budget {
		t.Errorf("without a budget only %d bytes held: the test does not load the consumer", without.maxBytesHeld)
	}
	if with.rssGrowthKiB*2 > without.rssGrowthKiB {
		t.Errorf("RSS grew %d KiB with the budget, %d KiB without: not bounded", with.rssGrowthKiB, without.rssGrowthKiB)
	}
}
