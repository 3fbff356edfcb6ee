package amqpsub_test

import (
	"fmt"
	"reflect"
	"regexp"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap/zapcore"

	"github.com/amqpsub/amqpsub/amqpsub"
)

// every returns a Stats whose numbers are all different: field i of the
// walk (nested structs included) is i+1, RoundTrip is in milliseconds, and
// the lanes' loads make longest_lane 99.
func every() amqpsub.Stats {
	var st amqpsub.Stats
	n := int64(0)
	leaves(reflect.ValueOf(&st).Elem(), func(_ string, v reflect.Value) {
		n++
		set(v, n)
	})
	st.Lanes = []amqpsub.LaneStats{{Load: 3}, {Load: 99}}
	return st
}

// leaves calls f with each number of the struct v, by its path.
func leaves(v reflect.Value, f func(path string, v reflect.Value)) {
	t := v.Type()
	for i := range t.NumField() {
		fv := v.Field(i)
		switch fv.Kind() {
		case reflect.Struct:
			leaves(fv, func(p string, l reflect.Value) { f(t.Field(i).Name+"."+p, l) })
		case reflect.Int, reflect.Int64, reflect.Uint64:
			f(t.Field(i).Name, fv)
		case reflect.Slice: // Lanes, whose loads longest_lane reports
		default:
			panic("a Stats field of kind " + fv.Kind().String())
		}
	}
}

func set(v reflect.Value, n int64) {
	switch {
	case v.Type() == reflect.TypeFor[time.Duration]():
		v.SetInt(n * int64(time.Millisecond))
	case v.CanInt():
		v.SetInt(n)
	default:
		v.SetUint(uint64(n))
	}
}

// Every number of Stats is in the table: a field added to Stats and not
// to StatFields fails here, as does a row that reads a wrong field.
func TestStatFieldsCoverStats(t *testing.T) {
	fields := amqpsub.StatFields()
	var zero amqpsub.Stats
	leaves(reflect.ValueOf(&zero).Elem(), func(path string, _ reflect.Value) {
		var st amqpsub.Stats
		var v reflect.Value
		leaves(reflect.ValueOf(&st).Elem(), func(p string, l reflect.Value) {
			if p == path {
				v = l
			}
		})
		set(v, 7)
		var moved []string
		for _, f := range fields {
			if f.Value(st) != 0 {
				moved = append(moved, f.Name)
			}
		}
		if len(moved) != 1 {
			t.Errorf("Stats.%s moves %d rows of StatFields %v, want 1", path, len(moved), moved)
		}
	})
	st := amqpsub.Stats{Lanes: []amqpsub.LaneStats{{Load: 2}, {Load: 5}}}
	for _, f := range fields {
		if v := f.Value(st); (f.Name == "longest_lane") != (v != 0) {
			t.Errorf("lanes with loads 2 and 5: %s = %d", f.Name, v)
		}
	}
}

func TestStatFieldsWellFormed(t *testing.T) {
	snake := regexp.MustCompile(`^[a-z]+(_[a-z]+)*$`)
	unit := regexp.MustCompile(`^(\{[a-z]+\}|By|ns)$`)
	seen := map[string]bool{}
	fields := amqpsub.StatFields()
	for _, f := range fields {
		if !snake.MatchString(f.Name) || seen[f.Name] {
			t.Errorf("name %q: not snake_case, or seen before", f.Name)
		}
		seen[f.Name] = true
		if f.Help == "" || !strings.HasSuffix(f.Help, ".") || strings.Contains(f.Help, "\n") {
			t.Errorf("%s: help %q is not one sentence", f.Name, f.Help)
		}
		if k := f.Kind.String(); k != "counter" && k != "gauge" && k != "max_gauge" {
			t.Errorf("%s: kind %s", f.Name, k)
		}
		if !unit.MatchString(f.Unit) {
			t.Errorf("%s: unit %q", f.Name, f.Unit)
		}
	}
	fields[0].Name = "changed"
	if amqpsub.StatFields()[0].Name == "changed" {
		t.Error("StatFields returned the table itself, not a copy")
	}
	if s := amqpsub.StatKind(0).String(); s != "StatKind(0)" {
		t.Errorf("StatKind(0) = %q", s)
	}
}

// The log writes every row, under its name and with its field's Go type,
// in the table's order: the names and types it wrote before the table,
// and credit, credit_limit and round_trip since.
func TestStatsMarshalLogObject(t *testing.T) {
	st := every()
	enc := zapcore.NewMapObjectEncoder()
	if err := st.MarshalLogObject(enc); err != nil {
		t.Fatal(err)
	}
	want := map[string]any{
		"held": 1, "max_held": 2, "buffered": 3, "handling": 4, "settling": 5,
		"bytes_held": int64(6), "max_bytes_held": int64(7), "credit": 8, "credit_limit": 9,
		"round_trip": 10 * time.Millisecond, "longest_lane": 99, "groups_held": 11, "parked": 12,
		"received": uint64(13), "accepted": uint64(14), "released": uint64(15), "modified": uint64(16), "rejected": uint64(17),
		"result_accept": uint64(18), "result_release": uint64(19), "result_retry": uint64(20), "result_reject": uint64(21),
		"panics": uint64(22), "local_retries": uint64(23), "poisoned": uint64(24), "oversize": uint64(25),
		"settle_errors": uint64(26), "stale": uint64(27), "dropped": uint64(28), "unsent": uint64(29),
		"overshoot": int64(30), "links": uint64(31), "links_lost": uint64(32), "reconnects": uint64(33),
		"locks_held": 34, "lock_renew_requests": uint64(35), "locks_renewed": uint64(36), "lock_renew_failures": uint64(37),
		"locks_lost": uint64(38), "locks_dropped": uint64(39), "locks_skipped": uint64(40),
		"locks_lost_at_settle": uint64(41), "settle_timeouts": uint64(42), "locks_unrenewable": uint64(43),
		"settled_by_token": uint64(44), "disposition_requests": uint64(45),
		"dead_letter_copies": uint64(46), "dead_letter_copy_failures": uint64(47), "abandoned": uint64(48), "events_dropped": uint64(49),
	}
	if !reflect.DeepEqual(enc.Fields, want) {
		for k, v := range want {
			if g, ok := enc.Fields[k]; !ok || g != v {
				t.Errorf("%s = %#v, want %#v", k, g, v)
			}
		}
		for k, g := range enc.Fields {
			if _, ok := want[k]; !ok {
				t.Errorf("%s = %#v, not wanted", k, g)
			}
		}
	}
	if len(want) != len(amqpsub.StatFields()) {
		t.Errorf("%d fields logged, the table has %d rows", len(want), len(amqpsub.StatFields()))
	}
}

// String keeps its format: the head, then the rows usually zero, in the
// table's order, only when they are not.
func TestStatsString(t *testing.T) {
	want := "held=1 max=2 (buffered=3 handling=4 settling=5) longest_lane=99 received=13 " +
		"settled(acc/rel/mod/rej)=14/15/16/17 results(acc/rel/retry/rej)=18/19/20/21 " +
		"bytes_held=6 groups_held=11 parked=12 panics=22 local_retries=23 poisoned=24 oversize=25 " +
		"settle_errors=26 stale=27 unsent=29 dropped=28 overshoot=30 links_lost=32 reconnects=33 " +
		"locks_renewed=36 lock_renew_requests=35 lock_renew_failures=37 locks_lost=38 locks_dropped=39 locks_skipped=40 " +
		"locks_unrenewable=43 settled_by_token=44 disposition_requests=45 locks_lost_at_settle=41 settle_timeouts=42 " +
		"dead_letter_copies=46 dead_letter_copy_failures=47 abandoned=48 events_dropped=49"
	if got := every().String(); got != want {
		t.Errorf("String:\n got %s\nwant %s", got, want)
	}
	zero := "held=0 max=0 (buffered=0 handling=0 settling=0) longest_lane=0 received=0 settled(acc/rel/mod/rej)=0/0/0/0 results(acc/rel/retry/rej)=0/0/0/0"
	if got := (amqpsub.Stats{Overshoot: -1, Links: 3, CreditLimit: 5}).String(); got != zero {
		t.Errorf("String of zeros, links and a negative overshoot:\n got %s\nwant %s", got, zero)
	}
}

// A report of a subscriber's levels, from the table rather than a list of
// fields of its own: a number added to Stats shows up here too.
func ExampleStatFields() {
	st := amqpsub.Stats{Held: 12, Buffered: 8, Handling: 4, Credit: 32, CreditLimit: 256, RoundTrip: 3 * time.Millisecond}
	for _, f := range amqpsub.StatFields() {
		if v := f.Value(st); f.Kind != amqpsub.StatCounter && v != 0 {
			fmt.Printf("%s %d %s (%s)\n", f.Name, v, f.Unit, f.Kind)
		}
	}
	// Output:
	// held 12 {message} (gauge)
	// buffered 8 {message} (gauge)
	// handling 4 {message} (gauge)
	// credit 32 {message} (gauge)
	// credit_limit 256 {message} (gauge)
	// round_trip 3000000 ns (max_gauge)
}
