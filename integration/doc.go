// Package integration holds amqpsub's tests against real brokers: Apache
// Artemis (AMQPSUB_ARTEMIS_URL), RabbitMQ 3.10 (AMQPSUB_RABBITMQ_URL) and
// RabbitMQ 4 (AMQPSUB_RABBITMQ4_URL, AMQPSUB_RABBITMQ4_CTL). Without those
// variables the tests skip and say how to start the brokers:
//
//	bash integration/artemis.sh start    # amqp://127.0.0.1:5672
//	bash integration/rabbitmq.sh start   # amqp://guest:guest@127.0.0.1:5682
//	bash integration/rabbitmq4.sh start  # amqp://guest:guest@127.0.0.1:5692
//
// `make test` starts them and sets the variables. The cluster and HA tests
// start their own brokers with integration/artemis-cluster.sh
// (AMQPSUB_CLUSTER_CTL).
package integration
