// Command orders publishes orders for many customers to a queue and
// consumes them with amqpsub: WorkersByKey(8) with BalanceKeys, the customer
// as the AMQP group-id, and a handler that works 0–2 ms per order. It prints
// the placement, the throughput beside the most the lanes could do (lanes /
// the handler's measured mean time), how many orders each lane handled, and
// a per-customer order check, which must show 0 violations.
//
//	go run ./examples/orders -url amqp://127.0.0.1:5672
//	go run ./examples/orders -placement hash    # the hash placement, to compare
package main

import (
	"context"
	"flag"
	"fmt"
	"log"
	"math/rand/v2"
	"os"
	"os/signal"
	"sync"
	"syscall"
	"time"

	"github.com/Azure/go-amqp"
	"go.uber.org/zap"

	"github.com/amqpsub/amqpsub/amqpsub"
	"github.com/amqpsub/amqpsub/examples/producer"
)

func main() {
	url := flag.String("url", "amqp://127.0.0.1:5672", "broker URL")
	queue := flag.String("queue", fmt.Sprintf("orders.demo.%d", time.Now().Unix()), "queue")
	orders := flag.Int("orders", 20000, "orders to publish")
	customers := flag.Int("customers", 200, "customers (group-ids)")
	lanes := flag.Int("lanes", 8, "WorkersByKey lanes")
	maxWork := flag.Duration("work", 2*time.Millisecond, "each order takes a random 0..work")
	placement := flag.String("placement", "balanced", "balanced (BalanceKeys) or hash (group-id hash mod lanes)")
	flag.Parse()
	if *placement != "balanced" && *placement != "hash" {
		log.Fatalf("-placement %q: balanced or hash", *placement)
	}
	if err := run(*url, *queue, *orders, *customers, *lanes, *maxWork, *placement == "balanced"); err != nil {
		log.Fatal(err)
	}
}

func run(url, queue string, orders, customers, lanes int, maxWork time.Duration, balanced bool) error {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()

	fmt.Printf("publishing %d orders over %d customers to %s ...\n", orders, customers, queue)
	start := time.Now()
	if err := publish(ctx, url, queue, orders, customers); err != nil {
		return err
	}
	fmt.Printf("published in %v\n", time.Since(start).Round(time.Millisecond))

	var (
		mu         sync.Mutex
		next       = map[string]int64{}
		perLane    = make([]int, lanes)
		violations int
		handled    int
		worked     time.Duration // the handlers' time, summed
		all        = make(chan struct{})
	)
	handler := amqpsub.HandlerFunc(func(ctx context.Context, d *amqpsub.Delivery) error {
		began := time.Now()
		time.Sleep(rand.N(maxWork + 1)) // the work
		took := time.Since(began)
		seq, _ := d.ApplicationProperties()["seq"].(int64)
		mu.Lock()
		defer mu.Unlock()
		worked += took
		if seq != next[d.GroupID()] {
			violations++
		}
		next[d.GroupID()] = seq + 1
		perLane[d.Lane()]++
		if handled++; handled == orders {
			close(all)
		}
		return nil
	})
	logger, _ := zap.NewProduction()
	defer logger.Sync()
	opts := []amqpsub.Option{amqpsub.WorkersByKey(lanes), amqpsub.Logger(logger)}
	name := "hash of the group-id mod lanes"
	if balanced {
		opts = append(opts, amqpsub.BalanceKeys())
		name = "balanced (BalanceKeys)"
	}
	fmt.Printf("placement: %s\n", name)
	sub, err := amqpsub.New(amqpsub.Dial(url, nil), queue, handler, opts...)
	if err != nil {
		return err
	}
	runErr := make(chan error, 1)
	start = time.Now()
	go func() { runErr <- sub.Run(ctx) }()
	select {
	case <-all:
	case err := <-runErr:
		return fmt.Errorf("consumer stopped early: %w", err)
	case <-ctx.Done():
	}
	elapsed := time.Since(start)
	shutdownCtx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := sub.Shutdown(shutdownCtx); err != nil {
		return err
	}
	if err := <-runErr; err != nil {
		return err
	}

	mu.Lock()
	defer mu.Unlock()
	st := sub.Stats()
	rate := float64(handled) / elapsed.Seconds()
	mean := worked / time.Duration(max(handled, 1))
	ideal := float64(lanes) / mean.Seconds()
	fmt.Printf("consumed %d orders in %v: %.0f orders/s with %d lanes (max held %d of credit 256)\n",
		handled, elapsed.Round(time.Millisecond), rate, lanes, st.MaxHeld)
	fmt.Printf("the handler took %v on average: %d lanes could do %.0f orders/s; this run did %.0f%% of that\n",
		mean.Round(time.Microsecond), lanes, ideal, 100*rate/ideal)
	fmt.Println("orders per lane:")
	for i, n := range perLane {
		fmt.Printf("  lane %d: %d\n", i, n)
	}
	fmt.Printf("per-customer order check: %d customers, %d violations\n", len(next), violations)
	if violations != 0 || handled != orders {
		return fmt.Errorf("%d violations, %d of %d handled", violations, handled, orders)
	}
	return nil
}

// publish sends the orders in customer round-robin, each with its
// customer as group-id and its per-customer sequence number.
func publish(ctx context.Context, url, queue string, orders, customers int) error {
	conn, err := amqp.Dial(ctx, url, nil)
	if err != nil {
		return fmt.Errorf("dial %s: %w", url, err)
	}
	defer conn.Close()
	return producer.Send(ctx, conn, queue, orders,
		func(i int) *amqp.Message {
			c, seq := i%customers, int64(i/customers)
			customer := fmt.Sprintf("customer-%03d", c)
			msg := producer.NewMessage(fmt.Sprintf("order-%d", i), customer, fmt.Appendf(nil, `{"customer":%q,"seq":%d}`, customer, seq))
			msg.ApplicationProperties = map[string]any{"seq": seq}
			return msg
		}, nil)
}
