package amqpprom_test

import (
	"context"
	"runtime"
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/amqpsub/amqpsub/amqpsub"
	"github.com/amqpsub/amqpsub/amqpsubtest"
	"github.com/amqpsub/amqpsub/contrib/amqpprom"
)

// A subscriber closed before it ran, or made and dropped (a start-up that
// failed further on), is not reported for ever: the gauges forget the first
// at once (its Done is closed by Close) and the others once they are
// garbage collected (they are held weakly). (Found by an outside review.)
func TestNeverRunSubscribersLeaveTheGauges(t *testing.T) {
	reg := prometheus.NewRegistry()
	m := amqpprom.New(reg)
	nop := amqpsub.HandlerFunc(func(context.Context, *amqpsub.Delivery) error { return nil })
	sub, err := amqpsub.New(amqpsubtest.NewQueue().Connector(), "orders", nop, amqpsub.WithMetrics(m), amqpsub.Credit(100))
	if err != nil {
		t.Fatal(err)
	}
	_ = sub.Close() // never run
	for range 10 {
		if _, err := amqpsub.New(amqpsubtest.NewQueue().Connector(), "orders", nop, amqpsub.WithMetrics(m), amqpsub.Credit(100)); err != nil {
			t.Fatal(err)
		}
	}
	runtime.GC()
	if fams := gather(t, reg, "amqpsub_credit"); len(fams) != 0 {
		t.Errorf("amqpsub_credit reported with no subscriber running (one closed before Run, ten dropped): %v", fams)
	}
}
