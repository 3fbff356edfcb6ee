package amqpsub_test

import (
	"context"
	"errors"
	"fmt"
	"log"
	"reflect"
	"runtime/debug"
	"strings"
	"testing"

	"github.com/Azure/go-amqp"

	"github.com/amqpsub/amqpsub/amqpsub"
)

// Markers for an expected error: one wrapping ErrBodyKind, or any other.
type wantErr int

const (
	kindErr  wantErr = iota // errors.Is(err, amqpsub.ErrBodyKind)
	otherErr                // an error that does not wrap ErrBodyKind
)

// expect compares one view's result with want: a value (compared with
// reflect.DeepEqual) or a wantErr.
func expect(view string, got any, err error, want any) error {
	switch w := want.(type) {
	case wantErr:
		if err == nil {
			return fmt.Errorf("%s = %#v, want an error", view, got)
		}
		if is := errors.Is(err, amqpsub.ErrBodyKind); is != (w == kindErr) {
			return fmt.Errorf("%s error %q: wraps ErrBodyKind = %v, want %v", view, err, is, w == kindErr)
		}
		return nil
	default:
		if err != nil {
			return fmt.Errorf("%s: %v", view, err)
		}
		if !reflect.DeepEqual(got, want) {
			return fmt.Errorf("%s = %#v, want %#v", view, got, want)
		}
		return nil
	}
}

// jms builds a message as Artemis delivers one from Qpid JMS: the
// x-opt-jms-msg-type annotation as a byte, keyed by a string.
func jms(t amqpsub.JMSType, ct string, m *amqp.Message) *amqp.Message {
	m.Annotations = amqp.Annotations{"x-opt-jms-dest": int8(0), amqpsub.AnnotationJMSMsgType: int8(t)}
	if ct != "" {
		m.Properties = &amqp.MessageProperties{ContentType: &ct}
	}
	return m
}

func withCT(ct string, m *amqp.Message) *amqp.Message {
	m.Properties = &amqp.MessageProperties{ContentType: &ct}
	return m
}

var (
	javaString = []byte("\xac\xed\x00\x05t\x00\x06g000/5") // a serialized java.lang.String
	jmsMap     = map[string]any{"key": "g000/3", "seq": int32(3), "big": int64(1) << 40, "flag": false, "half": 1.5, "raw": []byte{1, 2, 3}}
	jmsStream  = []any{"g000/4", int32(4), true, []byte{1, 2, 3}, 0.5}
)

// Each JMS body, and the bodies around them, through every view.
func TestJMSViews(t *testing.T) {
	type want struct {
		jmsType                     any // amqpsub.JMSType, or nil for none
		text, m, stream, java, body any
	}
	cases := []struct {
		name string
		msg  *amqp.Message
		want want
	}{
		{"TextMessage", jms(amqpsub.JMSText, "", &amqp.Message{Value: "g000/1"}),
			want{amqpsub.JMSText, "g000/1", kindErr, kindErr, kindErr, kindErr}},
		{"BytesMessage", jms(amqpsub.JMSBytes, amqpsub.ContentTypeOctetStream, &amqp.Message{Data: [][]byte{[]byte("g000/2")}}),
			want{amqpsub.JMSBytes, kindErr, kindErr, kindErr, kindErr, []byte("g000/2")}},
		{"MapMessage", jms(amqpsub.JMSMap, "", &amqp.Message{Value: jmsMap}),
			want{amqpsub.JMSMap, kindErr, jmsMap, kindErr, kindErr, kindErr}},
		{"StreamMessage", jms(amqpsub.JMSStream, "", &amqp.Message{Sequence: [][]any{jmsStream}}),
			want{amqpsub.JMSStream, kindErr, kindErr, jmsStream, kindErr, kindErr}},
		{"ObjectMessage", jms(amqpsub.JMSObject, amqpsub.ContentTypeJavaSerialized, &amqp.Message{Data: [][]byte{javaString}}),
			want{amqpsub.JMSObject, kindErr, kindErr, kindErr, javaString, javaString}},
		{"Message", jms(amqpsub.JMSMessage, "", &amqp.Message{}),
			want{amqpsub.JMSMessage, "", map[string]any(nil), []any(nil), []byte(nil), []byte(nil)}},
		{"TextMessage null", jms(amqpsub.JMSText, "", &amqp.Message{}),
			want{amqpsub.JMSText, "", map[string]any(nil), []any(nil), []byte(nil), []byte(nil)}},
		{"text/plain data", withCT("text/plain; charset=UTF-8", &amqp.Message{Data: [][]byte{[]byte("h\u00e9"), []byte("llo")}}),
			want{nil, "h\u00e9llo", kindErr, kindErr, kindErr, []byte("h\u00e9llo")}},
		{"application/json data", withCT("application/json", &amqp.Message{Data: [][]byte{[]byte(`{}`)}}),
			want{nil, `{}`, kindErr, kindErr, kindErr, []byte(`{}`)}},
		{"text/plain not UTF-8", withCT("text/plain", &amqp.Message{Data: [][]byte{{0xff}}}),
			want{nil, otherErr, kindErr, kindErr, kindErr, []byte{0xff}}},
		{"text/plain latin-1", withCT("text/plain; charset=iso-8859-1", &amqp.Message{Data: [][]byte{[]byte("x")}}),
			want{nil, kindErr, kindErr, kindErr, kindErr, []byte("x")}},
		{"bad content-type", withCT("text/plain; ;", &amqp.Message{Data: [][]byte{[]byte("x")}}),
			want{nil, kindErr, kindErr, kindErr, kindErr, []byte("x")}},
		{"data without content-type", &amqp.Message{Data: [][]byte{[]byte("x")}},
			want{nil, kindErr, kindErr, kindErr, kindErr, []byte("x")}},
		{"int amqp-value", &amqp.Message{Value: int64(7)},
			want{nil, kindErr, kindErr, kindErr, kindErr, kindErr}},
		{"map with an int key", &amqp.Message{Value: map[any]any{int64(1): "a", "b": "c"}},
			want{nil, kindErr, kindErr, kindErr, kindErr, kindErr}},
		{"empty map", &amqp.Message{Value: map[any]any{}},
			want{nil, kindErr, map[string]any{}, kindErr, kindErr, kindErr}},
		{"map with symbol keys", &amqp.Message{Value: map[any]any{amqp.Symbol("s"): int32(1)}},
			want{nil, kindErr, map[string]any{"s": int32(1)}, kindErr, kindErr, kindErr}},
		{"amqp-value list", &amqp.Message{Value: []any{"a", int64(1)}},
			want{nil, kindErr, kindErr, []any{"a", int64(1)}, kindErr, kindErr}},
		{"two amqp-sequence sections", &amqp.Message{Sequence: [][]any{{int64(1)}, {int64(2), "x"}}},
			want{nil, kindErr, kindErr, []any{int64(1), int64(2), "x"}, kindErr, kindErr}},
		{"symbol annotation key", &amqp.Message{Value: "s", Annotations: amqp.Annotations{amqp.Symbol(amqpsub.AnnotationJMSMsgType): int8(5)}},
			want{amqpsub.JMSText, "s", kindErr, kindErr, kindErr, kindErr}},
		{"int32 msg-type", &amqp.Message{Value: "s", Annotations: amqp.Annotations{amqpsub.AnnotationJMSMsgType: int32(4)}},
			want{amqpsub.JMSStream, "s", kindErr, kindErr, kindErr, kindErr}},
		{"unknown msg-type", &amqp.Message{Annotations: amqp.Annotations{amqpsub.AnnotationJMSMsgType: uint8(9)}},
			want{amqpsub.JMSType(9), "", map[string]any(nil), []any(nil), []byte(nil), []byte(nil)}},
		{"msg-type out of range", &amqp.Message{Annotations: amqp.Annotations{amqpsub.AnnotationJMSMsgType: int64(300)}},
			want{nil, "", map[string]any(nil), []any(nil), []byte(nil), []byte(nil)}},
		{"msg-type a string", &amqp.Message{Annotations: amqp.Annotations{amqpsub.AnnotationJMSMsgType: "5"}},
			want{nil, "", map[string]any(nil), []any(nil), []byte(nil), []byte(nil)}},
	}
	byMsg := map[*amqp.Message]int{}
	msgs := make([]*amqp.Message, len(cases))
	for i, c := range cases {
		byMsg[c.msg], msgs[i] = i, c.msg
	}
	errs := handleAll(t, func(d *amqpsub.Delivery) error {
		c := cases[byMsg[d.Message()]]
		var problems []string
		add := func(err error) {
			if err != nil {
				problems = append(problems, err.Error())
			}
		}
		typ, ok := d.JMSMessageType()
		switch {
		case c.want.jmsType == nil && ok:
			add(fmt.Errorf("JMSMessageType = %v, want none", typ))
		case c.want.jmsType != nil && (!ok || typ != c.want.jmsType):
			add(fmt.Errorf("JMSMessageType = %v, %v, want %v", typ, ok, c.want.jmsType))
		}
		s, err := d.Text()
		add(expect("Text", s, err, c.want.text))
		m, err := d.Map()
		add(expect("Map", m, err, c.want.m))
		l, err := d.Stream()
		add(expect("Stream", l, err, c.want.stream))
		j, err := d.JavaSerialized()
		add(expect("JavaSerialized", j, err, c.want.java))
		b, err := d.Body()
		add(expect("Body", b, err, c.want.body))
		if len(problems) > 0 {
			return fmt.Errorf("%s: %s", c.name, strings.Join(problems, "; "))
		}
		return nil
	}, msgs...)
	for _, err := range errs {
		t.Error(err)
	}
}

// A mismatch says what the body is, so a handler can pass the error on.
func TestJMSViewErrorsSayWhatTheBodyIs(t *testing.T) {
	obj := jms(amqpsub.JMSObject, amqpsub.ContentTypeJavaSerialized, &amqp.Message{Data: [][]byte{javaString}})
	errs := handleAll(t, func(d *amqpsub.Delivery) error {
		_, err := d.Text()
		want := "amqpsub: body is of another kind: want text, have data " +
			"(content-type application/x-java-serialized-object, JMS ObjectMessage): " +
			"content-type application/x-java-serialized-object is not text"
		if err == nil || err.Error() != want {
			return fmt.Errorf("Text on an ObjectMessage: %v\nwant %s", err, want)
		}
		_, err = d.Map()
		if want := "want a map (an amqp-value map), have data (content-type application/x-java-serialized-object, JMS ObjectMessage)"; err == nil || !strings.HasSuffix(err.Error(), want) {
			return fmt.Errorf("Map on an ObjectMessage: %v", err)
		}
		return nil
	}, obj)
	for _, err := range errs {
		t.Error(err)
	}
}

func TestJMSTypeString(t *testing.T) {
	for typ, want := range map[amqpsub.JMSType]string{
		amqpsub.JMSMessage: "Message", amqpsub.JMSObject: "ObjectMessage", amqpsub.JMSMap: "MapMessage",
		amqpsub.JMSBytes: "BytesMessage", amqpsub.JMSStream: "StreamMessage", amqpsub.JMSText: "TextMessage",
		amqpsub.JMSType(6): "JMSType(6)", amqpsub.JMSType(-1): "JMSType(-1)",
	} {
		if got := typ.String(); got != want {
			t.Errorf("%d.String() = %q, want %q", int8(typ), got, want)
		}
	}
}

// callViews calls every accessor of d and reports a panic as an error. The
// subscriber would recover a panic too, as a retry, which the fake source
// would redeliver for ever.
func callViews(d *amqpsub.Delivery) (err error) {
	defer func() {
		if p := recover(); p != nil {
			err = fmt.Errorf("panic: %v\n%s", p, debug.Stack())
		}
	}()
	check := func(view string, err error) error {
		if err != nil && !errors.Is(err, amqpsub.ErrBodyKind) && (view != "Text" || !strings.Contains(err.Error(), "not valid UTF-8")) {
			return fmt.Errorf("%s: unexpected error %v", view, err)
		}
		return nil
	}
	_, _ = d.JMSMessageType()
	_ = d.Kind()
	_, _ = d.GroupSequence()
	_, _, _, _ = d.GroupID(), d.MessageID(), d.ContentType(), d.DeliveryCount()
	_, _, _ = d.FirstAcquirer(), d.ApplicationProperties(), d.Lane()
	_, _ = d.Annotation(amqpsub.AnnotationJMSMsgType)
	_, e1 := d.Text()
	_, e2 := d.Map()
	_, e3 := d.Stream()
	_, e4 := d.JavaSerialized()
	_, e5 := d.Body()
	_, e6 := d.Value()
	_, e7 := d.Sequence()
	return errors.Join(check("Text", e1), check("Map", e2), check("Stream", e3), check("JavaSerialized", e4),
		check("Body", e5), check("Value", e6), check("Sequence", e7))
}

// Messages off the wire, whatever they hold: no accessor panics, and each
// error is a body-kind mismatch (or text that is not UTF-8).
func FuzzDeliveryAccessors(f *testing.F) {
	seeds := []*amqp.Message{
		jms(amqpsub.JMSText, "", &amqp.Message{Value: "g000/1"}),
		jms(amqpsub.JMSBytes, amqpsub.ContentTypeOctetStream, &amqp.Message{Data: [][]byte{[]byte("g000/2")}}),
		jms(amqpsub.JMSMap, "", &amqp.Message{Value: jmsMap}),
		jms(amqpsub.JMSStream, "", &amqp.Message{Sequence: [][]any{jmsStream}}),
		jms(amqpsub.JMSObject, amqpsub.ContentTypeJavaSerialized, &amqp.Message{Data: [][]byte{javaString}}),
		withCT("text/plain; charset=utf-8", &amqp.Message{Data: [][]byte{[]byte("a"), []byte("b")}}),
		{Value: map[any]any{int64(1): "a"}},
		{Value: []any{"x", int64(1)}},
		{},
	}
	for _, m := range seeds {
		b, err := m.MarshalBinary()
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
	// Message annotations keyed by an empty list: go-amqp's decoder panics.
	f.Add([]byte("\x00Sr\xd1\x00\x00\x00\x04\x00\x00\x00\x02\x45\x45\x00Sw\xa1\x01x"))
	f.Fuzz(func(t *testing.T, b []byte) {
		m, err := decode(b)
		if err != nil {
			t.Skip(err)
		}
		for _, err := range handleAll(t, callViews, m) {
			t.Error(err)
		}
	})
}

// decode unmarshals a message as go-amqp's receiver does. go-amqp v1.7.0
// panics on annotations keyed by an unhashable value (a list, a map, binary:
// `hash of unhashable type`), in the connection's own goroutine on a real
// link; that is no Delivery accessor's doing, so it counts as an error here.
func decode(b []byte) (m *amqp.Message, err error) {
	defer func() {
		if p := recover(); p != nil {
			err = fmt.Errorf("go-amqp panicked decoding the message: %v", p)
		}
	}()
	m = new(amqp.Message)
	return m, m.UnmarshalBinary(b)
}

// A handler for messages from JMS producers: each body through its typed
// view; what Go cannot use is dead-lettered with a reason that says what it
// was.
func ExampleDelivery_JMSMessageType() {
	h := amqpsub.HandlerFunc(func(ctx context.Context, d *amqpsub.Delivery) error {
		typ, _ := d.JMSMessageType()
		switch typ {
		case amqpsub.JMSText:
			text, err := d.Text()
			if err != nil {
				return amqpsub.Reject(err.Error())
			}
			fmt.Println("text:", text)
		case amqpsub.JMSMap:
			m, err := d.Map()
			if err != nil {
				return amqpsub.Reject(err.Error())
			}
			fmt.Println("order", m["id"], "amount", m["amount"])
		case amqpsub.JMSBytes:
			b, err := d.Body()
			if err != nil {
				return amqpsub.Reject(err.Error())
			}
			fmt.Println(len(b), "bytes")
		default: // ObjectMessage (serialized Java), StreamMessage, ...
			return amqpsub.Reject(fmt.Sprintf("cannot handle a JMS %v", typ))
		}
		return nil
	})
	sub, err := amqpsub.New(amqpsub.Dial("amqp://127.0.0.1:5672", nil), "orders", h)
	if err != nil {
		log.Fatal(err)
	}
	_ = sub // sub.Run(ctx)
}
