package amqpsub

import "github.com/amqpsub/amqpsub/internal/driver/rabbitmq3"

// RabbitMQ3 is for RabbitMQ 3.x with the rabbitmq_amqp1_0 plugin. A
// queue name q is addressed as /amq/queue/q (the queue must exist); a
// name that already starts with "/" is used as it is. Retry is settled as
// released, since RabbitMQ 3.10 ends the whole session on modified, so
// the broker does not count the attempt (and sends delivery-count 0
// always). Credit is granted in windows, because the broker sends past
// its credit. The link is never detached (RabbitMQ 3.10 does not answer
// a detach): the session is closed instead.
var RabbitMQ3 = newProfile(rabbitmq3.New(RejectCondition))

func init() { known = append(known, RabbitMQ3) }
