package driver_test

import (
	"errors"
	"testing"

	"github.com/Azure/go-amqp"

	"github.com/amqpsub/amqpsub/internal/driver"
	"github.com/amqpsub/amqpsub/internal/driver/artemis"
	"github.com/amqpsub/amqpsub/internal/driver/generic"
	"github.com/amqpsub/amqpsub/internal/driver/rabbitmq3"
	"github.com/amqpsub/amqpsub/internal/driver/rabbitmq4"
)

const cond amqp.ErrCond = "amqp:test:reject"

var drivers = []driver.Driver{artemis.New(cond), generic.New(cond), rabbitmq3.New(cond), rabbitmq4.New(cond)}

// Every broker an open frame names is claimed by one driver at most, and
// by the one whose name the suggestion gives.
func TestClaimsOneDriverEach(t *testing.T) {
	for _, tc := range []struct{ product, version, want string }{
		{"RabbitMQ", "4.0.5", "rabbitmq4"},
		{"rabbitmq", "10.1.0", "rabbitmq4"},
		{"RabbitMQ", "3.13.7", "rabbitmq3"},
		{"RabbitMQ", "", "rabbitmq3"},
		{"apache-activemq-artemis", "2.40.0", "artemis"},
		{"qpid-dispatch-router", "1.19", ""},
		{"", "", ""},
	} {
		var got []string
		for _, d := range drivers {
			if d.Claims(tc.product, tc.version) {
				got = append(got, d.Facts().Name)
			}
		}
		switch {
		case tc.want == "" && len(got) != 0, tc.want != "" && (len(got) != 1 || got[0] != tc.want):
			t.Errorf("%q %q claimed by %v, want %q", tc.product, tc.version, got, tc.want)
		}
	}
}

func TestAddresses(t *testing.T) {
	for _, tc := range []struct {
		d       driver.Driver
		q, want string
	}{
		{artemis.New(cond), "orders", "orders"},
		{generic.New(cond), "a/b", "a/b"},
		{rabbitmq3.New(cond), "orders", "/amq/queue/orders"},
		{rabbitmq3.New(cond), "/exchange/x", "/exchange/x"},
		{rabbitmq4.New(cond), "a b", "/queues/a%20b"},
	} {
		if got := tc.d.Address(tc.q); got != tc.want {
			t.Errorf("%s: Address(%q) = %q, want %q", tc.d.Facts().Name, tc.q, got, tc.want)
		}
	}
}

// The drivers that know no condition of their own take nothing as fatal
// or as throttling, and reject with the condition they were given.
func TestPlainDriversAddNoCondition(t *testing.T) {
	busy := &amqp.Error{Condition: "com.microsoft:server-busy"}
	for _, d := range drivers {
		f := d.Facts()
		if d.FatalCond(busy) || d.DefaultFatal(busy) || d.Wait(busy) != 0 {
			t.Errorf("%s takes %v as fatal or throttling", f.Name, busy)
		}
		if f.RejectCond != cond || f.Name == "" || f.System == "" {
			t.Errorf("%s: facts %+v", f.Name, f)
		}
	}
	if rabbitmq3.New(cond).Facts().Retry.Kind != driver.Release || !rabbitmq3.New(cond).Facts().Windowed {
		t.Error("RabbitMQ 3 retries by modified, or grants credit continuously: the broker ends the session on modified and sends past its credit")
	}
	if !generic.New(cond).Facts().AnyBroker || artemis.New(cond).Facts().AnyBroker {
		t.Error("only the generic profile fits every broker")
	}
}

// A classic queue refuses MaxDeliveryCount with a MismatchError, which the
// core reports as an invalid option; a quorum queue takes it, and turns a
// Reject into modified{delivery-failed, undeliverable-here}.
func TestRabbitMQ4QueueType(t *testing.T) {
	p := rabbitmq4.New(cond).NewPipe(env{max: 5})
	if _, err := p.CheckSource(queue{typ: "classic"}); !errors.As(err, new(*driver.MismatchError)) {
		t.Fatalf("classic queue with MaxDeliveryCount: %v, want a MismatchError", err)
	}
	if p.ReturnsCounted() {
		t.Error("a classic queue counts returns")
	}
	if o := p.Outcome(driver.Outcome{Kind: driver.Reject}); o.Kind != driver.Reject {
		t.Errorf("a Reject on a classic queue sent as %+v", o)
	}
	if _, err := p.CheckSource(queue{typ: "quorum", limit: 20}); err != nil {
		t.Fatal(err)
	}
	if !p.ReturnsCounted() {
		t.Error("a quorum queue counts no returns")
	}
	if o := p.Outcome(driver.Outcome{Kind: driver.Reject}); o.Kind != driver.Modify || !o.UndeliverableHere {
		t.Errorf("a Reject on a quorum queue sent as %+v", o)
	}
}
