package driver_test

import (
	"go.uber.org/zap"

	"github.com/amqpsub/amqpsub/internal/driver"
)

// env is a pipe's environment with MaxDeliveryCount max.
type env struct{ max int }

func (env) Log() *zap.Logger        { return zap.NewNop() }
func (env) Queue() string           { return "q" }
func (e env) MaxDeliveryCount() int { return e.max }

// queue is a test source that plays a RabbitMQ 4 queue of type typ.
type queue struct {
	driver.Source
	typ   string
	limit int64
}

func (q queue) RabbitMQQueue() (string, int64) { return q.typ, q.limit }
