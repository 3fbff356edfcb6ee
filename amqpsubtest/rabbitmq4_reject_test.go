package amqpsubtest_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"testing/synctest"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/amqpsub/amqpsub/amqpsub"
	"github.com/amqpsub/amqpsub/amqpsubtest"
)

// MaxMessageSize under RabbitMQ4 rejects with the reason code
// MaxMessageSizeExceeded and keeps its condition,
// amqp:link:message-size-exceeded, as elsewhere but on Service Bus.
func TestRabbitMQ4OversizeKeepsItsCondition(t *testing.T) {
	for _, typ := range []amqpsubtest.QueueType{amqpsubtest.Quorum, amqpsubtest.Classic} {
		t.Run(typ.String(), func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				q := rabbit4Queue(amqpsubtest.WithQueueType(typ))
				q.Publish(amqpsubtest.Message("", "a body much longer than ten bytes"))
				sub := rabbit4Sub(t, q, func(context.Context, *amqpsub.Delivery) error { return nil }, amqpsub.MaxMessageSize(10))
				drain(t, q, sub)
				r := q.Records()[0]
				cond := fmt.Sprint(r.Annotations[amqpsub.AnnotationDeadLetterCondition])
				if e := r.Deliveries[len(r.Deliveries)-1].Error; e != nil {
					cond = string(e.Condition)
				}
				t.Logf("%s: %s; condition %q reason %q", typ, r, cond, r.Reason())
				if cond != "amqp:link:message-size-exceeded" {
					t.Errorf("%s queue: oversize dead letter's condition %q, want amqp:link:message-size-exceeded as documented", typ, cond)
				}
			})
		})
	}
}

// "an option does not fit the queue" is logged for a queue found at odds
// with an option at the first attach only, not for every ErrInvalidOption
// (a Service Bus TokenProvider's token without Expiry wraps it too).
func TestOnlyAQueueMismatchIsLoggedAsOne(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		q := amqpsubtest.NewQueue()
		q.RefuseAttach(fmt.Errorf("the TokenProvider gave a \"jwt\" token with no Expiry: %w", amqpsub.ErrInvalidOption))
		core, logs := observer.New(zap.InfoLevel)
		sub := newSub(t, q, func(context.Context, *amqpsub.Delivery) error { return nil }, amqpsub.Logger(zap.New(core)))
		err := sub.Run(t.Context())
		if !errors.Is(err, amqpsub.ErrInvalidOption) {
			t.Fatalf("Run = %v", err)
		}
		for _, e := range logs.All() {
			t.Logf("%s %q %v", e.Level, e.Message, e.ContextMap())
			if e.Message == "an option does not fit the queue; stopping" {
				t.Errorf("a token without Expiry logged as %q", e.Message)
			}
		}
	})
}
