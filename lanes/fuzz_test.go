package lanes_test

import (
	"testing"

	"github.com/amqpsub/amqpsub/lanes"
)

// Group-ids come off the wire: any string must map to a lane in range, the
// same lane every time, and the empty string to none.
func FuzzLaneOf(f *testing.F) {
	f.Add("customer-042", 8)
	f.Add("", 1)
	f.Add("\xff\x00é", 64)
	f.Fuzz(func(t *testing.T, key string, n int) {
		if n < 1 || n > 1<<16 {
			return
		}
		l := lanes.LaneOf(key, n)
		if key == "" {
			if l != -1 {
				t.Fatalf("empty key on lane %d", l)
			}
			return
		}
		if l < 0 || l >= n {
			t.Fatalf("LaneOf(%q, %d) = %d", key, n, l)
		}
		if again := lanes.LaneOf(string([]byte(key)), n); again != l {
			t.Fatalf("LaneOf not stable: %d then %d", l, again)
		}
	})
}
