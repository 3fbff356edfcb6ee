package pump

import (
	"testing"

	"github.com/Azure/go-amqp"
)

// Begin refuses a delivery whose link was lost, even before the pump has
// marked it dropped (the window between the loss and dropStale).
func TestBeginRefusesAStaleDelivery(t *testing.T) {
	p := New(Config{Credit: 2})
	stale := p.take(&amqp.Message{}, nil, p.links.Next())
	fresh := p.take(&amqp.Message{}, nil, p.links.Next()) // the link is lost: the next one's
	if stale.Begin() {
		t.Fatal("Begin took a delivery of a lost link")
	}
	if !fresh.Begin() {
		t.Fatal("Begin refused a delivery of the current link")
	}
}
