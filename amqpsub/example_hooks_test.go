package amqpsub_test

import (
	"context"
	"errors"
	"fmt"
	"log"
	"os"
	"os/signal"
	"sync"
	"time"

	"github.com/Azure/go-amqp"

	"github.com/amqpsub/amqpsub/amqpsub"
	"github.com/amqpsub/amqpsub/amqpsubtest"
)

// The three ways a handler says a delivery failed: Reject when the message
// itself is wrong (dead-lettered now, with a reason), RejectWith to add a
// description, and Retry, or any other error, when handling it may work
// later (it goes back, and the broker counts the attempt).
func ExampleReject() {
	q := amqpsubtest.NewQueue(amqpsubtest.MaxDeliveryAttempts(2))
	q.Publish(amqpsubtest.Message("", "no-amount"), amqpsubtest.Message("", "bad-currency"),
		amqpsubtest.Message("", "bank-down"))
	h := amqpsub.HandlerFunc(func(ctx context.Context, d *amqpsub.Delivery) error {
		switch body, _ := d.Body(); string(body) {
		case "no-amount":
			return amqpsub.Reject("order without an amount")
		case "bad-currency":
			return amqpsub.RejectWith("unknown currency", "XYZ is not ISO 4217")
		case "bank-down":
			return amqpsub.Retry(errors.New("bank: 503"))
		}
		return nil
	})
	sub, _ := amqpsub.New(q.Connector(), "payments", h)
	consume(q, sub)
	for _, r := range q.DeadLetters() {
		fmt.Printf("%q %q\n", r.Reason(), r.Description())
	}
	// Output:
	// "order without an amount" ""
	// "unknown currency" "XYZ is not ISO 4217"
	// "" ""
}

// OnReconnect hears of each lost link replaced, after how many attempts and
// why the old one ended; the pipeline keeps running meanwhile, and what the
// lost link held comes back from the broker.
func ExampleOnReconnect() {
	q := amqpsubtest.NewQueue()
	q.Publish(amqpsubtest.Message("", "1"), amqpsubtest.Message("", "2"))
	var once sync.Once
	h := amqpsub.HandlerFunc(func(ctx context.Context, d *amqpsub.Delivery) error {
		once.Do(func() { q.LoseLinks(nil) }) // the broker detaches the link
		return nil
	})
	sub, _ := amqpsub.New(q.Connector(), "orders", h,
		amqpsub.Backoff(time.Millisecond, 10*time.Millisecond),
		amqpsub.OnReconnect(func(attempts int, cause error) {
			var le *amqp.LinkError
			if errors.As(cause, &le) {
				fmt.Println("reconnected after", attempts, "attempt(s); the link ended with", le.RemoteErr.Condition)
			}
		}))
	consume(q, sub)
	fmt.Println("reconnects:", sub.Stats().Reconnects)
	// Output:
	// reconnected after 1 attempt(s); the link ended with amqp:link:detach-forced
	// reconnects: 1
}

// countingMetrics' smaller cousin: a Recorder that counts settlements by
// outcome. Real ones are the adapters in contrib/amqpprom (Prometheus) and
// contrib/amqpotel (OpenTelemetry).
type outcomeCounter struct {
	mu sync.Mutex
	n  map[amqpsub.Outcome]int
}

func (c *outcomeCounter) Recorder(info amqpsub.MetricsInfo) amqpsub.Recorder {
	fmt.Println("recording", info.Queue, "on", info.System)
	c.n = map[amqpsub.Outcome]int{}
	return c
}
func (c *outcomeCounter) Received()                   {}
func (c *outcomeCounter) Handled(amqpsub.HandlerCall) {}
func (c *outcomeCounter) Event(amqpsub.Event)         {}
func (c *outcomeCounter) LocksRenewed(int)            {}
func (c *outcomeCounter) Dropped(int)                 {}
func (c *outcomeCounter) Settled(o amqpsub.Outcome, err error) {
	if err == nil {
		c.mu.Lock()
		c.n[o]++
		c.mu.Unlock()
	}
}

// WithMetrics hands every measurement to a Recorder. Here a small one
// counts settlements; in production give it amqpprom.New(registry) or
// amqpotel.NewMetrics().
func ExampleWithMetrics() {
	q := amqpsubtest.NewQueue()
	q.Publish(amqpsubtest.Message("", "ok"), amqpsubtest.Message("", "bad"), amqpsubtest.Message("", "ok"))
	c := &outcomeCounter{}
	sub, _ := amqpsub.New(q.Connector(), "orders", amqpsub.HandlerFunc(func(ctx context.Context, d *amqpsub.Delivery) error {
		if body, _ := d.Body(); string(body) == "bad" {
			return amqpsub.Reject("bad")
		}
		return nil
	}), amqpsub.WithMetrics(c))
	consume(q, sub)
	fmt.Println(c.n[amqpsub.OutcomeAccepted], "accepted,", c.n[amqpsub.OutcomeRejected], "rejected")
	// Output:
	// recording orders on activemq
	// 2 accepted, 1 rejected
}

// OnSettled tells the handler when its settlement has really been applied
// (sent to the broker, or answered on Service Bus): for a settle span, or
// to release a resource only once the broker has the outcome.
func ExampleDelivery_OnSettled() {
	q := amqpsubtest.NewQueue()
	q.Publish(amqpsubtest.Message("", "1"))
	settled := make(chan string, 1)
	sub, _ := amqpsub.New(q.Connector(), "orders", amqpsub.HandlerFunc(func(ctx context.Context, d *amqpsub.Delivery) error {
		d.OnSettled(func(o amqpsub.Outcome, err error) {
			settled <- fmt.Sprint(o, " ", err) // on the receiving goroutine: never block here
		})
		return nil
	}))
	consume(q, sub)
	fmt.Println(<-settled)
	// Output: accepted <nil>
}

// Keep the reason of a rejection on Artemis: the delivery is copied to the
// dead-letter address with the reason, then accepted. Create the
// dead-letter queue first (docs/brokers.md, "Dead letters on Artemis").
func ExampleDeadLetterCopy() {
	h := amqpsub.HandlerFunc(func(ctx context.Context, d *amqpsub.Delivery) error {
		return amqpsub.Reject("unknown product")
	})
	sub, err := amqpsub.New(amqpsub.Dial("amqp://127.0.0.1:5672", nil), "orders", h,
		amqpsub.DeadLetterCopy("DLQ::DLQ.orders"))
	if err != nil {
		log.Fatal(err)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	if err := sub.Run(ctx); err != nil {
		log.Fatal(err)
	}
	log.Println(sub.Stats().DeadLetterCopies, "rejections kept with their reason")
}

// Tell, once a delivery is settled, a handled message from a rejection
// that DeadLetterCopy copied: both settle as accepted on the wire.
func ExampleDelivery_DeadLetterCopied() {
	h := amqpsub.HandlerFunc(func(ctx context.Context, d *amqpsub.Delivery) error {
		d.OnSettled(func(o amqpsub.Outcome, err error) {
			switch address, copyErr := d.DeadLetterCopied(); {
			case address != "" && copyErr == nil:
				log.Printf("%v copied to %s, then %v", d.MessageID(), address, o)
			case address != "":
				log.Printf("%v %v without its reason: %v", d.MessageID(), o, copyErr)
			}
		})
		return amqpsub.Reject("unknown product")
	})
	sub, err := amqpsub.New(amqpsub.Dial("amqp://127.0.0.1:5672", nil), "orders", h,
		amqpsub.DeadLetterCopy("DLQ::DLQ.orders"))
	if err != nil {
		log.Fatal(err)
	}
	if err := sub.Run(context.Background()); err != nil {
		log.Fatal(err)
	}
}

// A session consumer on a session-enabled Service Bus queue: four sessions
// at once, each in order, with session state kept across deliveries.
func ExampleSessions() {
	conn, err := amqpsub.ServiceBus(os.Getenv("SERVICEBUS_CONNECTION_STRING"))
	if err != nil {
		log.Fatal(err)
	}
	h := amqpsub.HandlerFunc(func(ctx context.Context, d *amqpsub.Delivery) error {
		state, err := d.SessionState(ctx) // what the last delivery of this session left
		if err != nil {
			return err
		}
		return d.SetSessionState(ctx, append(state, '.'))
	})
	sub, err := amqpsub.New(conn, "orders", h, amqpsub.Sessions(4), amqpsub.SessionIdleTimeout(30*time.Second))
	if err != nil {
		log.Fatal(err)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	if err := sub.Run(ctx); err != nil {
		log.Fatal(err)
	}
}
