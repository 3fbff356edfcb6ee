package credit

import "testing"

func TestGrantKeepsHeldAndOutstandingWithinLimit(t *testing.T) {
	a := New(32, Continuous)
	if g := a.Grant(); g != 32 {
		t.Fatalf("first grant = %d, want 32", g)
	}
	if g := a.Grant(); g != 0 {
		t.Fatalf("second grant = %d, want 0 while all credit is outstanding", g)
	}
	for range 32 {
		if a.Received() {
			t.Fatal("overshoot reported within credit")
		}
	}
	if g := a.Grant(); g != 0 {
		t.Fatalf("grant with 32 held = %d, want 0", g)
	}
	a.Settled(3)
	if g := a.Grant(); g != 0 {
		t.Fatalf("grant below chunk = %d, want 0", g)
	}
	a.Settled(1)
	if g := a.Grant(); g != 4 {
		t.Fatalf("grant at chunk = %d, want 4", g)
	}
	s := a.Snapshot()
	if s.Held+int(s.Outstanding) != 32 {
		t.Fatalf("held %d + outstanding %d != limit", s.Held, s.Outstanding)
	}
	if s.MaxHeld != 32 {
		t.Fatalf("MaxHeld = %d", s.MaxHeld)
	}
}

func TestDefaultChunk(t *testing.T) {
	for _, tc := range []struct{ limit, chunk int64 }{{1, 1}, {7, 1}, {8, 1}, {256, 32}} {
		if got := New(int(tc.limit), Continuous).chunk; got != tc.chunk {
			t.Errorf("limit %d: chunk %d, want %d", tc.limit, got, tc.chunk)
		}
	}
}

// A broker that sends past its credit must neither stall the account nor
// make it grant without bound.
func TestOvershootSwitchesToWindowedAndWinsItBack(t *testing.T) {
	a := New(8, Continuous)
	if g := a.Grant(); g != 8 {
		t.Fatalf("grant %d", g)
	}
	firsts := 0
	for range 11 { // 3 past the credit
		if a.Received() {
			firsts++
		}
	}
	if firsts != 1 {
		t.Fatalf("first-overshoot reported %d times, want once", firsts)
	}
	s := a.Snapshot()
	if s.Mode != Windowed || s.Overshoot != 3 || s.Outstanding != -3 || s.Held != 11 {
		t.Fatalf("snapshot after overshoot: %+v", s)
	}
	if g := a.Grant(); g != 0 {
		t.Fatalf("grant while held > limit = %d", g)
	}
	a.Settled(11)
	// limit - held - outstanding = 8 - 0 + 3: the frame go-amqp sends is
	// add + (granted - arrived) = 11 - 3 = 8, never a wrapped value.
	if g := a.Grant(); g != 11 {
		t.Fatalf("grant after settling = %d, want 11", g)
	}
	for range 5 {
		a.Received()
	}
	a.Settled(5)
	if g := a.Grant(); g != 0 {
		t.Fatalf("windowed grant with credit outstanding = %d, want 0", g)
	}
	for range 3 {
		a.Received()
	}
	a.Settled(3)
	if g := a.Grant(); g != 8 {
		t.Fatalf("windowed grant once the window arrived = %d, want 8", g)
	}
}

func TestAttachStartsCleanButKeepsHeld(t *testing.T) {
	a := New(4, Continuous)
	a.Grant()
	a.Received()
	a.Received()
	a.Attach()
	// Two deliveries of the lost link are still in the process.
	if g := a.Grant(); g != 2 {
		t.Fatalf("grant on new link = %d, want 2", g)
	}
	a.Settled(2)
	if g := a.Grant(); g != 2 {
		t.Fatalf("grant after old deliveries settled = %d, want 2", g)
	}
}

func TestSettledMoreThanHeldPanics(t *testing.T) {
	defer func() {
		if recover() == nil {
			t.Fatal("no panic")
		}
	}()
	New(1, Continuous).Settled(1)
}

func FuzzAccountBound(f *testing.F) {
	f.Add(uint8(16), []byte{0, 0, 1, 2, 0, 1, 1, 2})
	f.Fuzz(func(t *testing.T, limit uint8, ops []byte) {
		l := int(limit%64) + 1
		a := New(l, Continuous)
		var granted, arrived int64
		for _, op := range ops {
			switch op % 3 {
			case 0:
				granted += int64(a.Grant())
			case 1:
				// A well-behaved broker sends only within its credit.
				if arrived < granted {
					arrived++
					if a.Received() {
						t.Fatal("overshoot reported within credit")
					}
				}
			case 2:
				if a.Held() > 0 {
					a.Settled(1)
				}
			}
			if held, out := int64(a.Held()), granted-arrived; held+out > int64(l) {
				t.Fatalf("held %d + outstanding %d > limit %d", held, out, l)
			}
		}
	})
}

// With nothing held, the last credit below a chunk goes back too: no later
// settlement would send it.
func TestGrantTopsUpWhenNothingIsHeld(t *testing.T) {
	a := New(32, Continuous) // chunk 4
	a.Grant()
	for range 32 {
		a.Received()
	}
	a.Settled(30)
	if g := a.Grant(); g != 30 {
		t.Fatalf("grant = %d, want 30", g)
	}
	a.Settled(2) // nothing held; 2 missing, below the chunk of 4
	if g := a.Grant(); g != 2 {
		t.Fatalf("grant with nothing held = %d, want 2", g)
	}
	if g := a.Grant(); g != 0 {
		t.Fatalf("grant at the limit = %d", g)
	}
}

// Under a byte budget and messages of one size, the deliveries held and
// outstanding never pass what the budget holds (and one always flows, even
// when a single message is larger than the budget); nothing stalls.
func FuzzByteBudget(f *testing.F) {
	f.Add(uint8(64), uint16(1<<10), uint32(10<<10), []byte{0, 1, 1, 2, 0, 1, 2, 2})
	f.Add(uint8(8), uint16(5000), uint32(1000), []byte{0, 1, 2, 0, 1, 2})
	f.Fuzz(func(t *testing.T, limit uint8, size uint16, budget uint32, ops []byte) {
		l, s, b := int(limit%64)+1, int64(size)+1, int64(budget)+1
		a := New(l, Continuous)
		a.SetByteBudget(b)
		var granted, arrived int64
		bound := max(1, min(int64(l), b/s)) // deliveries the budget holds
		step := func(op byte) {
			switch op % 3 {
			case 0:
				granted += int64(a.Grant())
			case 1:
				if arrived < granted {
					arrived++
					a.Received()
					a.ReceivedBytes(s)
				}
			case 2:
				if a.Held() > 0 {
					a.Settled(1)
					a.SettledBytes(s)
				}
			}
			// The first grant, before any size is known, is one.
			if held, out := int64(a.Held()), granted-arrived; held+out > bound {
				t.Fatalf("held %d + outstanding %d > %d (limit %d, budget %d B, size %d B)", held, out, bound, l, b, s)
			}
		}
		for _, op := range ops {
			step(op)
		}
		// Settle everything, then a grant must come: no stall.
		for a.Held() > 0 {
			step(2)
		}
		for arrived < granted {
			step(1)
			step(2)
		}
		if g := a.Grant(); g == 0 {
			t.Fatalf("nothing held or outstanding, and no grant (limit %d, budget %d B, size %d B)", l, b, s)
		}
	})
}

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
