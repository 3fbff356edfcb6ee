package amqpsub_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log"
	"os/signal"
	"syscall"
	"time"

	"go.uber.org/zap"

	"github.com/amqpsub/amqpsub/amqpsub"
)

type order struct {
	Customer string `json:"customer"`
	Amount   int    `json:"amount"`
}

var errOutOfStock = errors.New("out of stock")

func process(context.Context, order) error { return nil }

// A subscriber with the defaults: credit 256, one delivery at a time in
// queue order, Artemis.
func ExampleNew() {
	h := amqpsub.HandlerFunc(func(ctx context.Context, d *amqpsub.Delivery) error {
		body, err := d.Body()
		if err != nil {
			return amqpsub.Reject(err.Error()) // not data sections: dead-letter it
		}
		var o order
		if err := json.Unmarshal(body, &o); err != nil {
			return amqpsub.Reject("malformed order: " + err.Error())
		}
		return process(ctx, o) // nil accepts; an error retries
	})
	sub, err := amqpsub.New(amqpsub.Dial("amqp://127.0.0.1:5672", nil), "orders", h)
	if err != nil {
		log.Fatal(err)
	}
	// SIGTERM starts a graceful stop: buffered deliveries go back to the
	// queue at once, handlers in progress get the grace period.
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM)
	defer stop()
	if err := sub.Run(ctx); err != nil {
		log.Fatal(err)
	}
}

// Eight lanes: each customer's orders (AMQP group-id) run in order, eight
// customers at a time.
func ExampleWorkersByKey() {
	h := amqpsub.HandlerFunc(func(ctx context.Context, d *amqpsub.Delivery) error {
		fmt.Println(d.GroupID(), d.Lane())
		return nil
	})
	sub, err := amqpsub.New(amqpsub.Dial("amqp://127.0.0.1:5672", nil), "orders", h,
		amqpsub.WorkersByKey(8), amqpsub.Credit(512), amqpsub.Logger(zap.NewExample()))
	if err != nil {
		log.Fatal(err)
	}
	_ = sub.Run(context.Background())
}

// Up to 16 handlers at once, with no order between deliveries.
func ExampleWorkers() {
	h := amqpsub.HandlerFunc(func(ctx context.Context, d *amqpsub.Delivery) error { return nil })
	sub, _ := amqpsub.New(amqpsub.Dial("amqp://127.0.0.1:5672", nil), "thumbnails", h, amqpsub.Workers(16))
	_ = sub.Run(context.Background())
}

// Batches of up to 500 deliveries, closed 50 ms after their first delivery
// at the latest; one outcome per delivery.
func ExampleNewBatch() {
	h := amqpsub.BatchHandlerFunc(func(ctx context.Context, batch []*amqpsub.Delivery) []error {
		results := make([]error, len(batch))
		for i, d := range batch {
			if _, err := d.Body(); err != nil {
				results[i] = amqpsub.Reject("not a data body")
			}
		}
		return results // nil entries accept
	})
	sub, err := amqpsub.NewBatch(amqpsub.Dial("amqp://127.0.0.1:5672", nil), "events", h,
		amqpsub.Batch(500, 50*time.Millisecond))
	if err != nil {
		log.Fatal(err)
	}
	_ = sub.Run(context.Background())
}

// The outcomes a handler can choose.
func ExampleHandlerFunc() {
	_ = amqpsub.HandlerFunc(func(ctx context.Context, d *amqpsub.Delivery) error {
		var o order
		body, _ := d.Body()
		switch err := json.Unmarshal(body, &o); {
		case err != nil:
			return amqpsub.Reject("malformed") // dead-letter now
		case d.DeliveryCount() > 3:
			return amqpsub.Release() // back to the queue, not counted
		}
		if err := process(ctx, o); errors.Is(err, errOutOfStock) {
			return amqpsub.Retry(err) // counted; dead-lettered at the broker's max attempts
		}
		return nil // accept
	})
}

// RabbitMQ 3.10 with the rabbitmq_amqp1_0 plugin.
func ExampleRabbitMQ3() {
	h := amqpsub.HandlerFunc(func(ctx context.Context, d *amqpsub.Delivery) error { return nil })
	sub, _ := amqpsub.New(amqpsub.Dial("amqp://guest:guest@127.0.0.1:5672", nil), "orders", h,
		amqpsub.WithProfile(amqpsub.RabbitMQ3)) // consumes /amq/queue/orders
	_ = sub.Run(context.Background())
}

// Stop from elsewhere, waiting at most 40 s.
func ExampleSubscriber_Shutdown() {
	h := amqpsub.HandlerFunc(func(ctx context.Context, d *amqpsub.Delivery) error { return nil })
	sub, _ := amqpsub.New(amqpsub.Dial("amqp://127.0.0.1:5672", nil), "orders", h, amqpsub.GracePeriod(30*time.Second))
	go func() { _ = sub.Run(context.Background()) }()
	// ...
	ctx, cancel := context.WithTimeout(context.Background(), 40*time.Second)
	defer cancel()
	if err := sub.Shutdown(ctx); err != nil {
		log.Print(err)
	}
	fmt.Println(sub.Stats().Held)
}
