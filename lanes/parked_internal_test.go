package lanes

import "testing"

// The pool's parked count: items of a key a lane holds wait for that lane
// and are parked; once the lane lets the key go, they are ready for any
// lane and no longer parked; a stop parks nothing.
func TestPoolParkedCount(t *testing.T) {
	g := NewGauge(2)
	p := newPool(func(s string) string { return s[:1] }, 2, g)
	a, b := newPoolFeed(p), newPoolFeed(p)
	for _, it := range []string{"x1", "x2", "x3", "y1"} {
		p.push(it)
	}
	if n := g.Parked(1); n != 0 {
		t.Fatalf("parked %d before any lane took a key, want 0", n)
	}
	if it, st := a.poll(); st != got || it != "x1" {
		t.Fatalf("lane a took %q, %v", it, st)
	}
	if n := g.Parked(1); n != 2 {
		t.Fatalf("parked %d with x held by lane a and x2, x3 waiting, want 2", n)
	}
	p.push("x4")
	if n := g.Parked(1); n != 3 {
		t.Fatalf("parked %d after x4, want 3", n)
	}
	if it, st := b.poll(); st != got || it != "y1" {
		t.Fatalf("lane b took %q, %v: x is lane a's", it, st)
	}
	if it, _ := a.poll(); it != "x2" {
		t.Fatalf("lane a took %q, want x2", it)
	}
	if n := g.Parked(1); n != 2 {
		t.Fatalf("parked %d after lane a took x2, want 2", n)
	}
	p.finish("x")
	p.finish("x") // lane a let x go: x3, x4 are ready for any lane
	if n := g.Parked(1); n != 0 {
		t.Fatalf("parked %d once no lane holds x, want 0", n)
	}
	if it, _ := b.poll(); it != "x3" {
		t.Fatalf("lane b took %q, want x3", it)
	}
	if n := g.Parked(1); n != 1 {
		t.Fatalf("parked %d with x4 behind lane b, want 1", n)
	}
	p.stop(func(string) {})
	if n := g.Parked(1); n != 0 {
		t.Fatalf("parked %d after a stop, want 0", n)
	}
}
