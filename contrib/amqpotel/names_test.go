package amqpotel

import (
	"context"
	"errors"
	"fmt"
	"testing"

	"github.com/Azure/go-amqp"

	"github.com/amqpsub/amqpsub/amqpsub"
)

func TestSettleOp(t *testing.T) {
	for _, c := range []struct {
		system string
		o      amqpsub.Outcome
		want   string
	}{
		{"activemq", amqpsub.OutcomeAccepted, "accept"},
		{"activemq", amqpsub.OutcomeReleased, "release"},
		{"rabbitmq", amqpsub.OutcomeModified, "modify"},
		{"amqp", amqpsub.OutcomeRejected, "reject"},
		{"activemq", amqpsub.Outcome(9), "settle"},
		{"servicebus", amqpsub.OutcomeAccepted, "complete"},
		{"servicebus", amqpsub.OutcomeReleased, "release"},
		{"servicebus", amqpsub.OutcomeModified, "abandon"},
		{"servicebus", amqpsub.OutcomeRejected, "dead_letter"},
		{"servicebus", amqpsub.Outcome(9), "settle"},
	} {
		if got := settleOp(c.system, c.o); got != c.want {
			t.Errorf("settleOp(%s, %v) = %q, want %q", c.system, c.o, got, c.want)
		}
	}
}

func TestSettleErrorType(t *testing.T) {
	for _, c := range []struct {
		err  error
		want string
	}{
		{amqpsub.ErrNotSettled, "not_settled"},
		{fmt.Errorf("x: %w", amqpsub.ErrNotSettled), "not_settled"},
		{&amqp.Error{Condition: amqp.ErrCondNotFound}, "amqp:not-found"},
		{&amqp.LinkError{RemoteErr: &amqp.Error{Condition: amqp.ErrCondDetachForced}}, "amqp:link:detach-forced"},
		{&amqp.LinkError{}, "link_closed"},
		{&amqp.SessionError{}, "session_closed"},
		{&amqp.ConnError{}, "connection_closed"},
		{context.DeadlineExceeded, "timeout"},
		{context.Canceled, "canceled"},
		{errors.New("x"), "_OTHER"},
	} {
		if got := settleErrorType(c.err); got != c.want {
			t.Errorf("settleErrorType(%v) = %q, want %q", c.err, got, c.want)
		}
	}
}

func TestIDString(t *testing.T) {
	for _, c := range []struct {
		id   any
		want string
	}{
		{"abc", "abc"},
		{uint64(42), "42"},
		{amqp.UUID{0x12, 0x34, 0x56, 0x78, 0x9a, 0xbc, 0xde, 0xf0, 1, 2, 3, 4, 5, 6, 7, 8}, "12345678-9abc-def0-0102-030405060708"},
		{[]byte{0xde, 0xad}, "dead"},
		{nil, ""},
		{int64(-1), "-1"},
	} {
		if got := idString(c.id); got != c.want {
			t.Errorf("idString(%#v) = %q, want %q", c.id, got, c.want)
		}
	}
}

func TestCarrier(t *testing.T) {
	tp := "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
	for _, c := range []struct {
		props map[string]any
		want  string
	}{
		{map[string]any{"traceparent": tp}, tp},
		{map[string]any{DiagnosticIDProperty: tp}, tp},
		{map[string]any{"traceparent": tp, DiagnosticIDProperty: "00-other"}, tp},
		{map[string]any{"traceparent": []byte(tp)}, ""},
		{nil, ""},
	} {
		if got := carrier(c.props).Get("traceparent"); got != c.want {
			t.Errorf("Get(traceparent) of %v = %q, want %q", c.props, got, c.want)
		}
	}
	keys := carrier(map[string]any{"a": "x", "b": 1}).Keys()
	if len(keys) != 1 || keys[0] != "a" {
		t.Errorf("Keys = %v", keys)
	}
}
