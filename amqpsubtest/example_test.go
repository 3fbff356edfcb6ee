package amqpsubtest_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sync/atomic"
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

// A Service Bus lock-expiry test: the handler takes longer than its lock
// and MaxLockRenewal, so its context is cancelled (cause ErrLockLost), its
// result is not sent, and the service delivers the message again, counted.
// In a test, run this in a synctest bubble with the durations of production
// (60 s locks, the 5 min MaxLockRenewal, a handler of 10 min): it then takes
// no time. An Example runs on the real clock, so this one scales them down.
func ExampleQueue_serviceBus() {
	q := amqpsubtest.NewQueue(amqpsubtest.WithProfile(amqpsub.AzureServiceBus),
		amqpsubtest.LockDuration(400*time.Millisecond))
	q.Publish(amqpsubtest.Message("", "monthly report"))
	var calls atomic.Int32
	h := amqpsub.HandlerFunc(func(ctx context.Context, d *amqpsub.Delivery) error {
		if calls.Add(1) == 1 {
			<-ctx.Done() // a report that takes too long
			fmt.Println("first call:", context.Cause(ctx))
			return ctx.Err()
		}
		fmt.Println("call with delivery count", d.DeliveryCount())
		return nil
	})
	// The queue's Connector gives the subscriber the AzureServiceBus profile.
	sub, _ := amqpsub.New(q.Connector(), "reports", h, amqpsub.MaxLockRenewal(400*time.Millisecond))
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := q.Drain(ctx, sub); err != nil {
		fmt.Println(err)
	}
	fmt.Println(q.Records()[0])
	fmt.Println("locks lost:", sub.Stats().Locks.Lost)
	// Output:
	// first call: amqpsub: the message lock was lost
	// call with delivery count 1
	// #0: 0 lock expired, 1 accepted → consumed
	// locks lost: 1
}
