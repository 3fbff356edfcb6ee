package producer_test

import (
	"context"
	"fmt"
	"log"
	"time"

	"github.com/Azure/go-amqp"

	"github.com/amqpsub/amqpsub/examples/producer"
)

// Sends 1,000 orders over 50 customers: each customer's orders in order
// (its group-id), each with an id of its own.
func ExampleSend() {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	conn, err := amqp.Dial(ctx, "amqp://127.0.0.1:5672", nil)
	if err != nil {
		log.Fatal(err)
	}
	defer conn.Close()
	err = producer.Send(ctx, conn, "orders", 1000, func(i int) *amqp.Message {
		customer := fmt.Sprintf("customer-%02d", i%50)
		return producer.NewMessage(fmt.Sprintf("order-%d", i), customer, fmt.Appendf(nil, `{"n":%d}`, i))
	}, nil)
	if err != nil {
		log.Fatal(err)
	}
}
