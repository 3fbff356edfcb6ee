// Command servicebus consumes a Service Bus queue (or a subscription,
// "<topic>/Subscriptions/<name>") with amqpsub until SIGTERM or Ctrl-C:
// eight lanes keyed by the message's session/group id, every held
// message's lock renewed, malformed messages dead-lettered with a reason,
// a store outage ridden out in the lane for up to 30 s before the message
// goes back to the service. It prints what it handled and the counters.
//
//	go run ./examples/servicebus -conn "$SERVICEBUS_CONNECTION_STRING" -queue orders
//
// Against the Service Bus emulator (docker/servicebus) or our test peer
// (integration/sbpeer), use their connection strings with
// UseDevelopmentEmulator=true.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"log"
	"os"
	"os/signal"
	"sync/atomic"
	"syscall"
	"time"

	"go.uber.org/zap"

	"github.com/amqpsub/amqpsub/amqpsub"
)

type order struct {
	Customer string  `json:"customer"`
	Amount   float64 `json:"amount"`
}

func main() {
	conn := flag.String("conn", os.Getenv("SERVICEBUS_CONNECTION_STRING"), "connection string (default $SERVICEBUS_CONNECTION_STRING)")
	queue := flag.String("queue", "orders", "queue, or <topic>/Subscriptions/<subscription>")
	flag.Parse()
	if err := run(*conn, *queue); err != nil {
		log.Fatal(err)
	}
}

func run(conn, queue string) error {
	c, err := amqpsub.ServiceBus(conn)
	if err != nil {
		return err // names the key at fault, never the key
	}
	logger, _ := zap.NewProduction()
	defer logger.Sync()
	var handled, malformed atomic.Int64
	h := amqpsub.HandlerFunc(func(ctx context.Context, d *amqpsub.Delivery) error {
		body, err := d.Body()
		if err != nil {
			return amqpsub.RejectWith("not a data body", err.Error())
		}
		var o order
		if err := json.Unmarshal(body, &o); err != nil {
			malformed.Add(1)
			return amqpsub.RejectWith("malformed order", err.Error()) // DeadLetterReason on the DLQ
		}
		if err := store(ctx, o); err != nil {
			// ctx is cancelled if the message's lock is lost: the service
			// then delivers it again, and this result is not sent.
			return amqpsub.Retry(err) // abandon: counted towards MaxDeliveryCount
		}
		handled.Add(1)
		return nil
	})
	sub, err := amqpsub.New(c, queue, h,
		amqpsub.WorkersByKey(8),
		amqpsub.LocalRetry(amqpsub.RetryPolicy{Budget: 30 * time.Second}),
		amqpsub.Logger(logger),
		amqpsub.OnEvent(func(e amqpsub.Event) {
			if e.Kind == amqpsub.EventLockLost || e.Kind == amqpsub.EventAbandoned {
				fmt.Fprintln(os.Stderr, "event:", e)
			}
		}))
	if err != nil {
		return err
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	fmt.Printf("consuming %s; Ctrl-C to stop\n", queue)
	err = sub.Run(ctx) // a graceful stop returns nil
	fmt.Printf("handled %d, dead-lettered %d malformed\n%v\n", handled.Load(), malformed.Load(), sub.Stats())
	return err
}

var errStoreDown = errors.New("store down")

// store stands in for the write a real consumer makes.
func store(ctx context.Context, o order) error {
	if o.Customer == "" {
		return errStoreDown
	}
	select {
	case <-time.After(time.Millisecond):
		return nil
	case <-ctx.Done():
		return context.Cause(ctx)
	}
}
