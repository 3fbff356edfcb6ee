// Package sbconformance checks the scripted Service Bus peer
// (integration/sbpeer) against the official Go client,
// github.com/Azure/azure-sdk-for-go/sdk/messaging/azservicebus.
//
// The peer is written by the same hands as amqpsub's Service Bus support,
// so it could share the library's mistakes. These tests drive it with the
// SDK over an emulator connection string; where the SDK and the peer
// disagree, the peer is wrong. The module is separate from amqpsub's so
// that the library's go.mod never grows the Azure SDK.
//
// The tests read AMQPSUB_SBPEER_CONN (the connection string `sbpeer.sh url`
// prints) and AMQPSUB_SBPEER_CONTROL (the peer's control URL, `sbpeer.sh
// ctl-url`) and skip without them. cmd/sbsend is a producer CLI built on the
// SDK, for amqpsub's own integration tests.
package sbconformance
