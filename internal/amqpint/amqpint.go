// Package amqpint reads the integers of AMQP 1.0 values, which go-amqp
// decodes to whichever Go integer type the sender encoded (byte, short,
// int, long, and their unsigned kinds).
package amqpint

import "math"

// Int returns v as an int64 when v is a Go integer of any size that fits
// one; false for anything else (a uint64 past math.MaxInt64, a float, a
// string, nil).
func Int(v any) (int64, bool) {
	switch v := v.(type) {
	case int8:
		return int64(v), true
	case uint8:
		return int64(v), true
	case int16:
		return int64(v), true
	case uint16:
		return int64(v), true
	case int32:
		return int64(v), true
	case uint32:
		return int64(v), true
	case int64:
		return v, true
	case int:
		return int64(v), true
	case uint:
		if uint64(v) > math.MaxInt64 {
			return 0, false
		}
		return int64(v), true
	case uint64:
		if v > math.MaxInt64 {
			return 0, false
		}
		return int64(v), true
	}
	return 0, false
}
