package artemistest

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net/netip"
	"strconv"
	"strings"
	"time"

	"github.com/moby/moby/api/types/container"
	"github.com/moby/moby/api/types/network"
	"github.com/testcontainers/testcontainers-go"
	"github.com/testcontainers/testcontainers-go/wait"
)

// The container path: the official image through testcontainers-go.
// amqpsub's CI has no Docker engine: this file is compiled and vetted
// there, and its probe (ErrNoDocker) is tested, but no container has run
// in CI. testcontainers-go's own Artemis module
// (modules/artemis) is not used: the Go module proxy that amqpsub
// builds from does not serve it, and it would add nothing but the
// image's environment variables, which are set here directly.

const (
	amqpPort = "5672/tcp"
	corePort = "61616/tcp"
	// instanceDir is where the official image creates its instance; it
	// copies etc-override/* into etc/ after `artemis create`.
	instanceDir = "/var/lib/artemis-instance"
)

type containerBroker struct {
	ctr  *testcontainers.DockerContainer
	logf func(string, ...any)
}

// tcLogger passes testcontainers' messages to WithLogf.
type tcLogger func(string, ...any)

func (l tcLogger) Printf(format string, args ...any) { l(format, args...) }

func runContainer(ctx context.Context, c *config, endpoint string) (b *Broker, err error) {
	defer func() {
		// testcontainers panics on some environment errors (no Docker
		// socket where its config points); report them as errors.
		if r := recover(); r != nil {
			b, err = nil, fmt.Errorf("artemistest: testcontainers: %v", r)
		}
	}()
	opts := []testcontainers.ContainerCustomizer{
		testcontainers.WithLogger(tcLogger(c.logf)),
		testcontainers.WithExposedPorts(amqpPort, corePort),
		testcontainers.WithEnv(map[string]string{
			"ARTEMIS_USER":     c.user,
			"ARTEMIS_PASSWORD": c.password,
			"ANONYMOUS_LOGIN":  "false", // --require-login
			// Replaces the image's default (a web console on 0.0.0.0).
			"EXTRA_ARGS":       "--no-web --no-autotune",
			"JAVA_ARGS_APPEND": jvmMemoryArgs(c.heap) + " -Damqpsub.host=0.0.0.0 -Damqpsub.port=5672 -Damqpsub.coreport=61616",
		}),
		testcontainers.WithFiles(testcontainers.ContainerFile{
			Reader:            bytes.NewReader(renderBrokerXML(c)),
			ContainerFilePath: instanceDir + "/etc-override/broker.xml",
			FileMode:          0o644,
		}),
		testcontainers.WithWaitStrategyAndDeadline(c.startTimeout,
			wait.ForLog("AMQ221007"), // server active: its acceptors are up
			wait.ForListeningPort(amqpPort)),
	}
	if strings.HasPrefix(endpoint, "unix://") {
		// A local engine: publish on the host's loopback only, like
		// the local process. (A remote engine's ports must be published
		// on its own addresses to be reachable at all.)
		opts = append(opts, testcontainers.WithHostConfigModifier(func(hc *container.HostConfig) {
			lo := []network.PortBinding{{HostIP: netip.MustParseAddr("127.0.0.1"), HostPort: "0"}}
			hc.PortBindings = network.PortMap{
				network.MustParsePort(amqpPort): lo,
				network.MustParsePort(corePort): lo,
			}
		}))
	}
	t0 := time.Now()
	ctr, err := testcontainers.Run(ctx, c.image, opts...)
	if err != nil {
		if ctr != nil {
			_ = ctr.Terminate(context.WithoutCancel(ctx), testcontainers.StopTimeout(0))
		}
		return nil, fmt.Errorf("artemistest: starting container %s: %w", c.image, err)
	}
	cb := &containerBroker{ctr: ctr, logf: c.logf}
	host, err := ctr.Host(ctx)
	var amqp, core network.Port
	if err == nil {
		amqp, err = ctr.MappedPort(ctx, amqpPort)
	}
	if err == nil {
		core, err = ctr.MappedPort(ctx, corePort)
	}
	if err != nil {
		_ = ctr.Terminate(context.WithoutCancel(ctx), testcontainers.StopTimeout(0))
		return nil, fmt.Errorf("artemistest: container %s: %w", c.image, err)
	}
	ap, _ := strconv.Atoi(amqp.Port())
	cp, _ := strconv.Atoi(core.Port())
	c.logf("artemistest: container %s (%s) accepts AMQP on %s:%d after %v",
		c.image, ctr.GetContainerID(), host, ap, time.Since(t0).Round(10*time.Millisecond))
	return &Broker{host: host, port: ap, corePort: cp, be: cb}, nil
}

func (cb *containerBroker) pid() int    { return 0 }
func (cb *containerBroker) dir() string { return "" }

// stop stops the container (SIGTERM, SIGKILL when ctx ends; 10 s if ctx
// has no deadline) and removes it with its volumes. The removal gets 30 s
// of its own, so that an expired ctx still leaves nothing behind.
func (cb *containerBroker) stop(ctx context.Context) error {
	grace := 10 * time.Second
	if dl, ok := ctx.Deadline(); ok {
		grace = max(time.Until(dl), 0)
	}
	if ctx.Err() != nil {
		grace = 0
	}
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), grace+30*time.Second)
	defer cancel()
	if err := cb.ctr.Terminate(rctx, testcontainers.StopTimeout(grace)); err != nil {
		return fmt.Errorf("artemistest: removing the container: %w", err)
	}
	return nil
}

func (cb *containerBroker) logTail(n int) string {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	rc, err := cb.ctr.Logs(ctx)
	if err != nil {
		return fmt.Sprintf("(no output: %v)", err)
	}
	defer func() { _ = rc.Close() }()
	b, err := io.ReadAll(rc)
	if err != nil {
		return fmt.Sprintf("(no output: %v)", err)
	}
	return lastLines(b, n)
}
