package pump

import (
	"testing"

	"github.com/Azure/go-amqp"
)

// Begin refuses a delivery whose link was lost, even before the pump has
// marked it dropped (the window between the loss and dropStale).
func TestBeginRefusesAStaleDelivery(t *testing.T) {
	p := New(Config{Credit: 2})
	p.link.Store(1)
	fresh := p.take(&amqp.Message{}, nil, 1)
	stale := p.take(&amqp.Message{}, nil, 1)
	p.link.Add(1) // the link is lost
	if stale.Begin() {
		t.Fatal("Begin took a delivery of a lost link")
	}
	p.link.Store(1)
	if !fresh.Begin() {
		t.Fatal("Begin refused a delivery of the current link")
	}
}
