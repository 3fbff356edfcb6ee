package amqpsub

import (
	"errors"
	"fmt"
	"mime"
	"strings"
	"unicode/utf8"

	"github.com/Azure/go-amqp"

	"github.com/amqpsub/amqpsub/internal/amqpint"
)

// Typed views of the bodies that JMS clients over AMQP 1.0 (Qpid JMS, and
// Artemis converting from its other protocols) send, following the AMQP JMS
// mapping:
//
//	JMS type       x-opt-jms-msg-type  body section       content-type                          view
//	Message        0                   none               -                                     Kind() == BodyEmpty
//	ObjectMessage  1                   data               application/x-java-serialized-object  JavaSerialized
//	MapMessage     2                   amqp-value map     -                                     Map
//	BytesMessage   3                   data               application/octet-stream              Body
//	StreamMessage  4                   amqp-sequence      -                                     Stream
//	TextMessage    5                   amqp-value string  -                                     Text
//
// Each view returns an error wrapping ErrBodyKind, which names what the body
// is, when the message holds something else; none of them panics.

// JMSType is the JMS message type that a JMS producer records in the
// message annotation x-opt-jms-msg-type. It is not the JMSType header, which
// arrives as the AMQP subject.
type JMSType int8

// The JMS message types, with the values of the AMQP JMS mapping.
const (
	// JMSMessage: a plain Message, without a body.
	JMSMessage JMSType = 0
	// JMSObject: an ObjectMessage, a serialized Java object; see
	// [Delivery.JavaSerialized].
	JMSObject JMSType = 1
	// JMSMap: a MapMessage; see [Delivery.Map].
	JMSMap JMSType = 2
	// JMSBytes: a BytesMessage; see [Delivery.Body].
	JMSBytes JMSType = 3
	// JMSStream: a StreamMessage; see [Delivery.Stream].
	JMSStream JMSType = 4
	// JMSText: a TextMessage; see [Delivery.Text].
	JMSText JMSType = 5
)

var jmsTypeNames = [...]string{"Message", "ObjectMessage", "MapMessage", "BytesMessage", "StreamMessage", "TextMessage"}

func (t JMSType) String() string {
	if t >= 0 && int(t) < len(jmsTypeNames) {
		return jmsTypeNames[t]
	}
	return fmt.Sprintf("JMSType(%d)", int8(t))
}

// Annotation and content-type values of the AMQP JMS mapping.
const (
	// AnnotationJMSMsgType is the message annotation holding the [JMSType],
	// a byte.
	AnnotationJMSMsgType = "x-opt-jms-msg-type"
	// ContentTypeJavaSerialized is the content-type of an ObjectMessage's
	// data section.
	ContentTypeJavaSerialized = "application/x-java-serialized-object"
	// ContentTypeOctetStream is the content-type of a BytesMessage's data
	// section.
	ContentTypeOctetStream = "application/octet-stream"
)

// JMSMessageType returns the JMS message type from the x-opt-jms-msg-type
// annotation, and false when the message has none (it did not come from a
// JMS producer) or it is not a byte-sized integer. A value outside the six
// known types is returned as it is.
func (d *Delivery) JMSMessageType() (JMSType, bool) { return jmsMessageType(d.msg) }

func jmsMessageType(m *amqp.Message) (JMSType, bool) {
	v, ok := annotation(m, AnnotationJMSMsgType)
	if !ok {
		return 0, false
	}
	n, ok := amqpint.Int(v)
	if !ok {
		return 0, false
	}
	if n < -128 || n > 127 {
		return 0, false
	}
	return JMSType(n), true
}

// Text returns a text body: an amqp-value string (a JMS TextMessage), or
// data sections whose content-type is text/*, application/json or
// application/xml, in UTF-8 (no charset, or charset utf-8 or us-ascii). An
// empty body, such as a TextMessage whose text is null, gives "", nil. Any
// other body gives an error wrapping ErrBodyKind; data that is not valid
// UTF-8 gives an error too.
func (d *Delivery) Text() (string, error) {
	m := d.msg
	switch bodyKind(m) {
	case BodyEmpty:
		return "", nil
	case BodyValue:
		if s, ok := m.Value.(string); ok {
			return s, nil
		}
	case BodyData:
		ct := contentType(m)
		if err := textContentType(ct); err != nil {
			return "", fmt.Errorf("%w: want text, have %s: %w", ErrBodyKind, describeBody(m), err)
		}
		b, _ := dataBody(m)
		if !utf8.Valid(b) {
			return "", fmt.Errorf("amqpsub: text body (content-type %q) is not valid UTF-8", ct)
		}
		return string(b), nil
	}
	return "", fmt.Errorf("%w: want text (an amqp-value string), have %s", ErrBodyKind, describeBody(m))
}

// textContentType says whether ct names UTF-8 text, and if not, why.
func textContentType(ct string) error {
	if ct == "" {
		return errors.New("no content-type says it is text")
	}
	mt, params, err := mime.ParseMediaType(ct)
	if err != nil {
		return fmt.Errorf("content-type: %w", err)
	}
	if !strings.HasPrefix(mt, "text/") && mt != "application/json" && mt != "application/xml" {
		return fmt.Errorf("content-type %s is not text", mt)
	}
	switch cs := strings.ToLower(params["charset"]); cs {
	case "", "utf-8", "utf8", "us-ascii":
		return nil
	default:
		return fmt.Errorf("charset %s is not UTF-8", cs)
	}
}

// Map returns an amqp-value map with string keys, the body of a JMS
// MapMessage. Its values keep their decoded types (int32 for a JMS int,
// int64 for a long, []byte for bytes, and so on); the map belongs to the
// message, do not modify it. An empty body gives nil, nil. Another body, or
// a map with a key that is not a string, gives an error wrapping
// [ErrBodyKind].
func (d *Delivery) Map() (map[string]any, error) {
	m := d.msg
	if bodyKind(m) != BodyValue {
		if bodyKind(m) == BodyEmpty {
			return nil, nil
		}
		return nil, fmt.Errorf("%w: want a map (an amqp-value map), have %s", ErrBodyKind, describeBody(m))
	}
	switch v := m.Value.(type) {
	case map[string]any:
		return v, nil
	case map[any]any:
		out := make(map[string]any, len(v))
		for k, e := range v {
			switch k := k.(type) {
			case string:
				out[k] = e
			case amqp.Symbol:
				out[string(k)] = e
			default:
				return nil, fmt.Errorf("%w: want a map with string keys, have a key of type %T", ErrBodyKind, k)
			}
		}
		return out, nil
	}
	return nil, fmt.Errorf("%w: want a map (an amqp-value map), have %s", ErrBodyKind, describeBody(m))
}

// Stream returns the items of a JMS StreamMessage: the amqp-sequence
// sections joined, or an amqp-value list. The items keep their decoded
// types and belong to the message. An empty body gives nil, nil; another
// body gives an error wrapping [ErrBodyKind].
func (d *Delivery) Stream() ([]any, error) {
	m := d.msg
	switch bodyKind(m) {
	case BodyEmpty:
		return nil, nil
	case BodySequence:
		if len(m.Sequence) == 1 {
			return m.Sequence[0], nil
		}
		var out []any
		for _, s := range m.Sequence {
			out = append(out, s...)
		}
		return out, nil
	case BodyValue:
		if l, ok := m.Value.([]any); ok {
			return l, nil
		}
	}
	return nil, fmt.Errorf("%w: want a stream (amqp-sequence), have %s", ErrBodyKind, describeBody(m))
}

// JavaSerialized returns the body of a JMS ObjectMessage: the bytes of a
// Java-serialized object, in data sections with content-type
// application/x-java-serialized-object. Go cannot decode them; hand them to
// Java, or reject the message. An empty body gives nil, nil; another body
// gives an error wrapping [ErrBodyKind].
func (d *Delivery) JavaSerialized() ([]byte, error) {
	m := d.msg
	switch bodyKind(m) {
	case BodyEmpty:
		return nil, nil
	case BodyData:
		if contentType(m) == ContentTypeJavaSerialized {
			return dataBody(m)
		}
	}
	return nil, fmt.Errorf("%w: want data with content-type %s, have %s", ErrBodyKind, ContentTypeJavaSerialized, describeBody(m))
}

// describeBody says what a body is, for errors: its kind, the Go type of an
// amqp-value, the content-type and the JMS type when set.
func describeBody(m *amqp.Message) string {
	k := bodyKind(m)
	s := k.String()
	if k == BodyValue {
		s = fmt.Sprintf("%s of type %T", s, m.Value)
	}
	var extra []string
	if ct := contentType(m); ct != "" {
		extra = append(extra, "content-type "+ct)
	}
	if t, ok := jmsMessageType(m); ok {
		extra = append(extra, "JMS "+t.String())
	}
	if len(extra) > 0 {
		s += " (" + strings.Join(extra, ", ") + ")"
	}
	return s
}

func contentType(m *amqp.Message) string {
	if p := m.Properties; p != nil && p.ContentType != nil {
		return *p.ContentType
	}
	return ""
}
