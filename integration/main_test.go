package integration

import (
	"os"
	"testing"
)

// TestMain has two jobs. Run as a child of a fault test (AMQPSUB_CHILD set),
// the binary is a consumer process and never runs tests: the tests that need
// a consumer's own RSS, or one to SIGTERM, re-exec the test binary. Run as
// the test binary, it stops the dedicated broker of the fault tests, if one
// was started, once every test is done. Without AMQPSUB_ARTEMIS_URL nothing
// is started and the tests skip themselves.
func TestMain(m *testing.M) {
	if os.Getenv(childEnv) != "" {
		os.Exit(childMain())
	}
	code := m.Run()
	stopFaultBroker()
	os.Exit(code)
}
