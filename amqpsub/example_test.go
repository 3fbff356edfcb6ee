package amqpsub_test

// The examples run against an amqpsubtest queue, which plays the broker in
// memory behind the real pipeline, and check their output. Against a
// broker, give New amqpsub.Dial(url, nil) in place of q.Connector() (see
// ExampleDial); the examples that need one compile but do not run.

import (
	"context"
	"crypto/tls"
	"encoding/json"
	"errors"
	"fmt"
	"log"
	"os"
	"os/signal"
	"slices"
	"sync"
	"syscall"
	"time"

	"github.com/Azure/go-amqp"

	"github.com/amqpsub/amqpsub/amqpsub"
	"github.com/amqpsub/amqpsub/amqpsubtest"
)

type order struct {
	Amount int `json:"amount"`
}

// consume runs sub until every message on q is accepted or dead-lettered,
// then stops it, as a SIGTERM would.
func consume(q *amqpsubtest.Queue, sub *amqpsub.Subscriber) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := q.Drain(ctx, sub); err != nil {
		fmt.Println(err)
	}
}

func printRecords(q *amqpsubtest.Queue) {
	for _, r := range q.Records() {
		fmt.Println(r)
	}
}

// A subscriber with the defaults: credit 256, one delivery at a time in
// queue order, the Artemis profile. A handler's nil accepts the delivery.
func ExampleNew() {
	q := amqpsubtest.NewQueue()
	q.Publish(amqpsubtest.Message("alice", `{"amount": 5}`), amqpsubtest.Message("bob", `{"amount":`))

	h := amqpsub.HandlerFunc(func(ctx context.Context, d *amqpsub.Delivery) error {
		var o order
		body, err := d.Body()
		if err == nil {
			err = json.Unmarshal(body, &o)
		}
		if err != nil {
			return amqpsub.Reject("malformed order") // dead-letter it now
		}
		fmt.Println("order of", d.GroupID(), "for", o.Amount)
		return nil
	})
	sub, err := amqpsub.New(q.Connector(), "orders", h)
	if err != nil {
		log.Fatal(err) // an invalid option (ErrInvalidOption)
	}
	consume(q, sub)
	printRecords(q)
	// Output:
	// order of alice for 5
	// #0 group alice: 0 accepted → consumed
	// #1 group bob: 0 rejected "malformed order" → dead-lettered
}

// In production: SIGTERM cancels Run's ctx, which is a graceful stop (the
// buffered deliveries go back to the queue at once, the handlers in
// progress get the grace period), and Run then returns nil. Needs a
// broker: compile-only.
func ExampleDial() {
	h := amqpsub.HandlerFunc(func(ctx context.Context, d *amqpsub.Delivery) error { return nil })
	sub, err := amqpsub.New(amqpsub.Dial("amqp://127.0.0.1:5672", nil), "orders", h)
	if err != nil {
		log.Fatal(err)
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM)
	defer stop()
	if err := sub.Run(ctx); err != nil {
		log.Fatal(err) // could not connect, a fatal error, or handlers abandoned at the stop
	}
}

// TLS with SASL PLAIN: amqps:// and go-amqp's connection options. The
// server name defaults to the URL's host. Needs a broker: compile-only.
func ExampleDial_tls() {
	h := amqpsub.HandlerFunc(func(ctx context.Context, d *amqpsub.Delivery) error { return nil })
	c := amqpsub.Dial("amqps://app:secret@broker.example.com", &amqp.ConnOptions{
		TLSConfig: &tls.Config{MinVersion: tls.VersionTLS12},
	})
	sub, err := amqpsub.New(c, "orders", h)
	if err != nil {
		log.Fatal(err)
	}
	if err := sub.Run(context.Background()); err != nil {
		log.Fatal(err)
	}
}

// A broker with a backup: the first connect tries the live server, then the
// backup; after a lost connection the subscriber tries the address after
// the one it was on first, each within DialTimeout, with the backoff
// between rounds. OnEvent says where it went. Needs a broker: compile-only.
func ExampleDialFailover() {
	c, err := amqpsub.DialFailover([]string{
		"amqp://app:secret@artemis-live:5672",
		"amqp://app:secret@artemis-backup:5672",
	}, nil)
	if err != nil {
		log.Fatal(err) // an empty list or a bad URL (ErrInvalidOption)
	}
	h := amqpsub.HandlerFunc(func(ctx context.Context, d *amqpsub.Delivery) error { return nil })
	sub, err := amqpsub.New(c, "orders", h, amqpsub.DialTimeout(5*time.Second),
		amqpsub.OnEvent(func(e amqpsub.Event) {
			if e.Kind == amqpsub.EventReconnected {
				log.Printf("consuming from %s again", e.Broker) // without the password
			}
		}))
	if err != nil {
		log.Fatal(err)
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM)
	defer stop()
	if err := sub.Run(ctx); err != nil {
		log.Fatal(err) // no address answered (each named, with why), or a fatal error such as refused credentials
	}
}

// DialFailover checks the list before anything connects, and names a bad
// entry by its index, never quoting its password.
func ExampleDialFailover_invalid() {
	_, err := amqpsub.DialFailover([]string{
		"amqp://app:secret@artemis-live:5672",
		"amqp://app:s%cret@artemis-backup:5672", // a % not escaped
		"http://artemis-other:8161",
	}, nil)
	fmt.Println(errors.Is(err, amqpsub.ErrInvalidOption))
	fmt.Println(err)
	// Output:
	// true
	// amqpsub: invalid option: DialFailover: urls[1] ("amqp://app:xxxxx@artemis-backup:5672"): not a URL (characters such as % : / @ in a user name or password must be percent-encoded)
	// amqpsub: invalid option: DialFailover: urls[2] ("http://artemis-other:8161"): unsupported scheme "http": use amqp or amqps
}

// A connection you opened and keep: the subscriber opens its own session on
// it and closes only that. Needs a broker: compile-only.
func ExampleConn() {
	ctx := context.Background()
	conn, err := amqp.Dial(ctx, "amqp://127.0.0.1:5672", nil)
	if err != nil {
		log.Fatal(err)
	}
	defer conn.Close()
	h := amqpsub.HandlerFunc(func(ctx context.Context, d *amqpsub.Delivery) error { return nil })
	sub, err := amqpsub.New(amqpsub.Conn(conn), "orders", h)
	if err != nil {
		log.Fatal(err)
	}
	if err := sub.Run(ctx); err != nil {
		log.Fatal(err) // wraps ErrLinkLost if conn itself is lost
	}
}

// The outcomes. Reject what can never succeed; return an error (Retry) for
// what may succeed later, and let the broker count the attempts and
// dead-letter at its max-delivery-attempts (5 here, as in our test broker;
// Artemis's default is 10). Release does not count: only for a delivery
// this consumer must not handle (see ExampleRelease), never as a retry, or
// a failing message cycles forever.
func ExampleHandlerFunc() {
	q := amqpsubtest.NewQueue(amqpsubtest.MaxDeliveryAttempts(5))
	q.Publish(amqpsubtest.Message("alice", `{"amount": 5}`), amqpsubtest.Message("bob", `{"amount":`),
		amqpsubtest.Message("carol", `{"amount": 7}`), amqpsubtest.Message("dave", `{"amount": 9}`))
	failures := map[string]int{"carol": 2, "dave": 99}
	reserve := func(customer string, o order) error { // a store failing for a while
		if failures[customer] > 0 {
			failures[customer]--
			return errors.New("store unavailable")
		}
		return nil
	}

	h := amqpsub.HandlerFunc(func(ctx context.Context, d *amqpsub.Delivery) error {
		var o order
		body, _ := d.Body()
		if err := json.Unmarshal(body, &o); err != nil {
			return amqpsub.Reject("malformed order") // dead-lettered now
		}
		if err := reserve(d.GroupID(), o); err != nil {
			return amqpsub.Retry(err) // counted; any other error means the same
		}
		return nil
	})
	sub, _ := amqpsub.New(q.Connector(), "orders", h)
	consume(q, sub)
	printRecords(q)
	// Output:
	// #0 group alice: 0 accepted → consumed
	// #1 group bob: 0 rejected "malformed order" → dead-lettered
	// #2 group carol: 0 modified{delivery-failed}, 1 modified{delivery-failed}, 2 accepted → consumed
	// #3 group dave: 0 modified{delivery-failed}, 1 modified{delivery-failed}, 2 modified{delivery-failed}, 3 modified{delivery-failed}, 4 modified{delivery-failed} → dead-lettered
}

// Release is for deliveries this consumer must not handle, so that another
// one takes them: here two replicas of one queue serve a region each.
func ExampleRelease() {
	q := amqpsubtest.NewQueue()
	for i, region := range []string{"eu", "us", "eu", "us"} {
		m := amqpsubtest.Message("", fmt.Sprint(i))
		m.ApplicationProperties = map[string]any{"region": region}
		q.Publish(m)
	}
	var mu sync.Mutex
	handled := map[string][]string{}
	replica := func(region string) *amqpsub.Subscriber {
		sub, _ := amqpsub.New(q.Connector(), "orders", amqpsub.HandlerFunc(func(ctx context.Context, d *amqpsub.Delivery) error {
			if d.ApplicationProperties()["region"] != region {
				return amqpsub.Release() // not mine: back to the queue, not counted
			}
			body, _ := d.Body()
			mu.Lock()
			handled[region] = append(handled[region], string(body))
			mu.Unlock()
			return nil
		}))
		return sub
	}
	eu := replica("eu")
	ctx, stop := context.WithCancel(context.Background())
	ran := make(chan error, 1)
	go func() { ran <- eu.Run(ctx) }()
	consume(q, replica("us"))
	stop()
	if err := <-ran; err != nil {
		fmt.Println(err)
	}
	slices.Sort(handled["eu"])
	slices.Sort(handled["us"])
	fmt.Println("eu", handled["eu"], "us", handled["us"])
	// Output: eu [0 2] us [1 3]
}

// Four lanes: each customer's orders (the AMQP group-id) run one at a
// time, in order, and up to four customers run side by side.
func ExampleWorkersByKey() {
	q := amqpsubtest.NewQueue()
	for i := 1; i <= 3; i++ {
		for _, customer := range []string{"alice", "bob", "carol"} {
			q.Publish(amqpsubtest.Message(customer, fmt.Sprint(i)))
		}
	}
	var mu sync.Mutex
	seen := map[string][]string{}
	h := amqpsub.HandlerFunc(func(ctx context.Context, d *amqpsub.Delivery) error {
		body, _ := d.Body()
		mu.Lock()
		defer mu.Unlock()
		seen[d.GroupID()] = append(seen[d.GroupID()], string(body))
		return nil
	})
	sub, _ := amqpsub.New(q.Connector(), "orders", h, amqpsub.WorkersByKey(4))
	consume(q, sub)
	for _, customer := range []string{"alice", "bob", "carol"} {
		fmt.Println(customer, seen[customer])
	}
	// Output:
	// alice [1 2 3]
	// bob [1 2 3]
	// carol [1 2 3]
}

// Up to eight handlers at once, with no order between deliveries: for
// independent work.
func ExampleWorkers() {
	q := amqpsubtest.NewQueue()
	for _, name := range []string{"e.png", "b.png", "d.png", "a.png", "c.png"} {
		q.Publish(amqpsubtest.Message("", name))
	}
	var mu sync.Mutex
	var done []string
	h := amqpsub.HandlerFunc(func(ctx context.Context, d *amqpsub.Delivery) error {
		body, _ := d.Body()
		mu.Lock()
		defer mu.Unlock()
		done = append(done, string(body)) // in any order
		return nil
	})
	sub, _ := amqpsub.New(q.Connector(), "thumbnails", h, amqpsub.Workers(8))
	consume(q, sub)
	slices.Sort(done)
	fmt.Println(done)
	// Output: [a.png b.png c.png d.png e.png]
}

// Batches for one round trip per batch, with an outcome per delivery.
// Batches close at their size or their wait after their first delivery;
// something like Batch(500, 50*time.Millisecond) in production. Here the
// wait is long, so that every batch is full and the output the same on
// every run.
func ExampleNewBatch() {
	q := amqpsubtest.NewQueue()
	for _, body := range []string{`{"amount": 1}`, `{"amount": 2}`, `{"amount":`, `{"amount": 4}`} {
		q.Publish(amqpsubtest.Message("", body))
	}
	h := amqpsub.BatchHandlerFunc(func(ctx context.Context, batch []*amqpsub.Delivery) []error {
		results := make([]error, len(batch))
		rows := 0
		for i, d := range batch {
			var o order
			body, _ := d.Body()
			if err := json.Unmarshal(body, &o); err != nil {
				results[i] = amqpsub.Reject("malformed order")
				continue
			}
			rows++
		}
		fmt.Printf("batch of %d: %d rows inserted\n", len(batch), rows)
		return results // nil entries accept
	})
	sub, err := amqpsub.NewBatch(q.Connector(), "orders", h, amqpsub.Batch(2, time.Minute))
	if err != nil {
		log.Fatal(err)
	}
	consume(q, sub)
	fmt.Println(q.DeadLetters())
	// Output:
	// batch of 2: 2 rows inserted
	// batch of 2: 1 rows inserted
	// [#2: 0 rejected "malformed order" → dead-lettered]
}

// A failure retried in the lane, up to 3 times, 1 ms apart and doubling.
// The lane waits meanwhile, so alice's second order does not overtake her
// first, which a redelivery by the broker would let it do. What still fails
// goes back to the broker as a Retry.
func ExampleLocalRetry() {
	q := amqpsubtest.NewQueue()
	q.Publish(amqpsubtest.Message("alice", "order 1"), amqpsubtest.Message("alice", "order 2"))
	failures := 2
	h := amqpsub.HandlerFunc(func(ctx context.Context, d *amqpsub.Delivery) error {
		body, _ := d.Body()
		if failures > 0 {
			failures--
			fmt.Println(string(body), "failed")
			return errors.New("store unavailable")
		}
		fmt.Println(string(body), "done")
		return nil
	})
	sub, _ := amqpsub.New(q.Connector(), "orders", h, amqpsub.WorkersByKey(4),
		amqpsub.LocalRetry(amqpsub.RetryPolicy{Attempts: 3, Initial: time.Millisecond, Max: 10 * time.Millisecond}))
	consume(q, sub)
	printRecords(q) // the broker saw no failure
	// Output:
	// order 1 failed
	// order 1 failed
	// order 1 done
	// order 2 done
	// #0 group alice: 0 accepted → consumed
	// #1 group alice: 0 accepted → consumed
}

// A poison-message limit for brokers without max-delivery-attempts: a
// delivery whose count is past 2 is rejected before the handler sees it.
func ExampleMaxDeliveryCount() {
	q := amqpsubtest.NewQueue(amqpsubtest.MaxDeliveryAttempts(0)) // a broker that never dead-letters
	q.Publish(amqpsubtest.Message("", "poison"))
	h := amqpsub.HandlerFunc(func(ctx context.Context, d *amqpsub.Delivery) error {
		fmt.Println("delivery count", d.DeliveryCount())
		return errors.New("always fails")
	})
	sub, _ := amqpsub.New(q.Connector(), "orders", h, amqpsub.WithProfile(amqpsub.Generic), amqpsub.MaxDeliveryCount(2))
	consume(q, sub)
	fmt.Println(q.DeadLetters()[0].Reason())
	// Output:
	// delivery count 0
	// delivery count 1
	// delivery count 2
	// amqpsub: delivery count 3 is past the limit 2
}

// Hear of handler failures and panics, lost links and reconnects: to count
// them, or alert. Events come in order, on a goroutine of their own.
func ExampleOnEvent() {
	q := amqpsubtest.NewQueue()
	q.Publish(amqpsubtest.Message("alice", "1"))
	calls := 0
	h := amqpsub.HandlerFunc(func(ctx context.Context, d *amqpsub.Delivery) error {
		switch calls++; calls {
		case 1:
			panic("nil map")
		case 2:
			return errors.New("store unavailable")
		}
		return nil
	})
	sub, _ := amqpsub.New(q.Connector(), "orders", h, amqpsub.OnEvent(func(e amqpsub.Event) {
		fmt.Println(e.Kind, e.GroupID, e.DeliveryCount, e.Err)
	}))
	consume(q, sub)
	// Output:
	// handler-panicked alice 0 amqpsub: handler panicked: nil map
	// handler-failed alice 0 amqpsub: handler panicked: nil map
	// handler-failed alice 1 store unavailable
}

// Stop from elsewhere: Shutdown starts a graceful stop and waits for Run,
// up to its ctx (here the grace period and the default CloseTimeout of 5 s,
// with room). Its error says only whether the stop finished in that time;
// Run's error says how the stop went.
func ExampleSubscriber_Shutdown() {
	q := amqpsubtest.NewQueue()
	q.Publish(amqpsubtest.Message("", "1"), amqpsubtest.Message("", "2"))
	h := amqpsub.HandlerFunc(func(ctx context.Context, d *amqpsub.Delivery) error { return nil })
	sub, _ := amqpsub.New(q.Connector(), "orders", h, amqpsub.GracePeriod(30*time.Second))
	ran := make(chan error, 1)
	go func() { ran <- sub.Run(context.Background()) }()

	_ = q.Wait(context.Background()) // later: time to stop
	ctx, cancel := context.WithTimeout(context.Background(), 40*time.Second)
	defer cancel()
	if err := sub.Shutdown(ctx); err != nil {
		fmt.Println("the stop goes on in the background:", err)
	}
	if err := <-ran; err != nil {
		fmt.Println("Run:", err) // such as ErrAbandoned: handlers outlasted the grace period
	}
	fmt.Println("held", sub.Stats().Held, "accepted", sub.Stats().Settled.Accepted)
	// Output: held 0 accepted 2
}

// Close stops at once: the handlers' ctx is cancelled and nothing more is
// settled, so the broker delivers again what the subscriber held. A handler
// doing long work should watch its ctx.
func ExampleSubscriber_Close() {
	q := amqpsubtest.NewQueue()
	q.Publish(amqpsubtest.Message("", "a long job"))
	started := make(chan struct{})
	h := amqpsub.HandlerFunc(func(ctx context.Context, d *amqpsub.Delivery) error {
		close(started)
		<-ctx.Done() // the long job, cut short
		fmt.Println("handler:", ctx.Err())
		return ctx.Err()
	})
	sub, _ := amqpsub.New(q.Connector(), "jobs", h)
	ran := make(chan error, 1)
	go func() { ran <- sub.Run(context.Background()) }()

	<-started
	_ = sub.Close()
	if err := <-ran; err != nil {
		fmt.Println("Run:", err)
	}
	fmt.Println("the job is", q.Records()[0].State)
	// Output:
	// handler: context canceled
	// the job is queued
}

// The counters on one line, for a log; the fields for metrics. Credit(1)
// makes MaxHeld the same on every run.
func ExampleSubscriber_Stats() {
	q := amqpsubtest.NewQueue()
	q.Publish(amqpsubtest.Message("", "ok"), amqpsubtest.Message("", "bad"), amqpsubtest.Message("", "flaky"))
	flaky := 1
	h := amqpsub.HandlerFunc(func(ctx context.Context, d *amqpsub.Delivery) error {
		switch body, _ := d.Body(); string(body) {
		case "bad":
			return amqpsub.Reject("malformed")
		case "flaky":
			if flaky > 0 {
				flaky--
				return errors.New("timeout")
			}
		}
		return nil
	})
	sub, _ := amqpsub.New(q.Connector(), "orders", h, amqpsub.Credit(1))
	consume(q, sub)
	st := sub.Stats()
	fmt.Println(st)
	fmt.Println("accepted", st.Settled.Accepted, "retried", st.Results.Retry, "rejected", st.Results.Reject)
	// Output:
	// held=0 max=1 (buffered=0 handling=0 settling=0) longest_lane=0 received=4 settled(acc/rel/mod/rej)=2/0/1/1 results(acc/rel/retry/rej)=2/0/1/1
	// accepted 2 retried 1 rejected 1
}

// The credit adapts by default: with 4 lanes blocked on slow work, the
// subscriber holds what those lanes will start soon, not the whole
// Credit. FixedCredit holds all of it, as a lone consumer draining a
// backlog may want.
func ExampleFixedCredit() {
	for _, opts := range [][]amqpsub.Option{nil, {amqpsub.FixedCredit()}} {
		q := amqpsubtest.NewQueue()
		for range 100 {
			q.Publish(amqpsubtest.Message("", "x"))
		}
		started := make(chan struct{}, 100)
		release := make(chan struct{})
		sub, _ := amqpsub.New(q.Connector(), "orders", amqpsub.HandlerFunc(func(ctx context.Context, d *amqpsub.Delivery) error {
			started <- struct{}{}
			<-release
			return nil
		}), append(opts, amqpsub.Workers(4), amqpsub.Credit(64))...)
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() { done <- sub.Run(ctx) }()
		for range 4 {
			<-started
		}
		// The four handlers are running; wait for the credit to be spent.
		want := 64
		if opts == nil {
			want = 4
		}
		for sub.Stats().Held != want {
			time.Sleep(time.Millisecond)
		}
		st := sub.Stats()
		fmt.Printf("credit %d of %d, held %d\n", st.Credit, st.CreditLimit, st.Held)
		close(release)
		cancel()
		<-done
	}
	// Output:
	// credit 4 of 64, held 4
	// credit 64 of 64, held 64
}

// RabbitMQ 3.10 (with the rabbitmq_amqp1_0 plugin; the queue "orders" is
// consumed as /amq/queue/orders). Retry is settled as released, since
// RabbitMQ 3.10 ends the session on modified: the broker counts nothing
// (delivery count 0 always; first-acquirer false on a redelivery) and never
// dead-letters a failing message, so bound retries yourself, with
// LocalRetry and a Reject after it, say. Against the broker:
// amqpsub.Dial("amqp://guest:guest@127.0.0.1:5672", nil).
func ExampleRabbitMQ3() {
	q := amqpsubtest.NewQueue(amqpsubtest.WithProfile(amqpsub.RabbitMQ3))
	q.Publish(amqpsubtest.Message("", "1"))
	failures := 2
	h := amqpsub.HandlerFunc(func(ctx context.Context, d *amqpsub.Delivery) error {
		fmt.Println("delivery count", d.DeliveryCount(), "first acquirer", d.FirstAcquirer())
		if failures > 0 {
			failures--
			return errors.New("timeout")
		}
		return nil
	})
	sub, _ := amqpsub.New(q.Connector(), "orders", h, amqpsub.WithProfile(amqpsub.RabbitMQ3))
	consume(q, sub)
	printRecords(q)
	// Output:
	// delivery count 0 first acquirer true
	// delivery count 0 first acquirer false
	// delivery count 0 first acquirer false
	// #0: 0 released, 0 released, 0 accepted → consumed
}

// RabbitMQ 4 treats a return by the queue's type, which the subscriber
// reads from the broker at each attach. On a quorum queue (here, as
// amqpsubtest plays one) Retry is counted in the delivery-count, and a
// Reject keeps its reason on the dead letter. On a classic queue nothing
// is counted, so MaxDeliveryCount is refused there. Against the broker:
// amqpsub.Dial("amqp://guest:guest@127.0.0.1:5672", nil), the queue a
// name or a /queues/... address.
func ExampleRabbitMQ4() {
	q := amqpsubtest.NewQueue(amqpsubtest.WithProfile(amqpsub.RabbitMQ4))
	q.Publish(amqpsubtest.Message("", "1"), amqpsubtest.Message("", "oops"))
	failures := 1
	h := amqpsub.HandlerFunc(func(ctx context.Context, d *amqpsub.Delivery) error {
		body, _ := d.Body()
		fmt.Println("delivery count", d.DeliveryCount(), "of", string(body))
		if string(body) == "oops" {
			return amqpsub.Reject("not a number")
		}
		if failures > 0 {
			failures--
			return errors.New("timeout")
		}
		return nil
	})
	sub, _ := amqpsub.New(q.Connector(), "orders", h, amqpsub.WithProfile(amqpsub.RabbitMQ4))
	consume(q, sub)
	printRecords(q)
	fmt.Println("reason kept:", q.Records()[1].Reason())

	classic := amqpsubtest.NewQueue(amqpsubtest.WithProfile(amqpsub.RabbitMQ4), amqpsubtest.WithQueueType(amqpsubtest.Classic))
	sub, _ = amqpsub.New(classic.Connector(), "orders", h, amqpsub.WithProfile(amqpsub.RabbitMQ4), amqpsub.MaxDeliveryCount(5))
	err := sub.Run(context.Background())
	fmt.Println("classic queue, MaxDeliveryCount:", errors.Is(err, amqpsub.ErrInvalidOption))
	// Output:
	// delivery count 0 of 1
	// delivery count 1 of 1
	// delivery count 0 of oops
	// #0: 0 modified{delivery-failed}, 1 accepted → consumed
	// #1: 0 modified{delivery-failed, undeliverable-here} "not a number" → dead-lettered
	// reason kept: not a number
	// classic queue, MaxDeliveryCount: true
}

// BalanceKeys keeps each customer's orders in order, like WorkersByKey
// alone, but ties a customer to a lane only while the lane has one of its
// orders: a slow or busy customer holds back no other, and the customers
// spread over the lanes by load rather than by hash.
func ExampleBalanceKeys() {
	q := amqpsubtest.NewQueue()
	for i := 1; i <= 3; i++ {
		for _, customer := range []string{"alice", "bob", "carol"} {
			q.Publish(amqpsubtest.Message(customer, fmt.Sprint(i)))
		}
	}
	var mu sync.Mutex
	seen := map[string][]string{}
	h := amqpsub.HandlerFunc(func(ctx context.Context, d *amqpsub.Delivery) error {
		body, _ := d.Body()
		mu.Lock()
		defer mu.Unlock()
		seen[d.GroupID()] = append(seen[d.GroupID()], string(body))
		return nil
	})
	sub, _ := amqpsub.New(q.Connector(), "orders", h, amqpsub.WorkersByKey(4), amqpsub.BalanceKeys())
	consume(q, sub)
	for _, customer := range []string{"alice", "bob", "carol"} {
		fmt.Println(customer, seen[customer])
	}
	// Output:
	// alice [1 2 3]
	// bob [1 2 3]
	// carol [1 2 3]
}

// Memory bounded in bytes as well as in deliveries: MaxHeldBytes stops
// granting credit while the bodies held reach 64 MiB (one delivery always
// flows), and MaxMessageSize refuses bodies over 16 MiB before a handler
// sees them: the broker dead-letters them, Stats counts them.
func ExampleMaxMessageSize() {
	q := amqpsubtest.NewQueue()
	q.Publish(amqpsubtest.Message("", "small"))
	q.Publish(amqp.NewMessage(make([]byte, 17<<20))) // 17 MiB
	h := amqpsub.HandlerFunc(func(ctx context.Context, d *amqpsub.Delivery) error {
		body, _ := d.Body()
		fmt.Printf("handled %d bytes\n", len(body))
		return nil
	})
	sub, _ := amqpsub.New(q.Connector(), "blobs", h,
		amqpsub.Credit(16), amqpsub.MaxHeldBytes(64<<20), amqpsub.MaxMessageSize(16<<20))
	consume(q, sub)
	fmt.Println("refused as too large:", sub.Stats().Results.Oversize)
	// Output:
	// handled 5 bytes
	// refused as too large: 1
}

// Azure Service Bus: the connector takes a connection string (SAS key or
// token, optional EntityPath, which admits that entity, a topic's
// subscriptions and their dead-letter queues; UseDevelopmentEmulator=true
// for the emulator) and gets CBS tokens itself; the subscriber uses peek-lock and
// renews the lock of every delivery it holds. Retry abandons (counted
// towards MaxDeliveryCount), RejectWith dead-letters with a reason and a
// description.
func ExampleServiceBus() {
	conn, err := amqpsub.ServiceBus(os.Getenv("SERVICEBUS_CONNECTION_STRING"))
	if err != nil {
		log.Fatal(err) // the error names a missing key, never the key itself
	}
	h := amqpsub.HandlerFunc(func(ctx context.Context, d *amqpsub.Delivery) error {
		var order struct{ ID string }
		body, err := d.Body()
		if err != nil || json.Unmarshal(body, &order) != nil {
			return amqpsub.RejectWith("malformed order", fmt.Sprint(err))
		}
		return nil
	})
	sub, err := amqpsub.New(conn, "orders", h, amqpsub.WorkersByKey(8))
	if err != nil {
		log.Fatal(err)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	if err := sub.Run(ctx); err != nil {
		log.Fatal(err)
	}
}
