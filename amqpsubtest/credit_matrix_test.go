package amqpsubtest_test

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/amqpsub/amqpsub/amqpsub"
	"github.com/amqpsub/amqpsub/amqpsubtest"
)

func TestAdaptiveCreditDrainsInEveryShape(t *testing.T) {
	type tc struct {
		name    string
		opts    []amqpsub.Option
		batch   bool
		profile *amqpsub.Profile
		groups  int
		lose    bool
		fail    bool // first attempt of every 7th fails
	}
	rmq := amqpsub.RabbitMQ3
	cases := []tc{
		{name: "credit1-w4", opts: []amqpsub.Option{amqpsub.Credit(1), amqpsub.Workers(4)}},
		{name: "credit1-byKey4", opts: []amqpsub.Option{amqpsub.Credit(1), amqpsub.WorkersByKey(4)}, groups: 3},
		{name: "credit1-bal4", opts: []amqpsub.Option{amqpsub.Credit(1), amqpsub.WorkersByKey(4), amqpsub.BalanceKeys()}, groups: 3},
		{name: "bytes-tiny", opts: []amqpsub.Option{amqpsub.MaxHeldBytes(1), amqpsub.Workers(4)}},
		{name: "bytes-tiny-bal", opts: []amqpsub.Option{amqpsub.MaxHeldBytes(3), amqpsub.WorkersByKey(4), amqpsub.BalanceKeys()}, groups: 2},
		{name: "batch>credit", opts: []amqpsub.Option{amqpsub.Credit(3), amqpsub.Workers(2), amqpsub.Batch(10, 0)}, batch: true},
		{name: "batch>credit-wait", opts: []amqpsub.Option{amqpsub.Credit(3), amqpsub.Workers(2), amqpsub.Batch(10, time.Second)}, batch: true},
		{name: "batch-bal", opts: []amqpsub.Option{amqpsub.Credit(16), amqpsub.WorkersByKey(3), amqpsub.BalanceKeys(), amqpsub.Batch(5, 10*time.Millisecond)}, batch: true, groups: 2},
		{name: "batch-byKey", opts: []amqpsub.Option{amqpsub.Credit(16), amqpsub.WorkersByKey(3), amqpsub.Batch(5, 10*time.Millisecond)}, batch: true, groups: 2},
		{name: "batch-bal-keyless", opts: []amqpsub.Option{amqpsub.Credit(16), amqpsub.WorkersByKey(3), amqpsub.BalanceKeys(), amqpsub.Batch(5, 0)}, batch: true},
		{name: "localretry-bal", opts: []amqpsub.Option{amqpsub.WorkersByKey(4), amqpsub.BalanceKeys(), amqpsub.LocalRetry(amqpsub.RetryPolicy{Attempts: 3, Initial: 10 * time.Millisecond})}, groups: 2, fail: true},
		{name: "localretry-byKey", opts: []amqpsub.Option{amqpsub.WorkersByKey(4), amqpsub.LocalRetry(amqpsub.RetryPolicy{Attempts: 3, Initial: 10 * time.Millisecond})}, groups: 2, fail: true},
		{name: "lose", opts: []amqpsub.Option{amqpsub.Workers(4)}, lose: true},
		{name: "lose-bal", opts: []amqpsub.Option{amqpsub.WorkersByKey(4), amqpsub.BalanceKeys()}, lose: true, groups: 3},
		{name: "rmq3", opts: []amqpsub.Option{amqpsub.Workers(4), amqpsub.WithProfile(amqpsub.RabbitMQ3)}, profile: &rmq},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				var qo []amqpsubtest.Option
				if c.profile != nil {
					qo = append(qo, amqpsubtest.WithProfile(*c.profile))
				}
				q := amqpsubtest.NewQueue(qo...)
				const n = 300
				for i := range n {
					g := ""
					if c.groups > 0 {
						g = fmt.Sprint("g", i%c.groups)
					}
					q.Publish(amqpsubtest.Message(g, fmt.Sprint(i)))
				}
				var tries sync_map
				h := func(d *amqpsub.Delivery) error {
					time.Sleep(time.Millisecond)
					if c.fail && tries.first(text(d)) && len(text(d))%2 == 0 {
						return errors.New("once")
					}
					return nil
				}
				var sub *amqpsub.Subscriber
				var err error
				if c.batch {
					sub, err = amqpsub.NewBatch(q.Connector(), "orders", amqpsub.BatchHandlerFunc(func(ctx context.Context, b []*amqpsub.Delivery) []error {
						r := make([]error, len(b))
						for i, d := range b {
							r[i] = h(d)
						}
						return r
					}), c.opts...)
				} else {
					sub, err = amqpsub.New(q.Connector(), "orders", amqpsub.HandlerFunc(func(ctx context.Context, d *amqpsub.Delivery) error { return h(d) }), c.opts...)
				}
				if err != nil {
					t.Fatal(err)
				}
				stop := start(sub)
				if c.lose {
					go func() {
						for range 5 {
							time.Sleep(20 * time.Millisecond)
							q.LoseLinks(nil)
						}
					}()
				}
				ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
				defer cancel()
				err = q.Wait(ctx)
				st := sub.Stats()
				if err != nil {
					t.Errorf("not drained: %v; held %d credit %d/%d accepted %d", err, st.Held, st.Credit, st.CreditLimit, st.Settled.Accepted)
				}
				if err := stop(); err != nil && !errors.Is(err, context.Canceled) {
					t.Logf("stop: %v", err)
				}
				st = sub.Stats()
				if st.Held != 0 {
					t.Errorf("held %d after stop", st.Held)
				}
			})
		})
	}
}

type sync_map struct {
	m atomic.Pointer[map[string]bool]
}

func (s *sync_map) first(k string) bool {
	for {
		old := s.m.Load()
		nm := map[string]bool{}
		if old != nil {
			if (*old)[k] {
				return false
			}
			for kk, v := range *old {
				nm[kk] = v
			}
		}
		nm[k] = true
		if s.m.CompareAndSwap(old, &nm) {
			return true
		}
	}
}
