package integration

import (
	"context"
	"os"
	"os/exec"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/Azure/go-amqp"
)

// Helpers for RabbitMQ 4: the broker script, its queues.

// rabbit4URL returns the URL of the RabbitMQ 4 broker of
// integration/rabbitmq4.sh or skips the test.
func rabbit4URL(t testing.TB) string {
	t.Helper()
	u := os.Getenv("AMQPSUB_RABBITMQ4_URL")
	if u == "" {
		t.Skip("no RabbitMQ 4 configured (AMQPSUB_RABBITMQ4_URL is empty): start it with " +
			"`bash integration/rabbitmq4.sh start`, then set AMQPSUB_RABBITMQ4_URL=amqp://guest:guest@127.0.0.1:5692 " +
			"and AMQPSUB_RABBITMQ4_CTL=$PWD/integration/rabbitmq4.sh; `make test` does both")
	}
	return u
}

// rabbit4Ctl returns the path of integration/rabbitmq4.sh
// (AMQPSUB_RABBITMQ4_CTL) or skips the test.
func rabbit4Ctl(t testing.TB) string {
	t.Helper()
	ctl := os.Getenv("AMQPSUB_RABBITMQ4_CTL")
	if ctl == "" {
		t.Skip("AMQPSUB_RABBITMQ4_CTL is empty: set it to the path of integration/rabbitmq4.sh; `make test` does")
	}
	return ctl
}

// rabbit4 runs `rabbitmq4.sh ARGS...` and returns its standard output,
// trimmed; it fails the test if the script fails.
func rabbit4(t testing.TB, args ...string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, "bash", append([]string{rabbit4Ctl(t)}, args...)...)
	var stderr strings.Builder
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("rabbitmq4.sh %s: %v: %s", strings.Join(args, " "), err, stderr.String())
	}
	return strings.TrimSpace(string(out))
}

// rabbit4Unsafe is what rabbitmq4.sh refuses in a queue name.
var rabbit4Unsafe = regexp.MustCompile(`[^A-Za-z0-9._:-]`)

// declareRabbit4 declares a fresh durable queue of kind "classic" or
// "quorum" on RabbitMQ 4 with `rabbitmq4.sh declare`: its dead letters go
// to the classic queue NAME.dlq, declared with it (a quorum queue keeps the
// broker's delivery-limit, 20). Both are deleted when the test ends. Attach
// to "/queues/"+NAME.
func declareRabbit4(t testing.TB, kind string) string {
	t.Helper()
	name := rabbit4Unsafe.ReplaceAllString(queueName(t), "_")
	rabbit4(t, "declare", name, kind)
	t.Cleanup(func() { rabbit4(t, "delete", name) })
	return name
}

// rabbit4Count returns the number of messages ready in queue on RabbitMQ 4.
func rabbit4Count(t testing.TB, queue string) int {
	t.Helper()
	out := rabbit4(t, "count", queue)
	n, err := strconv.Atoi(out)
	if err != nil {
		t.Fatalf("rabbitmq4.sh count %s: not a number: %q", queue, out)
	}
	return n
}

var rabbit4Kinds = []string{"classic", "quorum"}

// r4publish publishes msgs (and publishFast's barrier) to queue q.
func r4publish(t testing.TB, conn *amqp.Conn, q string, msgs []msgSpec) {
	t.Helper()
	publishFast(t, conn, "/queues/"+q, false, msgs)
}
