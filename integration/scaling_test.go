package integration

import (
	"fmt"
	"os"
	"strings"
	"testing"
	"time"
)

// TestArtemisScalingThroughput measures, for docs/scaling.md, what
// replicas and a second node give on this machine: the rate at which
// replica processes (examples/replicas, WorkersByKey(8)) drain 60,000
// persistent messages without a group-id, preloaded, on one node of the
// cluster and on both, with handlers that do nothing and with handlers
// that take up to 1 ms. The rate is taken between the 10th and the 90th
// percent of the messages handled, when every replica is attached (they
// start one after another). Ungrouped, since preloaded groups would all
// go to the first replica to attach (docs/scaling.md). It measures and asserts only that everything was
// handled once; it runs only with AMQPSUB_SCALING=1 (`make scaling`),
// since it takes minutes and its figures mean something only on a quiet
// machine.
func TestArtemisScalingThroughput(t *testing.T) {
	if os.Getenv("AMQPSUB_SCALING") != "1" {
		t.Skip("a measurement, not a check: AMQPSUB_SCALING=1 (make scaling) runs it")
	}
	tp := startTopology(t, "cluster")
	urls := [2]string{tp.url(t, "1"), tp.url(t, "2")}
	bin := buildReplicas(t, t.TempDir())
	const n = 60000
	type shape struct {
		nodes, replicas int
		work            string
	}
	var rows []string
	for _, work := range []string{"0", "1ms"} {
		for _, sh := range []shape{{1, 1, work}, {1, 2, work}, {1, 4, work}, {2, 2, work}, {2, 4, work}} {
			name := fmt.Sprintf("%d node(s), %d replica(s), work %s", sh.nodes, sh.replicas, sh.work)
			q := queueName(t)
			msgs := make([]msgSpec, n)
			for i := range msgs {
				msgs[i] = msgSpec{seq: i}
			}
			t0 := time.Now()
			if sh.nodes == 1 {
				conn := dial(t, urls[0])
				publishFast(t, conn, q, true, msgs)
				conn.Close()
			} else {
				publishSplit(t, urls, q, msgs)
			}
			published := time.Since(t0)
			run := newReplicaRun(t, bin, urls[0], q, "-lanes", "8", "-work", sh.work, "-report", "0")
			for i := range sh.replicas {
				node := 0
				if sh.nodes == 2 {
					node = i % 2
				}
				run.start(fmt.Sprintf("r%d", i+1), "-url", urls[node])
			}
			run.waitHandled(n, 10*time.Minute)
			run.stopAll()
			evs := run.log.snapshot()
			f := analyse(evs, msgs)
			if len(f.lost) != 0 || f.duplicates != 0 {
				t.Errorf("%s: lost %d, duplicates %d", name, len(f.lost), f.duplicates)
			}
			from, to := evs[len(evs)/10].at, evs[len(evs)*9/10].at
			rate := float64(len(evs)*8/10) / (float64(to-from) / 1e9)
			var per []string
			for i := range sh.replicas {
				per = append(per, fmt.Sprint(f.replicas[fmt.Sprintf("r%d", i+1)]))
			}
			row := fmt.Sprintf("| %d | %d | %s | %.0f | %.0f | %s | %.1f s |", sh.nodes, sh.replicas, sh.work, rate, rate/float64(sh.replicas),
				strings.Join(per, " / "), published.Seconds())
			t.Log(row)
			rows = append(rows, row)
		}
	}
	t.Logf("\n| nodes | replicas | work | msgs/s | per replica | messages per replica | preloading took |\n|--:|--:|---|--:|--:|---|--:|\n%s", strings.Join(rows, "\n"))
}
