// Command servicebus-sessions consumes a session-enabled Service Bus queue
// with amqpsub: up to four sessions at once, each on its own link, its
// messages one at a time in order, its lock renewed while it is held; a
// session idle for 5 s is let go and the next one accepted. It keeps a
// checkpoint in each session's state (the last message handled), which the
// next consumer of the session reads back. It prints each session's count
// when stopped with SIGTERM or Ctrl-C.
//
//	go run ./examples/servicebus-sessions -conn "$SERVICEBUS_CONNECTION_STRING" -queue orders-sessions
package main

import (
	"context"
	"flag"
	"fmt"
	"log"
	"os"
	"os/signal"
	"sort"
	"sync"
	"syscall"
	"time"

	"github.com/amqpsub/amqpsub/amqpsub"
)

func main() {
	conn := flag.String("conn", os.Getenv("SERVICEBUS_CONNECTION_STRING"), "connection string (default $SERVICEBUS_CONNECTION_STRING)")
	queue := flag.String("queue", "orders-sessions", "session-enabled queue")
	sessions := flag.Int("sessions", 4, "sessions held at once")
	flag.Parse()
	if err := run(*conn, *queue, *sessions); err != nil {
		log.Fatal(err)
	}
}

func run(conn, queue string, sessions int) error {
	c, err := amqpsub.ServiceBus(conn)
	if err != nil {
		return err
	}
	var mu sync.Mutex
	counts := map[string]int{}
	h := amqpsub.HandlerFunc(func(ctx context.Context, d *amqpsub.Delivery) error {
		last, err := d.SessionState(ctx) // the checkpoint a consumer left
		if err != nil {
			// Retried in the lane (LocalRetry below), so the session's
			// order holds: a Retry to the service would put this message
			// behind the session's next ones, which are already here.
			return err
		}
		body, _ := d.Body()
		if err := d.SetSessionState(ctx, body); err != nil {
			return err
		}
		mu.Lock()
		if counts[d.SessionID()] == 0 && last != nil {
			fmt.Printf("session %s resumes after %q\n", d.SessionID(), last)
		}
		counts[d.SessionID()]++
		mu.Unlock()
		return nil
	})
	sub, err := amqpsub.New(c, queue, h,
		amqpsub.Sessions(sessions),                // each session on a link of its own
		amqpsub.SessionIdleTimeout(5*time.Second), // then the next session
		amqpsub.LocalRetry(amqpsub.RetryPolicy{Budget: time.Minute}))
	if err != nil {
		return err
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	fmt.Printf("consuming sessions of %s, %d at a time; Ctrl-C to stop\n", queue, sessions)
	err = sub.Run(ctx)
	mu.Lock()
	ids := make([]string, 0, len(counts))
	for id := range counts {
		ids = append(ids, id)
	}
	sort.Strings(ids)
	for _, id := range ids {
		fmt.Printf("session %s: %d messages\n", id, counts[id])
	}
	mu.Unlock()
	fmt.Println(sub.Stats())
	return err
}
