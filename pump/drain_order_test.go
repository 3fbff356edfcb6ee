package pump_test

import (
	"context"
	"errors"
	"sync"
	"testing"

	"github.com/Azure/go-amqp"

	"github.com/amqpsub/amqpsub/internal/fake"
	"github.com/amqpsub/amqpsub/pump"
)

// drainOrder wraps a fake source and records, in order, the drain and the
// releases the pump sends at a stop.
type drainOrder struct {
	*fake.Source
	mu  sync.Mutex
	log []string
}

func (s *drainOrder) DrainCredit(context.Context, *amqp.DrainCreditOptions) error {
	s.mu.Lock()
	s.log = append(s.log, "drain")
	s.mu.Unlock()
	return nil
}

func (s *drainOrder) ReleaseMessage(ctx context.Context, m *amqp.Message) error {
	s.mu.Lock()
	s.log = append(s.log, "release")
	s.mu.Unlock()
	return s.Source.ReleaseMessage(ctx, m)
}

// At a stop the pump drains the link's credit before it releases the
// buffered deliveries, so that the broker does not send them straight back
// to a link that still has credit. (An outside review found the drain
// started on a goroutine and the releases going out first.)
func TestDrainComesBeforeTheReleases(t *testing.T) {
	const runs = 200
	late := 0
	for range runs {
		src := &drainOrder{Source: fake.New(false, fake.Messages(8)...)}
		p := pump.New(pump.Config{Credit: 8})
		cancel, errc := start(t, p, attachTo(src))
		first := <-p.Out() // in a handler
		first.Begin()
		for p.Stats().Received < 8 {
		}
		p.Stop()
		<-p.Released()
		p.Settle(first, pump.Outcome{Kind: pump.Accept})
		if err := <-errc; !errors.Is(err, pump.ErrStopped) {
			t.Fatalf("Run = %v", err)
		}
		cancel()
		src.mu.Lock()
		if len(src.log) == 0 || src.log[0] != "drain" {
			late++
		}
		src.mu.Unlock()
	}
	if late > 0 {
		t.Fatalf("%d of %d stops released deliveries on a link not yet drained", late, runs)
	}
}
