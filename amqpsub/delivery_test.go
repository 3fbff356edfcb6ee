package amqpsub_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"testing/synctest"

	"github.com/Azure/go-amqp"

	"github.com/amqpsub/amqpsub/amqpsub"
	"github.com/amqpsub/amqpsub/internal/fake"
)

// handleAll runs h over msgs through a subscriber and returns the errors h
// reported about them.
func handleAll(t *testing.T, h func(d *amqpsub.Delivery) error, msgs ...*amqp.Message) []error {
	t.Helper()
	var errs []error
	synctest.Test(t, func(t *testing.T) {
		src := fake.New(false, msgs...)
		s, _ := amqpsub.New(amqpsub.SourceOf(src), "q", amqpsub.HandlerFunc(func(_ context.Context, d *amqpsub.Delivery) error {
			if err := h(d); err != nil {
				errs = append(errs, err)
			}
			return nil
		}))
		cancel, errc := run(t, s)
		synctest.Wait()
		cancel()
		<-errc
		if n := src.Count(fake.Accepted); n != len(msgs) {
			t.Fatalf("accepted %d of %d", n, len(msgs))
		}
	})
	return errs
}

func TestBodyAccessorsSayWhatTheBodyIs(t *testing.T) {
	group, ct := "g", "text/plain"
	gs := uint32(4)
	data := &amqp.Message{Data: [][]byte{[]byte("ab"), []byte("cd")},
		Properties:  &amqp.MessageProperties{GroupID: &group, GroupSequence: &gs, ContentType: &ct, MessageID: "m-1"},
		Header:      &amqp.MessageHeader{DeliveryCount: 2},
		Annotations: amqp.Annotations{"x-opt-jms-msg-type": int8(5)}}
	value := &amqp.Message{Value: "hello"}
	seq := &amqp.Message{Sequence: [][]any{{int64(1), "two"}}}
	empty := &amqp.Message{}
	errs := handleAll(t, func(d *amqpsub.Delivery) error {
		m := d.Message()
		switch m {
		case data:
			b, err := d.Body()
			if d.Kind() != amqpsub.BodyData || err != nil || string(b) != "abcd" {
				return errors.New("data body")
			}
			if _, err := d.Value(); !errors.Is(err, amqpsub.ErrBodyKind) {
				return errors.New("Value on data")
			}
			if n, ok := d.GroupSequence(); !ok || n != 4 || d.GroupID() != "g" || d.ContentType() != ct ||
				d.MessageID() != "m-1" || d.DeliveryCount() != 2 || d.FirstAcquirer() {
				return errors.New("properties")
			}
			if v, ok := d.Annotation("x-opt-jms-msg-type"); !ok || v != int8(5) {
				return errors.New("annotation")
			}
		case value:
			if _, err := d.Body(); !errors.Is(err, amqpsub.ErrBodyKind) || d.Kind() != amqpsub.BodyValue {
				return errors.New("Body on amqp-value")
			}
			if v, err := d.Value(); err != nil || v != "hello" {
				return errors.New("Value")
			}
		case seq:
			if _, err := d.Body(); !errors.Is(err, amqpsub.ErrBodyKind) {
				return errors.New("Body on amqp-sequence")
			}
			if s, err := d.Sequence(); err != nil || len(s) != 1 || s[0][1] != "two" || d.Kind() != amqpsub.BodySequence {
				return errors.New("Sequence")
			}
		case empty:
			if b, err := d.Body(); b != nil || err != nil || d.Kind() != amqpsub.BodyEmpty {
				return errors.New("empty body")
			}
			if _, err := d.Sequence(); !errors.Is(err, amqpsub.ErrBodyKind) {
				return errors.New("Sequence on empty")
			}
			if _, ok := d.GroupSequence(); ok || d.GroupID() != "" || d.MessageID() != nil || d.ContentType() != "" ||
				d.DeliveryCount() != 0 || d.FirstAcquirer() || d.ApplicationProperties() != nil {
				return errors.New("absent properties")
			}
			if _, ok := d.Annotation("x"); ok {
				return errors.New("annotation on empty")
			}
		}
		return nil
	}, data, value, seq, empty)
	for _, err := range errs {
		t.Error(err)
	}
}

// Annotation finds a key whether the map holds it as a string (as go-amqp
// decodes symbols) or as an amqp.Symbol (as a message built in Go may).
func TestAnnotationSymbolKeys(t *testing.T) {
	str := &amqp.Message{Annotations: amqp.Annotations{"x-opt-a": int8(1)}}
	sym := &amqp.Message{Annotations: amqp.Annotations{amqp.Symbol("x-opt-a"): int8(1)}}
	wire, err := sym.MarshalBinary()
	if err != nil {
		t.Fatal(err)
	}
	decoded := new(amqp.Message)
	if err := decoded.UnmarshalBinary(wire); err != nil {
		t.Fatal(err)
	}
	if _, isString := firstKey(decoded.Annotations).(string); !isString {
		t.Fatalf("go-amqp decoded the annotation key as %T, want string", firstKey(decoded.Annotations))
	}
	errs := handleAll(t, func(d *amqpsub.Delivery) error {
		if v, ok := d.Annotation("x-opt-a"); !ok || v != int8(1) {
			return fmt.Errorf("Annotation with keys of type %T = %v, %v", firstKey(d.Message().Annotations), v, ok)
		}
		if _, ok := d.Annotation("x-opt-b"); ok {
			return errors.New("Annotation found a key that is not there")
		}
		return nil
	}, str, sym, decoded)
	for _, err := range errs {
		t.Error(err)
	}
}

func firstKey(a amqp.Annotations) any {
	for k := range a {
		return k
	}
	return nil
}

// A Delivery stays valid after its handler returned: a goroutine it was
// handed to reads the same message, not a later one.
func TestRetainedDeliveryKeepsItsMessage(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		src := fake.New(true, fake.Messages(50, "k")...)
		var kept []*amqpsub.Delivery
		var seen []int
		s, _ := amqpsub.New(amqpsub.SourceOf(src), "q", amqpsub.HandlerFunc(func(_ context.Context, d *amqpsub.Delivery) error {
			kept = append(kept, d)
			seen = append(seen, index(d))
			return nil
		}), amqpsub.Credit(2))
		cancel, errc := run(t, s)
		synctest.Wait()
		cancel()
		if err := <-errc; err != nil {
			t.Fatal(err)
		}
		for i, d := range kept {
			if index(d) != seen[i] || d.GroupID() != "k" || d.Lane() != 0 {
				t.Fatalf("delivery %d now reads message %d", seen[i], index(d))
			}
		}
	})
}

func TestGroupIDsAbsentEmptyAndLongAreHandled(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		long := strings.Repeat("g", 1<<16)
		empty := ""
		msgs := fake.Messages(30)
		for i, m := range msgs {
			switch i % 3 {
			case 0:
				m.Properties.GroupID = nil
			case 1:
				m.Properties.GroupID = &empty
			case 2:
				m.Properties.GroupID = &long
			}
		}
		msgs[0].Properties = nil
		src := fake.New(false, msgs...)
		lanes := make([]atomic.Int64, 4)
		s, _ := amqpsub.New(amqpsub.SourceOf(src), "q", amqpsub.HandlerFunc(func(_ context.Context, d *amqpsub.Delivery) error {
			if d.GroupID() != "" && d.GroupID() != long {
				return errors.New("group-id changed")
			}
			lanes[d.Lane()].Add(1)
			return nil
		}), amqpsub.WorkersByKey(4))
		cancel, errc := run(t, s)
		synctest.Wait()
		cancel()
		<-errc
		if n := src.Count(fake.Accepted); n != 30 {
			t.Fatalf("accepted %d of 30", n)
		}
		busy := 0
		for i := range lanes {
			if lanes[i].Load() > 0 {
				busy++
			}
		}
		if busy != 4 {
			t.Fatalf("keyless deliveries reached %d of 4 lanes", busy)
		}
	})
}
