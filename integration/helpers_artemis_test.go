package integration

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/hex"
	"encoding/pem"
	"encoding/xml"
	"fmt"
	"io"
	"math/big"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/Azure/go-amqp"
)

// Helpers for Artemis: the fault tests' own broker, management requests,
// the cluster and HA topologies.

// The fault tests' own Artemis, which they may kill: never the shared one
// on 5672. Fixed ports, all on 127.0.0.1.
const (
	faultPort     = 5702  // AMQP
	faultCorePort = 61702 // CORE+AMQP (artemis CLI)
	faultTLSPort  = 5703  // AMQP over TLS (security tests)
)

// faultBroker is the dedicated Artemis of the fault and security tests.
type faultBroker struct {
	url     string // amqp://127.0.0.1:5702
	addr    string // 127.0.0.1:5702
	tlsAddr string // 127.0.0.1:5703
	roots   *x509.CertPool
	ctlPath string
	env     []string // AMQPSUB_ARTEMIS_* for this instance
	home    string   // instance directory

	watchIn  io.WriteCloser
	watchdog *exec.Cmd
}

var (
	faultOnce sync.Once
	faultB    *faultBroker
	faultErr  error
)

// dedicatedBroker returns the fault tests' broker, starting it on first use:
// a second Artemis instance ($AMQPSUB_CACHE/artemis-faults) run by
// integration/artemis.sh on ports 5702/61702, with an extra TLS acceptor on
// 5703. It is started from an empty journal, with the shared broker.xml plus
// that acceptor. TestMain stops it (and deletes its data) at the end; if the
// test binary dies first, a watchdog process does. Tests that kill it start
// it again in their cleanup. It skips the test when AMQPSUB_ARTEMIS_URL or
// AMQPSUB_ARTEMIS_CTL is unset.
func dedicatedBroker(t testing.TB) *faultBroker {
	t.Helper()
	artemisURL(t)
	ctl := os.Getenv("AMQPSUB_ARTEMIS_CTL")
	if ctl == "" {
		t.Skip("AMQPSUB_ARTEMIS_CTL is empty: the fault tests start their own Artemis (port 5702) with " +
			"integration/artemis.sh; set AMQPSUB_ARTEMIS_CTL=$PWD/integration/artemis.sh (`make test` does)")
	}
	faultOnce.Do(func() { faultB, faultErr = startFaultBroker(ctl) })
	if faultErr != nil {
		t.Fatalf("dedicated broker: %v", faultErr)
	}
	return faultB
}

func cacheDir() string {
	if d := os.Getenv("AMQPSUB_CACHE"); d != "" {
		return d
	}
	home, err := os.UserHomeDir()
	if err != nil {
		home = "/root"
	}
	return filepath.Join(home, ".cache", "amqpsub")
}

func startFaultBroker(ctl string) (*faultBroker, error) {
	ctl, err := filepath.Abs(ctl)
	if err != nil {
		return nil, err
	}
	home := filepath.Join(cacheDir(), "artemis-faults")
	tlsDir := home + ".tls"
	if err := os.MkdirAll(tlsDir, 0o700); err != nil {
		return nil, err
	}
	keystore, ksPassword, roots, err := makeServerTLS(tlsDir)
	if err != nil {
		return nil, fmt.Errorf("TLS material: %w", err)
	}
	xmlPath := filepath.Join(tlsDir, "broker.xml")
	if err := writeFaultBrokerXML(filepath.Join(filepath.Dir(ctl), "artemis", "broker.xml"), xmlPath, keystore, ksPassword); err != nil {
		return nil, err
	}
	b := &faultBroker{
		url:     fmt.Sprintf("amqp://127.0.0.1:%d", faultPort),
		addr:    fmt.Sprintf("127.0.0.1:%d", faultPort),
		tlsAddr: fmt.Sprintf("127.0.0.1:%d", faultTLSPort),
		roots:   roots,
		ctlPath: ctl,
		home:    home,
		env: []string{
			"AMQPSUB_ARTEMIS_HOME=" + home,
			"AMQPSUB_ARTEMIS_PORT=" + strconv.Itoa(faultPort),
			"AMQPSUB_ARTEMIS_CORE_PORT=" + strconv.Itoa(faultCorePort),
			"AMQPSUB_ARTEMIS_BROKER_XML=" + xmlPath,
		},
	}
	// The watchdog resets the broker when its stdin closes: when TestMain
	// closes it, or when this process dies however it dies. Its own process
	// group keeps a Ctrl-C meant for `go test` from killing it first.
	b.watchdog = exec.Command("bash", "-c", `cat >/dev/null; exec bash "$0" reset >/dev/null 2>&1`, ctl)
	b.watchdog.Env = append(os.Environ(), b.env...)
	b.watchdog.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if b.watchIn, err = b.watchdog.StdinPipe(); err != nil {
		return nil, err
	}
	if err := b.watchdog.Start(); err != nil {
		return nil, fmt.Errorf("watchdog: %w", err)
	}
	// A run that died may have left the instance running with an old
	// broker.xml: reset it, so it starts from an empty journal with ours.
	for _, cmd := range []string{"reset", "start"} {
		if out, err := b.run(cmd); err != nil {
			stopFaultBrokerOf(b)
			return nil, fmt.Errorf("artemis.sh %s: %w\n%s", cmd, err, out)
		}
	}
	if err := addLeakUser(home); err != nil {
		stopFaultBrokerOf(b)
		return nil, err
	}
	return b, nil
}

// writeFaultBrokerXML copies the shared broker.xml with one more acceptor,
// for TLS, so the dedicated broker has the same settings as the shared one.
func writeFaultBrokerXML(src, dst, keystore, password string) error {
	in, err := os.ReadFile(src)
	if err != nil {
		return err
	}
	var path bytes.Buffer
	if err := xml.EscapeText(&path, []byte(keystore)); err != nil {
		return err
	}
	acceptor := fmt.Sprintf(`   <!-- Added by the integration tests: TLS for the security tests. -->
         <acceptor name="amqps">tcp://127.0.0.1:%d?protocols=AMQP;sslEnabled=true;keyStoreType=PKCS12;keyStorePath=%s;keyStorePassword=%s;amqpCredits=1000;amqpLowCredits=300</acceptor>
      </acceptors>`, faultTLSPort, path.String(), password)
	if !bytes.Contains(in, []byte("</acceptors>")) {
		return fmt.Errorf("%s has no </acceptors>", src)
	}
	out := bytes.Replace(in, []byte("</acceptors>"), []byte(acceptor), 1)
	return os.WriteFile(dst, out, 0o600)
}

// run runs integration/artemis.sh cmd for the dedicated broker.
// target is the dedicated broker as a scenario target.
func (b *faultBroker) target() target { return target{name: onArtemis, url: b.url} }

func (b *faultBroker) run(cmd string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	c := exec.CommandContext(ctx, "bash", b.ctlPath, cmd)
	c.Env = append(os.Environ(), b.env...)
	out, err := c.CombinedOutput()
	return string(out), err
}

func (b *faultBroker) ctl(t testing.TB, cmd string) {
	t.Helper()
	out, err := b.run(cmd)
	if err != nil {
		t.Fatalf("artemis.sh %s (dedicated broker): %v\n%s", cmd, err, out)
	}
	t.Logf("artemis.sh %s: %s", cmd, strings.TrimSpace(out))
}

// ensureRunning is for the cleanup of tests that stop the broker.
func (b *faultBroker) ensureRunning(t testing.TB) {
	t.Helper()
	if out, err := b.run("start"); err != nil {
		t.Errorf("restarting the dedicated broker after the test: %v\n%s", err, out)
	}
}

func stopFaultBroker() {
	if faultB != nil {
		stopFaultBrokerOf(faultB)
	}
}

// stopFaultBrokerOf closes the watchdog's stdin and waits while it resets
// the broker.
func stopFaultBrokerOf(b *faultBroker) {
	b.watchIn.Close()
	done := make(chan error, 1)
	go func() { done <- b.watchdog.Wait() }()
	select {
	case err := <-done:
		if err != nil {
			fmt.Fprintf(os.Stderr, "stopping the dedicated broker: %v\n", err)
		}
	case <-time.After(2 * time.Minute):
		fmt.Fprintf(os.Stderr, "the dedicated broker's watchdog (pid %d) did not finish within 2 min\n", b.watchdog.Process.Pid)
	}
}

// makeServerTLS makes a self-signed CA and a server certificate for
// 127.0.0.1 and localhost signed by it, and writes the server's key and
// chain as a PKCS#12 keystore Artemis reads (with openssl). It returns the
// keystore's path and password and a pool holding only the CA.
func makeServerTLS(dir string) (keystore, password string, roots *x509.CertPool, err error) {
	openssl, err := exec.LookPath("openssl")
	if err != nil {
		return "", "", nil, fmt.Errorf("openssl is needed to write the broker's PKCS#12 keystore (apt-get install openssl): %w", err)
	}
	caKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return "", "", nil, err
	}
	now := time.Now()
	caTmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(1),
		Subject:               pkix.Name{CommonName: "amqpsub test CA"},
		NotBefore:             now.Add(-time.Hour),
		NotAfter:              now.Add(24 * time.Hour),
		IsCA:                  true,
		BasicConstraintsValid: true,
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageCRLSign,
	}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	if err != nil {
		return "", "", nil, err
	}
	ca, err := x509.ParseCertificate(caDER)
	if err != nil {
		return "", "", nil, err
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return "", "", nil, err
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(2),
		Subject:      pkix.Name{CommonName: "127.0.0.1"},
		NotBefore:    now.Add(-time.Hour),
		NotAfter:     now.Add(24 * time.Hour),
		IPAddresses:  []net.IP{net.IPv4(127, 0, 0, 1)},
		DNSNames:     []string{"localhost"},
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca, &key.PublicKey, caKey)
	if err != nil {
		return "", "", nil, err
	}
	keyDER, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		return "", "", nil, err
	}
	files := map[string][]byte{
		"ca.pem":     pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: caDER}),
		"server.pem": pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}),
		"server.key": pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: keyDER}),
	}
	for name, b := range files {
		if err := os.WriteFile(filepath.Join(dir, name), b, 0o600); err != nil {
			return "", "", nil, err
		}
	}
	pw := make([]byte, 12)
	rand.Read(pw)
	password = hex.EncodeToString(pw)
	keystore = filepath.Join(dir, "server.p12")
	cmd := exec.Command(openssl, "pkcs12", "-export", "-name", "server",
		"-in", filepath.Join(dir, "server.pem"), "-inkey", filepath.Join(dir, "server.key"),
		"-certfile", filepath.Join(dir, "ca.pem"), "-out", keystore, "-passout", "pass:"+password)
	if out, err := cmd.CombinedOutput(); err != nil {
		return "", "", nil, fmt.Errorf("openssl pkcs12 -export: %w\n%s", err, out)
	}
	roots = x509.NewCertPool()
	roots.AddCert(ca)
	return keystore, password, roots, nil
}

// management sends one request to Artemis management over AMQP (the
// address activemq.management, answered on a dynamic, temporary queue)
// and returns the reply's body, failing the test unless the broker says
// the request succeeded. props name the resource ("broker", "queue.NAME")
// and the operation or attribute; body is a JSON array of the arguments.
func management(t testing.TB, conn *amqp.Conn, props map[string]any, body string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	sess, err := conn.NewSession(ctx, nil)
	if err != nil {
		t.Fatalf("session: %v", err)
	}
	defer closeSession(sess)
	rcv, err := sess.NewReceiver(ctx, "", &amqp.ReceiverOptions{DynamicAddress: true, Credit: 1})
	if err != nil {
		t.Fatalf("management reply queue: %v", err)
	}
	snd, err := sess.NewSender(ctx, "activemq.management", nil)
	if err != nil {
		t.Fatalf("management sender: %v", err)
	}
	reply := rcv.Address()
	req := &amqp.Message{Value: body, Properties: &amqp.MessageProperties{ReplyTo: &reply}, ApplicationProperties: props}
	if err := snd.Send(ctx, req, nil); err != nil {
		t.Fatalf("management request: %v", err)
	}
	resp, err := rcv.Receive(ctx, nil)
	if err != nil {
		t.Fatalf("management reply: %v", err)
	}
	rcv.AcceptMessage(ctx, resp)
	if ok, _ := resp.ApplicationProperties["_AMQ_OperationSucceeded"].(bool); !ok {
		t.Fatalf("management %v failed: %v", props, resp.Value)
	}
	v, _ := resp.Value.(string)
	return v
}

// managementOp invokes an operation of an Artemis resource ("broker",
// "queue.NAME") through management over AMQP.
func managementOp(t testing.TB, conn *amqp.Conn, resource, op string, args ...any) {
	t.Helper()
	var body []string
	for _, a := range args {
		switch a := a.(type) {
		case string:
			body = append(body, fmt.Sprintf("%q", a))
		default:
			body = append(body, fmt.Sprint(a))
		}
	}
	management(t, conn, map[string]any{"_AMQ_ResourceName": resource, "_AMQ_OperationName": op}, "["+strings.Join(body, ",")+"]")
}

// queueAttribute reads an attribute of queue (such as "groupRebalance" or
// "messageCount") through Artemis management over AMQP.
func queueAttribute(t testing.TB, conn *amqp.Conn, queue, attr string) string {
	t.Helper()
	return resourceAttribute(t, conn, "queue."+queue, attr)
}

// resourceAttribute reads an attribute of an Artemis management resource
// ("broker", "queue.NAME"); the reply is a JSON array of one value.
func resourceAttribute(t testing.TB, conn *amqp.Conn, resource, attr string) string {
	t.Helper()
	v := management(t, conn, map[string]any{"_AMQ_ResourceName": resource, "_AMQ_Attribute": attr}, "[]")
	return strings.Trim(v, "[]\"")
}

// ctl runs integration/artemis.sh cli with args on the test broker.
func ctl(t *testing.T, args ...string) {
	t.Helper()
	script := os.Getenv("AMQPSUB_ARTEMIS_CTL")
	if script == "" {
		t.Fatal("AMQPSUB_ARTEMIS_CTL is empty: this test runs `integration/artemis.sh cli` (`make test` sets it)")
	}
	if out, err := exec.Command("bash", append([]string{script, "cli"}, args...)...).CombinedOutput(); err != nil {
		t.Fatalf("artemis %v: %v\n%s", args, err, out)
	}
}

const clusterHint = "set AMQPSUB_CLUSTER_CTL=$PWD/integration/artemis-cluster.sh (`make test` does); " +
	"the test starts and stops its brokers itself"

// topology is a cluster or HA pair run by integration/artemis-cluster.sh.
type topology struct {
	ctl  string // absolute path of artemis-cluster.sh
	name string // "cluster" or "ha"

	watchIn  io.WriteCloser
	watchdog *exec.Cmd
}

// startTopology resets and starts the topology, and stops it (deleting its
// data) when the test ends. It skips the test without AMQPSUB_CLUSTER_CTL.
func startTopology(t *testing.T, name string) *topology {
	t.Helper()
	ctl := os.Getenv("AMQPSUB_CLUSTER_CTL")
	if ctl == "" {
		t.Skip("AMQPSUB_CLUSTER_CTL is empty: " + clusterHint)
	}
	ctl, err := filepath.Abs(ctl)
	if err != nil {
		t.Fatal(err)
	}
	tp := &topology{ctl: ctl, name: name}
	// The watchdog resets the topology when its stdin closes: at the end of
	// the test, or when this process dies however it dies. Its own process
	// group keeps a Ctrl-C meant for `go test` from killing it first.
	tp.watchdog = exec.Command("bash", "-c", `cat >/dev/null; exec bash "$0" "$1" reset >/dev/null 2>&1`, ctl, name)
	tp.watchdog.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if tp.watchIn, err = tp.watchdog.StdinPipe(); err != nil {
		t.Fatal(err)
	}
	if err := tp.watchdog.Start(); err != nil {
		t.Fatalf("watchdog: %v", err)
	}
	t.Cleanup(tp.stop)
	// A run that died may have left nodes running with old data.
	tp.do(t, "reset")
	t0 := time.Now()
	tp.do(t, "start")
	t.Logf("%s: started from empty journals in %v", name, time.Since(t0).Round(10*time.Millisecond))
	return tp
}

func (tp *topology) run(args ...string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	out, err := exec.CommandContext(ctx, "bash", append([]string{tp.ctl, tp.name}, args...)...).CombinedOutput()
	return strings.TrimSpace(string(out)), err
}

// do runs artemis-cluster.sh NAME args... and fails the test if it fails.
func (tp *topology) do(t testing.TB, args ...string) string {
	t.Helper()
	out, err := tp.run(args...)
	if err != nil {
		t.Fatalf("artemis-cluster.sh %s %s: %v\n%s", tp.name, strings.Join(args, " "), err, out)
	}
	t.Logf("artemis-cluster.sh %s %s: %s", tp.name, strings.Join(args, " "), out)
	return out
}

// timed runs do and returns how long it took.
func (tp *topology) timed(t testing.TB, args ...string) time.Duration {
	t.Helper()
	t0 := time.Now()
	tp.do(t, args...)
	return time.Since(t0)
}

func (tp *topology) url(t testing.TB, node string) string {
	t.Helper()
	out, err := tp.run("url", node)
	if err != nil {
		t.Fatalf("artemis-cluster.sh %s url %s: %v\n%s", tp.name, node, err, out)
	}
	return out
}

// stop closes the watchdog's stdin and waits while it resets the topology.
func (tp *topology) stop() {
	tp.watchIn.Close()
	done := make(chan error, 1)
	go func() { done <- tp.watchdog.Wait() }()
	select {
	case err := <-done:
		if err != nil {
			fmt.Fprintf(os.Stderr, "stopping the %s topology: %v\n", tp.name, err)
		}
	case <-time.After(2 * time.Minute):
		fmt.Fprintf(os.Stderr, "the %s topology's watchdog (pid %d) did not finish within 2 min\n", tp.name, tp.watchdog.Process.Pid)
	}
}

// publishSplit publishes msgs, each group to one node: groups whose number
// is even to urls[0], odd ones to urls[1], so half the groups enter through
// each node (ungrouped messages: every other one). A group's messages all enter through one node, so they reach
// the node that owns the group in order (through the cluster bridge if need
// be); two nodes would make two routes, with no order between them.
func publishSplit(t *testing.T, urls [2]string, q string, msgs []msgSpec) {
	t.Helper()
	var parts [2][]msgSpec
	for _, m := range msgs {
		g := m.seq // ungrouped: every other message
		if m.group != "" {
			fmt.Sscanf(m.group, "g%d", &g)
		}
		parts[g%2] = append(parts[g%2], m)
	}
	for i, u := range urls {
		conn := dial(t, u)
		publishFast(t, conn, q, true, parts[i])
		conn.Close()
	}
}
