package artemistest_test

import (
	"bytes"
	"context"
	"fmt"
	"log"
	"testing"
	"time"

	"github.com/Azure/go-amqp"

	"github.com/amqpsub/amqpsub/amqpsub"
	"github.com/amqpsub/amqpsub/artemistest"
	"github.com/amqpsub/amqpsub/examples/producer"
)

// A broker for a subscriber: publish two orders with go-amqp, consume
// them with amqpsub. Run's default mode, Auto, uses a Docker engine if
// one answers, and the local distribution otherwise (as in amqpsub's CI).
func Example() {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	b, err := artemistest.Run(ctx, artemistest.WithQueues("orders"))
	if err != nil {
		log.Fatal(err)
	}
	defer func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if err := b.Stop(ctx); err != nil {
			log.Print(err)
		}
	}()

	// Publish with go-amqp; the URL carries the credentials.
	conn, err := amqp.Dial(ctx, b.URL(), nil)
	if err != nil {
		log.Fatal(err)
	}
	sess, err := conn.NewSession(ctx, nil)
	if err != nil {
		log.Fatal(err)
	}
	snd, err := sess.NewSender(ctx, "orders", &amqp.SenderOptions{TargetCapabilities: []string{"queue"}})
	if err != nil {
		log.Fatal(err)
	}
	for _, body := range []string{"alice", "bob"} {
		if err := snd.Send(ctx, amqp.NewMessage([]byte(body)), nil); err != nil {
			log.Fatal(err)
		}
	}
	_ = conn.Close()

	// Consume with amqpsub until both are handled, then stop gracefully.
	runCtx, stop := context.WithCancel(ctx)
	defer stop()
	n := 0
	h := amqpsub.HandlerFunc(func(ctx context.Context, d *amqpsub.Delivery) error {
		body, err := d.Body()
		if err != nil {
			return amqpsub.Reject(err.Error())
		}
		fmt.Println("order of", string(body))
		if n++; n == 2 {
			stop() // a graceful stop: this delivery is still accepted
		}
		return nil
	})
	sub, err := amqpsub.New(amqpsub.Dial(b.URL(), nil), "orders", h)
	if err != nil {
		log.Fatal(err)
	}
	if err := sub.Run(runCtx); err != nil {
		log.Fatal(err)
	}
	// Output:
	// order of alice
	// order of bob
}

// In a test: Start fails the test if the broker cannot start, and stops
// it (and removes its files) when the test ends. Each test gets its own
// empty broker; tests that call t.Parallel get theirs at once.
func ExampleStart() {
	testOrders := func(t *testing.T) { // func TestOrders(t *testing.T)
		b := artemistest.Start(t)
		h := amqpsub.HandlerFunc(func(ctx context.Context, d *amqpsub.Delivery) error { return nil })
		sub, err := amqpsub.New(amqpsub.Dial(b.URL(), nil), "orders", h)
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
		defer cancel()
		if err := sub.Run(ctx); err != nil {
			t.Fatal(err)
		}
	}
	_ = testOrders
}

// One broker for all the tests of a package, from TestMain.
func ExampleRun() {
	testMain := func(m *testing.M) int { // func TestMain(m *testing.M) { os.Exit(testMain(m)) }
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
		defer cancel()
		b, err := artemistest.Run(ctx, artemistest.WithLogf(log.Printf))
		if err != nil {
			log.Print(err)
			return 1
		}
		defer func() {
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			if err := b.Stop(ctx); err != nil {
				log.Print(err)
			}
		}()
		brokerURL = b.URL() // a package variable the tests dial
		return m.Run()
	}
	_ = testMain
}

var brokerURL string

// The container path: the official image through testcontainers-go.
// Without a Docker engine, Start fails the test with ErrNoDocker (use
// Auto to fall back to a local process instead). amqpsub's CI has no
// Docker engine: this example is compiled there, never run.
func ExampleWithMode_container() {
	testWithDocker := func(t *testing.T) {
		b := artemistest.Start(t,
			artemistest.WithMode(artemistest.Container),
			artemistest.WithImage("apache/activemq-artemis:2.40.0"), // the default for 2.40.0
			artemistest.WithCredentials("app", "secret"))
		t.Log("AMQP at", b.URL(), "CORE at", b.CoreAddr())
	}
	_ = testWithDocker
}

// Declare queues ahead, and change the configuration: here, dead-letter
// after the first failed delivery instead of the fifth.
func ExampleWithBrokerXML() {
	testDeadLetters := func(t *testing.T) {
		xml := bytes.Replace(artemistest.DefaultBrokerXML(),
			[]byte("<max-delivery-attempts>5</max-delivery-attempts>"),
			[]byte("<max-delivery-attempts>1</max-delivery-attempts>"), 1)
		b := artemistest.Start(t, artemistest.WithBrokerXML(xml), artemistest.WithQueues("orders"))
		t.Log("AMQP at", b.URL())
	}
	_ = testDeadLetters
}

// Publish messages, consume them with amqpsub (rejecting the malformed),
// and read the dead-letter queue, declared ahead so that every rejection's
// reason is kept.
func ExampleWithDeadLetterQueues() {
	testDeadLetters := func(t *testing.T) {
		b := artemistest.Start(t, artemistest.WithQueues("orders"), artemistest.WithDeadLetterQueues("orders"))
		ctx := context.Background()
		err := b.Publish(ctx, "orders", 100, func(i int) *amqp.Message {
			return producer.NewMessage(fmt.Sprintf("order-%d", i), "", []byte("{}"))
		})
		if err != nil {
			t.Fatal(err)
		}
		// … run a subscriber with amqpsub.DeadLetterCopy("DLQ::DLQ.{queue}") …
		dead, err := b.Receive(ctx, "DLQ::DLQ.orders", 3)
		if err != nil {
			t.Fatal(err)
		}
		t.Log(dead[0].ApplicationProperties["DeadLetterReason"])
	}
	_ = testDeadLetters
}

// Declare a topic with two subscriptions, one filtered.
func ExampleWithAddress() {
	testTopic := func(t *testing.T) {
		b := artemistest.Start(t, artemistest.WithAddress("events", artemistest.Multicast,
			artemistest.Queue{Name: "audit"},
			artemistest.Queue{Name: "eu", Filter: "region = 'eu'"}))
		t.Log("subscriptions at", b.URL(), "events::audit and events::eu")
	}
	_ = testTopic
}
