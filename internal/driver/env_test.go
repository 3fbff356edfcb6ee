package driver_test

import (
	"go.uber.org/zap"

	"github.com/amqpsub/amqpsub/internal/driver"
)

// env is a pipe's environment for queue "q" with MaxDeliveryCount max.
// It plays only what RabbitMQ 4's pipe reads: any other call panics on the
// nil PipeEnv.
type env struct {
	driver.PipeEnv
	max int
}

func (env) Log() *zap.Logger { return zap.NewNop() }
func (e env) Config() driver.PipeConfig {
	return driver.PipeConfig{Queue: "q", Address: "/queues/q", MaxDeliveryCount: e.max}
}

// queue is a test source that plays a RabbitMQ 4 queue of type typ.
type queue struct {
	driver.Source
	typ   string
	limit int64
}

func (q queue) RabbitMQQueue() (string, int64) { return q.typ, q.limit }
