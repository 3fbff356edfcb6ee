package amqpsub_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/amqpsub/amqpsub/amqpsub"
)

// A password with an unescaped '/' or '?' after a numeric prefix (such as
// 2024/Spring) makes the URL parse with the user name as the host and the
// password as the port and path. DialFailover refuses it, and Dial's
// String and Run's error never show the password. (Found by an outside
// review.)
func TestPasswordThatParsesAsAPortIsNotShown(t *testing.T) {
	const raw = "amqp://alice:2024/Spring@127.0.0.1:5672"
	if _, err := amqpsub.DialFailover([]string{raw}, nil); err == nil || strings.Contains(err.Error(), "Spring") {
		t.Fatalf("DialFailover = %v; want an error without the password", err)
	}
	c := amqpsub.Dial(raw, nil)
	s, _ := amqpsub.New(c, "q", nop, amqpsub.DialTimeout(200*time.Millisecond))
	err := s.Run(context.Background())
	t.Logf("String() %q; Run: %v", c.String(), err)
	if strings.Contains(c.String(), "Spring") || err != nil && strings.Contains(err.Error(), "Spring") {
		t.Fatalf("the password is shown: String() %q, Run: %v", c.String(), err)
	}
}
