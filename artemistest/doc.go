// Package artemistest starts an Apache ActiveMQ Artemis broker for Go
// tests and hands back its AMQP URL: a real broker, empty, with its own
// ports and files, stopped and removed when the test ends.
//
//	func TestOrders(t *testing.T) {
//		b := artemistest.Start(t)
//		sub, err := amqpsub.New(amqpsub.Dial(b.URL(), nil), "orders", handler)
//		...
//	}
//
// Start fails the test if the broker cannot start and stops it in
// t.Cleanup. Run does the same for TestMain and other code without a
// testing.TB; its caller calls [Broker.Stop].
//
// # Two ways to run Artemis
//
// In mode [Auto] (the default), [Run] probes for a Docker engine (DOCKER_HOST,
// else testcontainers' properties and the usual sockets; at most 2 s, and
// at once when there is no socket) and then:
//
//   - with an engine, runs the official image apache/activemq-artemis
//     (tag: the Artemis version, 2.40.0) through testcontainers-go, with
//     its ports published on 127.0.0.1 (of a local engine);
//   - without one, runs the Artemis distribution as a local process, as
//     amqpsub's scripts do: downloaded once with Maven
//     (org.apache.activemq:apache-artemis:2.40.0:tar.gz:bin) into the
//     cache dir (~/.cache/amqpsub, shared with the scripts), a fresh
//     instance per broker (`artemis create`) in a temporary directory,
//     `bin/artemis run` listening on 127.0.0.1 only, on free ports, with
//     a heap of 512M at most, and stopped by PID (SIGTERM, then SIGKILL).
//
// WithMode([Local]) or WithMode([Container]) forces one. The local path needs
// Java 17 or later and, for the first download only, Maven; it runs on
// Unix. Brokers are independent: tests may start several, in parallel.
//
// amqpsub's CI has no Docker engine. It runs the local-process path, and
// compiles the container path, but never runs a container: that path is
// not exercised by amqpsub's tests.
//
// # The broker
//
// [DefaultBrokerXML] is the configuration: amqpsub's own test settings
// (queues and addresses created on first use, anycast; dead letters of
// queue Q in DLQ::DLQ.Q; max-delivery-attempts 5), security on with one
// user (amqpsub/amqpsub by default; [WithCredentials]), no anonymous
// logins. [WithQueues], [WithAddress] and [WithDeadLetterQueues] declare
// queues ahead; [WithBrokerXML] replaces the whole file. [Broker.Publish]
// and [Broker.Receive] send messages to a queue and take them from one.
package artemistest
