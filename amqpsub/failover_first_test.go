package amqpsub_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/amqpsub/amqpsub/amqpsub"
)

// A DialFailover that cannot attach at the start names, in Run's error,
// every address and why it failed, also those that answered but could not
// attach, each tried once. (Found by an outside review.)
func TestFirstAttachErrorNamesEveryAddress(t *testing.T) {
	a, b := muteAfterOpen(t), muteAfterOpen(t)
	c, err := amqpsub.DialFailover([]string{"amqp://" + a, "amqp://" + b}, nil)
	if err != nil {
		t.Fatal(err)
	}
	s, _ := amqpsub.New(c, "q", nop, amqpsub.DialTimeout(200*time.Millisecond))
	t0 := time.Now()
	err = s.Run(context.Background())
	t.Logf("Run after %v: %v", time.Since(t0).Round(time.Millisecond), err)
	if err == nil {
		t.Fatal("Run = nil")
	}
	for _, addr := range []string{a, b} {
		if !strings.Contains(err.Error(), addr) {
			t.Errorf("Run's error does not name %s", addr)
		}
	}
}
