// Package publish sends the messages of our examples, tests and benchmarks
// to a broker quickly: every message pre-settled but the last of each link,
// which is sent unsettled, so that its acceptance says everything the link
// sent before it reached the broker (a link keeps its order).
package publish

import (
	"context"
	"errors"
	"fmt"
	"sync"

	"github.com/Azure/go-amqp"
)

// Target is where messages go.
type Target struct {
	// Address is the sender's target address.
	Address string
	// Capabilities are the sender's target capabilities: "queue" on
	// Artemis, so that the address names an anycast queue.
	Capabilities []string
	// Durability is the target terminus durability; RabbitMQ 3.10 creates
	// a /queue/NAME queue durable only if the link asks.
	Durability amqp.Durability
}

// Send sends messages msg(0) … msg(n-1) to t over links senders, each on a
// session of its own (sender l sends l, l+links, l+2·links, …), and returns
// once the broker has taken them all, or the first error. msg is called
// from several goroutines at once.
func Send(ctx context.Context, conn *amqp.Conn, t Target, links, n int, msg func(i int) *amqp.Message) error {
	links = max(1, min(links, n))
	errs := make([]error, links)
	var wg sync.WaitGroup
	for l := range links {
		wg.Go(func() { errs[l] = sendLink(ctx, conn, t, l, links, n, msg) })
	}
	wg.Wait()
	return errors.Join(errs...)
}

func sendLink(ctx context.Context, conn *amqp.Conn, t Target, first, step, n int, msg func(i int) *amqp.Message) error {
	sess, err := conn.NewSession(ctx, nil)
	if err != nil {
		return fmt.Errorf("publish: session: %w", err)
	}
	// Closing the session ends the link too; RabbitMQ 3.10 never answers
	// a link detach, so the sender is not closed on its own.
	defer func() {
		cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5e9)
		defer cancel()
		_ = sess.Close(cctx)
	}()
	mode := amqp.SenderSettleModeMixed
	snd, err := sess.NewSender(ctx, t.Address, &amqp.SenderOptions{
		SettlementMode:     &mode,
		TargetCapabilities: t.Capabilities,
		TargetDurability:   t.Durability,
	})
	if err != nil {
		return fmt.Errorf("publish: sender on %s: %w", t.Address, err)
	}
	settled := &amqp.SendOptions{Settled: true}
	for i := first; i < n; i += step {
		opts := settled
		if i+step >= n {
			opts = nil // the last of this link: wait for its acceptance
		}
		if err := snd.Send(ctx, msg(i), opts); err != nil {
			return fmt.Errorf("publish: send %d to %s: %w", i, t.Address, err)
		}
	}
	return nil
}
