package servicebus

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/base64"
	"errors"
	"fmt"
	"net"
	"net/url"
	"strconv"
	"strings"
)

// SignSAS returns a SAS token for audience, valid until the Unix time
// expiry: HMAC-SHA256 with the key's bytes (used as they are, not
// base64-decoded) over the lower-cased, URL-escaped audience, a newline and
// the expiry.
func SignSAS(keyName, key, audience string, expiry int64) string {
	sr := strings.ToLower(url.QueryEscape(audience))
	se := strconv.FormatInt(expiry, 10)
	mac := hmac.New(sha256.New, []byte(key))
	mac.Write([]byte(sr + "\n" + se))
	sig := url.QueryEscape(base64.StdEncoding.EncodeToString(mac.Sum(nil)))
	return "SharedAccessSignature sr=" + sr + "&sig=" + sig + "&se=" + se + "&skn=" + keyName
}

// ErrConnectionString is wrapped by the error ServiceBus returns for a
// connection string it cannot use; the error names the key at fault and
// quotes none of the string's values (any of them may hold the key, when
// the ';' between two is missing).
var ErrConnectionString = errors.New("amqpsub: invalid Service Bus connection string")

// ConnString is a parsed Service Bus connection string.
type ConnString struct {
	Host     string // the Endpoint's host, with :port when given
	Entity   string // EntityPath; "" when absent
	KeyName  string
	Key      string // secret
	SAS      string // secret: a pre-made SharedAccessSignature
	Emulator bool
}

// ParseConnString parses "Endpoint=sb://…;SharedAccessKeyName=…;
// SharedAccessKey=…" (or SharedAccessSignature=…), with EntityPath=… and
// UseDevelopmentEmulator=true optional, as the Azure SDKs do: keys are
// case-insensitive, segments are split on ';' and then on the first '=',
// empty segments are allowed. UseDevelopmentEmulator=true takes an sb://
// Endpoint on any host (plain AMQP, no TLS), as azservicebus does.
func ParseConnString(s string) (*ConnString, error) {
	var c ConnString
	var endpoint, emulator string
	for _, seg := range strings.Split(s, ";") {
		if strings.TrimSpace(seg) == "" {
			continue
		}
		k, v, ok := strings.Cut(seg, "=")
		if !ok {
			return nil, fmt.Errorf("%w: a segment has no '=' (keys: Endpoint, SharedAccessKeyName, SharedAccessKey, SharedAccessSignature, EntityPath, UseDevelopmentEmulator)%s", ErrConnectionString, SeparatorHint(s))
		}
		switch strings.ToLower(strings.TrimSpace(k)) {
		case "endpoint":
			endpoint = v
		case "sharedaccesskeyname":
			c.KeyName = v
		case "sharedaccesskey":
			c.Key = v
		case "sharedaccesssignature":
			c.SAS = v
		case "entitypath":
			c.Entity = v
		case "usedevelopmentemulator":
			emulator = v
		default:
			// Other keys (TransportType, …) are ignored, as the SDKs do.
		}
	}
	if endpoint == "" {
		return nil, fmt.Errorf("%w: Endpoint is missing%s", ErrConnectionString, SeparatorHint(s))
	}
	u, err := url.Parse(endpoint)
	if err != nil || u.Host == "" {
		return nil, fmt.Errorf("%w: Endpoint is not a URL like sb://<namespace>.servicebus.windows.net/%s", ErrConnectionString, SeparatorHint(s))
	}
	if u.User != nil {
		return nil, fmt.Errorf("%w: Endpoint must not hold credentials", ErrConnectionString)
	}
	if !ValidHost(u.Hostname()) {
		return nil, fmt.Errorf("%w: the Endpoint's host is not a host name or an IP address%s", ErrConnectionString, SeparatorHint(s))
	}
	c.Host = u.Host
	if emulator != "" {
		if c.Emulator, err = strconv.ParseBool(emulator); err != nil {
			return nil, fmt.Errorf("%w: UseDevelopmentEmulator is not true or false%s", ErrConnectionString, SeparatorHint(s))
		}
	}
	// The emulator speaks plain AMQP, on whatever host it is reached by:
	// localhost, or its service name in a compose file. azservicebus
	// (internal/conn/conn.go, ParseConnectionString) takes any host but
	// wants the sb scheme with it.
	if c.Emulator && u.Scheme != "sb" {
		return nil, fmt.Errorf("%w: UseDevelopmentEmulator needs an Endpoint of the form sb://<emulator host> or sb://<emulator host>:<port>", ErrConnectionString)
	}
	switch {
	case c.SAS != "" && (c.KeyName != "" || c.Key != ""):
		return nil, fmt.Errorf("%w: give SharedAccessSignature or SharedAccessKeyName with SharedAccessKey, not both", ErrConnectionString)
	case c.SAS != "":
	case c.KeyName == "" && c.Key == "":
		return nil, fmt.Errorf("%w: SharedAccessKeyName and SharedAccessKey (or SharedAccessSignature) are missing%s", ErrConnectionString, SeparatorHint(s))
	case c.KeyName == "":
		return nil, fmt.Errorf("%w: SharedAccessKeyName is missing%s", ErrConnectionString, SeparatorHint(s))
	case c.Key == "":
		return nil, fmt.Errorf("%w: SharedAccessKey is missing%s", ErrConnectionString, SeparatorHint(s))
	}
	return &c, nil
}

// SeparatorHint says, for a connection string that holds a line break or a
// tab, that its keys are separated with ';' (a .env file or a secret pasted
// with one key per line): the key then ends up inside another key's value.
func SeparatorHint(s string) string {
	if strings.ContainsAny(s, "\n\r\t") {
		return " (the string holds a line break or a tab: separate its keys with ';')"
	}
	return ""
}

// ValidHost reports whether h is an IP address or a host name (letters,
// digits, '-', '_' and dots): the namespace's FQDN, or the emulator's host,
// which may be a compose service name. It catches a secret pasted where
// the Endpoint should be, before anything quotes or dials it.
func ValidHost(h string) bool {
	if h == "" {
		return false
	}
	if net.ParseIP(h) != nil {
		return true
	}
	for _, r := range h {
		switch {
		case r >= 'a' && r <= 'z', r >= 'A' && r <= 'Z', r >= '0' && r <= '9', r == '-', r == '_', r == '.':
		default:
			return false
		}
	}
	return true
}

// InEntity reports whether a receiver may read queue with a connection
// string whose EntityPath is entity: queue is that entity, one of its
// subscriptions (entity a topic, not a subscription), or a dead-letter queue of either
// ($DeadLetterQueue, $Transfer/$DeadLetterQueue). Names compare
// case-insensitively, as Service Bus's do.
//
// azservicebus reads EntityPath (internal/conn/conn.go) but never uses it
// for a receiver, whose path comes from the queue or subscription it is
// given (receiver.go). So only queues outside the entity are refused.
func InEntity(entity, queue string) bool {
	entity = strings.TrimSuffix(entity, "/")
	if len(queue) < len(entity) || !strings.EqualFold(queue[:len(entity)], entity) {
		return false
	}
	rest := queue[len(entity):]
	if rest == "" {
		return true
	}
	rest, ok := strings.CutPrefix(rest, "/")
	if !ok {
		return false
	}
	topic := !strings.Contains(strings.ToLower(entity), "/subscriptions/")
	if topic && len(rest) > len("Subscriptions/") && strings.EqualFold(rest[:len("Subscriptions/")], "Subscriptions/") {
		// A subscription's name has no "/" and no "$" (Service Bus's
		// naming rules allow letters, digits, ".", "-" and "_").
		name, dlq, below := strings.Cut(rest[len("Subscriptions/"):], "/")
		if name == "" || strings.HasPrefix(name, "$") {
			return false
		}
		if !below {
			return true
		}
		rest = dlq
	}
	return strings.EqualFold(rest, "$DeadLetterQueue") || strings.EqualFold(rest, "$Transfer/$DeadLetterQueue")
}
