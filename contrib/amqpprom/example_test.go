package amqpprom_test

import (
	"context"
	"fmt"
	"net/http"
	"strings"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/amqpsub/amqpsub/amqpsub"
	"github.com/amqpsub/amqpsub/amqpsubtest"
	"github.com/amqpsub/amqpsub/contrib/amqpprom"
)

// One Metrics for every Subscriber of the process, served on /metrics. The
// queue here is an amqpsubtest queue; in production it is amqpsub.Dial.
func Example() {
	reg := prometheus.NewRegistry()
	metrics := amqpprom.New(reg)
	http.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))

	q := amqpsubtest.NewQueue()
	q.Publish(amqpsubtest.Message("alice", "1"), amqpsubtest.Message("bob", "2"), amqpsubtest.Message("alice", "3"))
	sub, err := amqpsub.New(q.Connector(), "orders",
		amqpsub.HandlerFunc(func(context.Context, *amqpsub.Delivery) error { return nil }),
		amqpsub.WorkersByKey(4), amqpsub.WithMetrics(metrics))
	if err != nil {
		panic(err)
	}
	if err := q.Drain(context.Background(), sub); err != nil {
		panic(err)
	}

	err = testutil.GatherAndCompare(reg, strings.NewReader(`
# HELP messaging_client_consumed_messages_total Deliveries received from the broker.
# TYPE messaging_client_consumed_messages_total counter
messaging_client_consumed_messages_total{messaging_destination_name="orders",messaging_operation_name="receive",messaging_system="activemq"} 3
`), "messaging_client_consumed_messages_total")
	fmt.Println(err)
	// Output: <nil>
}
