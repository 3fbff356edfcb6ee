package pump_test

import (
	"testing"

	"github.com/amqpsub/amqpsub/internal/fake"
	"github.com/amqpsub/amqpsub/pump"
)

// LoseLock reports whether it acted, which decides whether amqpsub reports
// a lost lock (EventLockLost, the warning): true for a buffered or handled
// delivery of the ticket's generation, false once it settles or its entry
// holds the next delivery. (Pinned after an outside review.)
func TestLoseLockReportsWhetherItActed(t *testing.T) {
	src := fake.New(false, fake.Messages(3)...)
	p := pump.New(pump.Config{Credit: 1})
	cancel, errc := start(t, p, attachTo(src))
	defer func() { cancel(); <-errc }()

	a := <-p.Out()
	a.Begin()
	if !p.LoseLock(a) {
		t.Error("LoseLock of a delivery in a handler = false, want true")
	}
	if p.LoseLock(a) {
		t.Error("second LoseLock of the same delivery = true, want false")
	}
	p.Settle(a, pump.Outcome{Kind: pump.Accept})
	b := <-p.Out() // the same entry, the next delivery
	if b.Entry() != a.Entry() {
		t.Fatal("entry not reused")
	}
	if p.LoseLock(a) {
		t.Error("LoseLock of a settled delivery whose entry holds the next = true, want false")
	}
	if !p.LoseLock(b) {
		t.Error("LoseLock of a buffered delivery = false, want true")
	}
	if b.Begin() {
		t.Error("Begin after its lock was lost")
	}
	p.Settle(b, pump.Outcome{Kind: pump.Drop})
	c := <-p.Out()
	c.Begin()
	p.Settle(c, pump.Outcome{Kind: pump.Accept})
	if p.LoseLock(c) {
		t.Error("LoseLock of a settling or settled delivery = true, want false")
	}
}
