package amqpsub

import (
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/base64"
	"errors"
	"fmt"
	"net"
	"net/url"
	"strconv"
	"strings"
	"time"
)

// Token is a credential for one audience of Service Bus, put on the
// connection's $cbs node (claims-based security).
type Token struct {
	// Type is TokenTypeSAS or TokenTypeJWT.
	Type string
	// Value is the token itself: "SharedAccessSignature sr=…" for SAS, the
	// JWT for Entra ID.
	Value string
	// Expiry is when the token stops being valid; the subscriber puts a new
	// one before then. The zero time means it is never refreshed (a
	// pre-made SharedAccessSignature).
	Expiry time.Time
}

// The token types Service Bus takes on $cbs.
const (
	TokenTypeSAS = "servicebus.windows.net:sastoken"
	TokenTypeJWT = "jwt"
)

// TokenProvider gives the tokens a Service Bus connector puts on $cbs: one
// for the entity, one for its $management node, each again before it
// expires. audience is "amqps://<namespace>/<entity path>" ("amqp://" in
// emulator mode). An Entra ID provider returns type TokenTypeJWT with the
// access token for the scope "https://servicebus.azure.net/.default"; ctx
// bounds the call.
type TokenProvider interface {
	Token(ctx context.Context, audience string) (Token, error)
}

// SASTokenProvider returns a TokenProvider that signs SAS tokens with a
// shared access key, each valid for lifetime (the Azure SDKs use 2 h; must
// be > 0).
func SASTokenProvider(keyName, key string, lifetime time.Duration) TokenProvider {
	return sasProvider{keyName: keyName, key: key, lifetime: lifetime, now: time.Now}
}

type sasProvider struct {
	keyName, key string
	lifetime     time.Duration
	now          func() time.Time
}

func (p sasProvider) Token(_ context.Context, audience string) (Token, error) {
	expiry := p.now().Add(p.lifetime).Truncate(time.Second)
	return Token{Type: TokenTypeSAS, Value: signSAS(p.keyName, p.key, audience, expiry.Unix()), Expiry: expiry}, nil
}

// signSAS returns a SAS token for audience, valid until the Unix time
// expiry: HMAC-SHA256 with the key's bytes (used as they are, not
// base64-decoded) over the lower-cased, URL-escaped audience, a newline and
// the expiry.
func signSAS(keyName, key, audience string, expiry int64) string {
	sr := strings.ToLower(url.QueryEscape(audience))
	se := strconv.FormatInt(expiry, 10)
	mac := hmac.New(sha256.New, []byte(key))
	mac.Write([]byte(sr + "\n" + se))
	sig := url.QueryEscape(base64.StdEncoding.EncodeToString(mac.Sum(nil)))
	return "SharedAccessSignature sr=" + sr + "&sig=" + sig + "&se=" + se + "&skn=" + keyName
}

// staticSAS is a pre-made SharedAccessSignature: used as it is, never
// refreshed.
type staticSAS string

func (s staticSAS) Token(context.Context, string) (Token, error) {
	return Token{Type: TokenTypeSAS, Value: string(s)}, nil
}

// ErrConnectionString is wrapped by the error ServiceBus returns for a
// connection string it cannot use; the error names the key at fault and
// never quotes a secret.
var ErrConnectionString = errors.New("amqpsub: invalid Service Bus connection string")

// sbConnString is a parsed Service Bus connection string.
type sbConnString struct {
	host       string // FQDN, with :port in emulator mode when given
	entity     string // EntityPath; "" when absent
	keyName    string
	key        string // secret
	sas        string // secret: a pre-made SharedAccessSignature
	emulator   bool
	endpointIn string // the Endpoint as given, for errors (no secret in it)
}

// parseSBConnString parses "Endpoint=sb://…;SharedAccessKeyName=…;
// SharedAccessKey=…" (or SharedAccessSignature=…), with EntityPath=… and
// UseDevelopmentEmulator=true optional, as the Azure SDKs do: keys are
// case-insensitive, segments are split on ';' and then on the first '=',
// empty segments are allowed.
func parseSBConnString(s string) (*sbConnString, error) {
	var c sbConnString
	var endpoint, emulator string
	for _, seg := range strings.Split(s, ";") {
		if strings.TrimSpace(seg) == "" {
			continue
		}
		k, v, ok := strings.Cut(seg, "=")
		if !ok {
			return nil, fmt.Errorf("%w: a segment has no '=' (keys: Endpoint, SharedAccessKeyName, SharedAccessKey, SharedAccessSignature, EntityPath, UseDevelopmentEmulator)", ErrConnectionString)
		}
		switch strings.ToLower(strings.TrimSpace(k)) {
		case "endpoint":
			endpoint = v
		case "sharedaccesskeyname":
			c.keyName = v
		case "sharedaccesskey":
			c.key = v
		case "sharedaccesssignature":
			c.sas = v
		case "entitypath":
			c.entity = v
		case "usedevelopmentemulator":
			emulator = v
		default:
			// Other keys (TransportType, …) are ignored, as the SDKs do.
		}
	}
	if endpoint == "" {
		return nil, fmt.Errorf("%w: Endpoint is missing", ErrConnectionString)
	}
	c.endpointIn = endpoint
	u, err := url.Parse(endpoint)
	if err != nil || u.Host == "" {
		return nil, fmt.Errorf("%w: Endpoint %q is not a URL like sb://<namespace>.servicebus.windows.net/", ErrConnectionString, endpoint)
	}
	if u.User != nil {
		return nil, fmt.Errorf("%w: Endpoint must not hold credentials", ErrConnectionString)
	}
	c.host = u.Host
	if emulator != "" {
		if c.emulator, err = strconv.ParseBool(emulator); err != nil {
			return nil, fmt.Errorf("%w: UseDevelopmentEmulator %q is not true or false", ErrConnectionString, emulator)
		}
	}
	if c.emulator && !isLoopback(u.Hostname()) {
		return nil, fmt.Errorf("%w: UseDevelopmentEmulator needs an Endpoint on localhost (plain AMQP, no TLS), not %q", ErrConnectionString, u.Hostname())
	}
	if !c.emulator && u.Port() != "" {
		c.host = u.Hostname() // the service listens on 5671
	}
	switch {
	case c.sas != "" && (c.keyName != "" || c.key != ""):
		return nil, fmt.Errorf("%w: give SharedAccessSignature or SharedAccessKeyName with SharedAccessKey, not both", ErrConnectionString)
	case c.sas != "":
	case c.keyName == "" && c.key == "":
		return nil, fmt.Errorf("%w: SharedAccessKeyName and SharedAccessKey (or SharedAccessSignature) are missing", ErrConnectionString)
	case c.keyName == "":
		return nil, fmt.Errorf("%w: SharedAccessKeyName is missing", ErrConnectionString)
	case c.key == "":
		return nil, fmt.Errorf("%w: SharedAccessKey is missing", ErrConnectionString)
	}
	return &c, nil
}

func isLoopback(host string) bool {
	if host == "localhost" {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}
