package amqpsubtest_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/amqpsub/amqpsub/amqpsub"
	"github.com/amqpsub/amqpsub/amqpsubtest"
)

// handleOrder is the handler under test: it rejects malformed orders and
// retries while the payment service fails.
func handleOrder(ctx context.Context, d *amqpsub.Delivery) error {
	var o struct{ Amount int }
	body, _ := d.Body()
	if err := json.Unmarshal(body, &o); err != nil {
		return amqpsub.Reject("malformed order")
	}
	if o.Amount > 1000 {
		return errors.New("payment service: timeout") // a Retry: the broker counts it
	}
	return nil
}

// A handler test: three orders, and what the broker saw of each.
func Example() {
	q := amqpsubtest.NewQueue(amqpsubtest.MaxDeliveryAttempts(3))
	q.Publish(amqpsubtest.Message("alice", `{"amount": 5}`),
		amqpsubtest.Message("bob", `{"amount": 5000}`),
		amqpsubtest.Message("carol", `{"amount":`))
	sub, _ := amqpsub.New(q.Connector(), "orders", amqpsub.HandlerFunc(handleOrder))
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := q.Drain(ctx, sub); err != nil {
		fmt.Println(err)
	}
	for _, r := range q.Records() {
		fmt.Println(r)
	}
	// Output:
	// #0 group alice: 0 accepted → consumed
	// #1 group bob: 0 modified{delivery-failed}, 1 modified{delivery-failed}, 2 modified{delivery-failed} → dead-lettered
	// #2 group carol: 0 rejected "malformed order" → dead-lettered
}
