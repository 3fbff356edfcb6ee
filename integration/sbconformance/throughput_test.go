package sbconformance

import (
	"context"
	"os"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/Azure/go-amqp"
)

// TestPeerThroughput measures how fast the peer delivers and settles
// peek-lock messages to a go-amqp receiver (rcv-settle-mode second, manual
// credit, concurrent settlement), with and without a settle delay. It only
// runs with AMQPSUB_SBPEER_BENCH=1 (or a message count), as it takes the
// peer's full attention for a few seconds:
//
//	AMQPSUB_SBPEER_BENCH=5000 go test -run TestPeerThroughput -v .
func TestPeerThroughput(t *testing.T) {
	p := needPeer(t)
	n, _ := strconv.Atoi(os.Getenv("AMQPSUB_SBPEER_BENCH"))
	if n == 0 {
		t.Skip("set AMQPSUB_SBPEER_BENCH=<messages> (or 1 for 5000) to measure the peer's throughput")
	}
	if n == 1 {
		n = 5000
	}
	for _, c := range []struct {
		workers, credit, delayMS int
	}{{16, 256, 0}, {64, 256, 0}, {16, 256, 5}, {64, 256, 5}} {
		t.Run("", func(t *testing.T) {
			p.must(t, "POST", "/settings", map[string]any{"settle_delay_ms": c.delayMS}, nil)
			t.Cleanup(func() { _ = p.call("POST", "/settings", map[string]any{"settle_delay_ms": 0}, nil) })
			q := p.entity(t, map[string]any{"lock_duration_ms": 30000})
			p.must(t, "POST", "/messages", map[string]any{"entity": q, "count": n}, nil)
			var h0, h1 struct {
				CPU float64 `json:"cpu_seconds"`
			}
			p.must(t, "GET", "/health", nil, &h0)
			rate := drain(t, p, q, n, c.workers, c.credit)
			p.must(t, "GET", "/health", nil, &h1)
			t.Logf("%d messages, %d settling workers, credit %d, settle delay %d ms: %.0f msg/s; peer CPU %.0f µs/message",
				n, c.workers, c.credit, c.delayMS, rate, (h1.CPU-h0.CPU)*1e6/float64(n))
		})
	}
}

// drain receives and accepts n messages and returns messages per second
// from the first delivery to the last settlement.
func drain(t *testing.T, p *peer, q string, n, workers, credit int) float64 {
	conn := dial(t, p)
	aud := "amqp://" + endpointHost(t, p.conn) + "/" + q
	tok := sasToken(aud, connField(p.conn, "SharedAccessKeyName"), connField(p.conn, "SharedAccessKey"), time.Now().Add(time.Hour))
	if code := putToken(t, conn, "servicebus.windows.net:sastoken", aud, tok, "0"); code != 202 {
		t.Fatalf("put-token: %d", code)
	}
	ctx := ctxFor(t, 5*time.Minute)
	s, err := conn.NewSession(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	r, err := s.NewReceiver(ctx, q, &amqp.ReceiverOptions{
		SettlementMode: amqp.ReceiverSettleModeSecond.Ptr(), Credit: -1,
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := r.IssueCredit(uint32(credit)); err != nil {
		t.Fatal(err)
	}
	work := make(chan *amqp.Message, credit)
	var wg sync.WaitGroup
	var mu sync.Mutex
	var firstErr error
	for range workers {
		wg.Go(func() {
			for m := range work {
				if err := r.AcceptMessage(ctx, m); err != nil {
					mu.Lock()
					if firstErr == nil {
						firstErr = err
					}
					mu.Unlock()
				}
				if err := r.IssueCredit(1); err != nil {
					mu.Lock()
					if firstErr == nil {
						firstErr = err
					}
					mu.Unlock()
				}
			}
		})
	}
	var start time.Time
	for i := range n {
		m, err := r.Receive(ctx, nil)
		if err != nil {
			t.Fatalf("after %d messages: %v", i, err)
		}
		if i == 0 {
			start = time.Now()
		}
		work <- m
	}
	close(work)
	wg.Wait()
	elapsed := time.Since(start)
	if firstErr != nil {
		t.Fatal(firstErr)
	}
	_ = r.Close(context.Background())
	if e := p.info(t, q); e.Available != 0 || e.Locked != 0 {
		t.Fatalf("after draining: %+v", e)
	}
	return float64(n) / elapsed.Seconds()
}
