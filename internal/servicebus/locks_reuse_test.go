package servicebus_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/Azure/go-amqp"
	"github.com/amqpsub/amqpsub/internal/fake"
	"github.com/amqpsub/amqpsub/internal/servicebus"
	"github.com/amqpsub/amqpsub/pump"
)

// The book reports lost locks after it let go of its mutex, so a ticket
// it reports may name an entry that holds the next delivery by then (two
// locks expire in one round; while the book reports the first, the second's
// handler settles and its entry is reused). OnLost gets the message as it
// entered the book, and LoseLock reports that the ticket is stale, so that
// amqpsub never names a delivery whose lock is fine.
func TestOnLostNamesTheMessageThatLostItsLock(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		svc := newService(2 * time.Second)
		src := fake.New(true, svc.message(0), svc.message(1))
		var p *pump.Pump
		var mu sync.Mutex
		tickets := map[int]pump.Ticket{}
		var reported []string
		first := true
		cfg := servicebus.BookConfig{Renewer: svc, MaxRenewal: time.Nanosecond}
		cfg.OnLost = func(tk pump.Ticket, m *amqp.Message, _ error) {
			mu.Lock()
			defer mu.Unlock()
			if first {
				first = false
				// While the book reports this one, the other's handler
				// returns and the pump reuses its entry for message 100.
				for i, other := range tickets {
					if other != tk {
						p.Settle(other, pump.Outcome{Kind: pump.Accept})
						src.Push(svc.message(100))
						next := <-p.Out()
						tickets[100] = next
						_ = i
					}
				}
			}
			// What amqpsub's pipe.lockLost reports.
			if p.LoseLock(tk) {
				reported = append(reported, fmt.Sprint(m.Value))
			}
		}
		book := servicebus.NewBook(cfg)
		p = pump.New(pump.Config{Credit: 256, Leases: book})
		ctx, cancel := context.WithCancel(context.Background())
		var wg sync.WaitGroup
		wg.Go(func() { _ = p.Run(ctx, func(context.Context, error) (pump.Source, error) { return src, nil }) })
		wg.Go(func() { book.Run(ctx) })
		for range 2 {
			tk := <-p.Out()
			tk.Begin()
			book.Bind(tk, func(error) {})
			mu.Lock()
			tickets[tk.Message().Value.(int)] = tk
			mu.Unlock()
		}
		time.Sleep(3 * time.Second) // both locks expire unrenewed (MaxRenewal)
		synctest.Wait()
		cancel()
		wg.Wait()
		mu.Lock()
		defer mu.Unlock()
		t.Logf("lock lost reported for messages %v; book stats %+v", reported, book.Stats())
		// Two locks lost; the second's entry was reused before the book
		// reported it, so only the first is reported.
		if len(reported) != 1 {
			t.Fatalf("lock losses reported for %v; want only the first of the two", reported)
		}
		for _, r := range reported {
			if r != "0" && r != "1" {
				t.Fatalf("a lock loss reported for message %s, delivered after the loss and holding a live lock: reported %v", r, reported)
			}
		}
	})
}
