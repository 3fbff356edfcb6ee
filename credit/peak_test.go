package credit

import "testing"

func TestMaxHeldKeepsThePeak(t *testing.T) {
	a := New(32, Continuous)
	a.Grant()
	for range 32 {
		a.Received()
	}
	a.Settled(4)
	a.Grant()
	a.Received() // held 29: the peak stays 32
	if s := a.Snapshot(); s.MaxHeld != 32 || s.Held != 29 {
		t.Fatalf("snapshot %+v, want MaxHeld 32, Held 29", s)
	}
}

func TestWindowedWaitsForTheLastCredit(t *testing.T) {
	a := New(8, Windowed)
	if g := a.Grant(); g != 8 {
		t.Fatalf("grant %d", g)
	}
	for range 7 {
		a.Received()
	}
	a.Settled(7)
	if g := a.Grant(); g != 0 {
		t.Fatalf("windowed grant with 1 credit outstanding = %d, want 0", g)
	}
	a.Received()
	a.Settled(1)
	if g := a.Grant(); g != 8 {
		t.Fatalf("grant once the window arrived = %d, want 8", g)
	}
}
