package amqpint_test

import (
	"math"
	"testing"

	"github.com/amqpsub/amqpsub/internal/amqpint"
)

func TestInt(t *testing.T) {
	for _, c := range []struct {
		in   any
		want int64
		ok   bool
	}{
		{int8(-5), -5, true}, {uint8(200), 200, true}, {int16(-300), -300, true}, {uint16(60000), 60000, true},
		{int32(-7), -7, true}, {uint32(math.MaxUint32), math.MaxUint32, true}, {int64(math.MinInt64), math.MinInt64, true},
		{int(42), 42, true}, {uint(7), 7, true}, {uint64(math.MaxInt64), math.MaxInt64, true},
		{uint64(math.MaxInt64) + 1, 0, false}, {uint(math.MaxUint), 0, false},
		{1.5, 0, false}, {"7", 0, false}, {nil, 0, false},
	} {
		got, ok := amqpint.Int(c.in)
		if got != c.want || ok != c.ok {
			t.Errorf("Int(%#v) = %d, %v; want %d, %v", c.in, got, ok, c.want, c.ok)
		}
	}
}
