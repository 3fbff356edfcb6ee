package amqpsub_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/amqpsub/amqpsub/amqpsub"
)

// An address whose scheme was left out (user:password@host:port,
// or amqp: without the //) parses as scheme + opaque, with no user info for
// the redaction to take out: DialFailover refuses it, and neither its error
// nor Dial's String nor Run's error shows the password. (Found by an
// outside review.)
func TestPasswordOfAnAddressWithoutSlashesIsNotShown(t *testing.T) {
	const secret = "s3cr3tPW"
	for _, raw := range []string{
		"alice:" + secret + "@127.0.0.1:1",          // scheme left out
		"amqp:alice:" + secret + "@127.0.0.1:1",     // // left out
		"amqps:alice:" + secret + "@127.0.0.1:1",    // // left out
		"amqp:/alice:" + secret + "%zz@127.0.0.1:1", // one / and a bad escape: unparsable, no // to find the password by
	} {
		_, err := amqpsub.DialFailover([]string{raw}, nil)
		if err == nil {
			t.Errorf("%s: DialFailover accepted it", raw)
		} else if strings.Contains(err.Error(), secret) {
			t.Errorf("DialFailover error shows the password: %v", err)
		}
		c := amqpsub.Dial(raw, nil)
		if strings.Contains(c.String(), secret) {
			t.Errorf("Dial(%q).String() = %q shows the password", raw, c.String())
		}
		if strings.HasPrefix(raw, "alice:") { // runs no dial: the scheme is refused first
			s, err := amqpsub.New(c, "q", amqpsub.HandlerFunc(func(context.Context, *amqpsub.Delivery) error { return nil }),
				amqpsub.DialTimeout(200*time.Millisecond))
			if err != nil {
				t.Fatal(err)
			}
			if err := s.Run(context.Background()); err != nil && strings.Contains(err.Error(), secret) {
				t.Errorf("Run's error shows the password: %v", err)
			}
		}
	}
}

// An '@' written %40 in a path is not taken for a misplaced credential.
func TestEscapedAtInAPathIsAccepted(t *testing.T) {
	if _, err := amqpsub.DialFailover([]string{"amqp://u:p@host:5672/%40"}, nil); err != nil {
		t.Fatalf("DialFailover refused a valid URL: %v", err)
	}
	if _, err := amqpsub.DialFailover([]string{"amqp://u:p/w@host:5672"}, nil); err == nil {
		t.Fatal("DialFailover took a password with an unescaped '/'")
	}
}
