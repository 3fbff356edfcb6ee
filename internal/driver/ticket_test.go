package driver_test

import (
	"context"
	"errors"
	"testing"

	"github.com/Azure/go-amqp"

	"github.com/amqpsub/amqpsub/internal/driver"
)

// Every move of a book entry, from each state a ticket can find it in: what
// HandBack and LoseLease report, and where they leave the delivery.
func TestTicketMoves(t *testing.T) {
	type move func(driver.Ticket) driver.State
	handBack := func(tk driver.Ticket) driver.State { return tk.HandBack() }
	loseLease := func(tk driver.Ticket) driver.State { from, _ := tk.LoseLease(); return from }
	for _, c := range []struct {
		name      string
		at        func(driver.Ticket) // brings the delivery to its state
		move      move
		from      driver.State
		to        driver.State
		leaseLost bool
	}{
		{"hand back a buffered delivery", nil, handBack, driver.Buffered, driver.Settling, false},
		{"hand back a handled delivery", begin, handBack, driver.Handling, driver.Settling, false},
		{"hand back a dropped delivery", lose, handBack, driver.Dropped, driver.Reclaiming, false},
		{"hand back twice", handBackFirst, handBack, driver.Settling, driver.Settling, false},
		{"lose a buffered delivery's lease", nil, loseLease, driver.Buffered, driver.Dropped, false},
		{"lose a handled delivery's lease", begin, loseLease, driver.Handling, driver.Handling, true},
		{"lose a lease twice", func(tk driver.Ticket) { begin(tk); lose(tk) }, loseLease, driver.Free, driver.Handling, true},
		{"lose a settling delivery's lease", handBackFirst, loseLease, driver.Settling, driver.Settling, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			d := driver.NewDelivery(driver.NewLinks(false))
			tk := d.Fill(&amqp.Message{}, nil, 0, 1)
			if c.at != nil {
				c.at(tk)
			}
			if from := c.move(tk); from != c.from {
				t.Errorf("from %v, want %v", from, c.from)
			}
			if s := tk.State(); s != c.to {
				t.Errorf("now %v, want %v", s, c.to)
			}
			if d.LeaseLost() != c.leaseLost {
				t.Errorf("LeaseLost = %v, want %v", d.LeaseLost(), c.leaseLost)
			}
		})
	}
}

func begin(tk driver.Ticket)         { tk.Begin() }
func lose(tk driver.Ticket)          { tk.LoseLease() }
func handBackFirst(tk driver.Ticket) { tk.HandBack() }

// A ticket refuses to act on the delivery its entry holds after its own:
// once the entry is cleared and filled again, it reads Free and moves
// nothing.
func TestTicketOfAnEarlierDelivery(t *testing.T) {
	d := driver.NewDelivery(driver.NewLinks(false))
	old := d.Fill(&amqp.Message{}, nil, 0, 1)
	old.HandBack()
	d.Clear()
	next := d.Fill(&amqp.Message{}, nil, 0, 1)
	if !old.Reused() || next.Reused() {
		t.Fatalf("Reused: old %v, next %v; want true, false", old.Reused(), next.Reused())
	}
	if s := old.State(); s != driver.Free {
		t.Errorf("old ticket reads %v, want free", s)
	}
	if old.Begin() {
		t.Error("old ticket began the next delivery")
	}
	if from := old.HandBack(); from != driver.Free {
		t.Errorf("old ticket's HandBack = %v, want free", from)
	}
	if from, _ := old.LoseLease(); from != driver.Free {
		t.Errorf("old ticket's LoseLease = %v, want free", from)
	}
	if old.OnSettled(func(driver.Kind, error) {}) {
		t.Error("old ticket's OnSettled took a function for the next delivery")
	}
	if s := next.State(); s != driver.Buffered || d.LeaseLost() {
		t.Errorf("next delivery %v (lease lost %v), want buffered", s, d.LeaseLost())
	}
}

// A delivery of an earlier link is stale, unless leases outlive links;
// DropStale drops only a buffered one of an earlier link.
func TestStaleAndDropStale(t *testing.T) {
	for _, keep := range []bool{false, true} {
		l := driver.NewLinks(keep)
		first := l.Next()
		d := driver.NewDelivery(l)
		tk := d.Fill(&amqp.Message{}, nil, first, 1)
		if tk.Stale() || d.DropStale(l.Current()) {
			t.Fatalf("keep=%v: a delivery of the current link is stale or dropped", keep)
		}
		l.Next()
		if tk.Stale() != !keep {
			t.Errorf("keep=%v: Stale = %v after its link was lost", keep, tk.Stale())
		}
		if began := tk.Begin(); began != keep {
			t.Errorf("keep=%v: Begin of a delivery of a lost link = %v", keep, began)
		}
		if keep {
			continue // Handling now: DropStale leaves it
		}
		if !d.DropStale(l.Current()) || tk.State() != driver.Dropped {
			t.Errorf("DropStale left a buffered delivery of a lost link %v", tk.State())
		}
	}
}

// OnSettled's function hears the kind and error once, through Notify.
func TestOnSettledHearsOnce(t *testing.T) {
	d := driver.NewDelivery(driver.NewLinks(false))
	tk := d.Fill(&amqp.Message{}, nil, 0, 1)
	var heard []driver.Kind
	if !tk.OnSettled(func(k driver.Kind, err error) { heard = append(heard, k) }) {
		t.Fatal("OnSettled refused a buffered delivery")
	}
	tk.HandBack()
	if tk.OnSettled(func(driver.Kind, error) {}) {
		t.Error("OnSettled took a function for a settling delivery")
	}
	d.Notify(driver.Accept, nil)
	d.Notify(driver.Accept, nil)
	if len(heard) != 1 || heard[0] != driver.Accept {
		t.Errorf("heard %v, want [accept]", heard)
	}
}

// SentOutcome reads what SentAs says went out, and passes any other answer
// through.
func TestSentOutcome(t *testing.T) {
	refused := errors.New("refused")
	for _, c := range []struct {
		name   string
		asked  driver.Kind
		answer error
		kind   driver.Kind
		err    error
	}{
		{"taken as asked", driver.Release, nil, driver.Release, nil},
		{"refused as asked", driver.Release, refused, driver.Release, refused},
		{"taken as another", driver.Release, driver.SentAs(driver.Modify, nil), driver.Modify, nil},
		{"refused as another", driver.Release, driver.SentAs(driver.Modify, refused), driver.Modify, refused},
		{"not an outcome", driver.Accept, driver.SentAs(driver.Drop, nil), driver.Accept, nil},
	} {
		t.Run(c.name, func(t *testing.T) {
			k, err := driver.SentOutcome(c.asked, c.answer)
			if k != c.kind || !errors.Is(err, c.err) || (c.err == nil) != (err == nil) {
				t.Errorf("SentOutcome = %v, %v; want %v, %v", k, err, c.kind, c.err)
			}
		})
	}
}

// Resting clears Sending while the source waits, and resume sets it again;
// outside a settler's context it does nothing.
func TestResting(t *testing.T) {
	driver.Resting(context.Background())() // no settlement: nothing to do
	d := driver.NewDelivery(driver.NewLinks(false))
	tk := d.Fill(nil, nil, 0, 0)
	tk.HandBack()
	ctx := d.Sending(context.Background())
	if !tk.Sending() {
		t.Fatal("not Sending once a settler began")
	}
	resume := driver.Resting(ctx)
	if tk.Sending() {
		t.Error("Sending while resting")
	}
	resume()
	if !tk.Sending() {
		t.Error("not Sending once resumed")
	}
}

// A settlement's answer without an error costs no allocation: SentOutcome
// runs once per delivery, and its errors.As target, which escapes, is made
// only for an error (it once cost an allocation per delivery).
func TestSentOutcomeOfNoErrorDoesNotAllocate(t *testing.T) {
	if n := testing.AllocsPerRun(1000, func() {
		if k, err := driver.SentOutcome(driver.Accept, nil); k != driver.Accept || err != nil {
			t.Fatal(k, err)
		}
	}); n != 0 {
		t.Fatalf("SentOutcome(Accept, nil): %v allocations, want 0", n)
	}
}
