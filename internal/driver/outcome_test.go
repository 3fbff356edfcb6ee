package driver_test

import (
	"context"
	"errors"
	"testing"

	"github.com/amqpsub/amqpsub/internal/driver"
)

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
