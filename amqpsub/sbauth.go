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
	// one before then. The zero time means it is never refreshed, and is
	// for a pre-made SAS token only (TokenTypeSAS): a token of any other
	// type with no Expiry is refused with an error wrapping
	// ErrInvalidOption, since Service Bus would detach the links when it
	// expired.
	Expiry time.Time
}

// The token types Service Bus takes on $cbs.
const (
	TokenTypeSAS = "servicebus.windows.net:sastoken"
	TokenTypeJWT = "jwt"
)

// TokenProvider gives the tokens a Service Bus connector puts on $cbs.
//
// audience is "amqps://<namespace>/<entity path>" ("amqp://" in emulator
// mode), for the entity and for "<entity path>/$management". An Entra ID
// provider returns type TokenTypeJWT with the access token for the scope
// "https://servicebus.azure.net/.default" (the same token for every
// audience) and its expiry.
//
// When Token is called: each connection asks for one token per audience
// (two calls, one after the other) when it connects, and again for each
// audience 10 minutes before its token's Expiry (halfway, for a token that
// lives less than 20 minutes). A subscriber has a connection of its own
// for each session it holds (Sessions, SessionIDs) and makes a new one
// after a lost connection, so Token is called concurrently and must be
// safe for concurrent use; a provider that can should cache its token.
//
// Each call is bounded by ctx's deadline: DialTimeout when connecting;
// 30 s, and no later than the token in place expires, for a refresh. Token
// should return when ctx ends; one that does not is left to return in its
// own time (its result is dropped), and does not hold up Run or Close. A
// refresh that fails (an error, a deadline, no answer from $cbs) is tried
// again, after waits that double from about 1 s up to 30 s (jittered),
// until 30 s (at most a tenth of the token's lifetime) before the token in
// place expires; then the connection is dropped and made anew, which asks
// for tokens again. A token the service refuses (status 401 or 403) drops the
// connection at once, and the reconnect's refusal ends Run (IsFatal).
//
// An adapter for azidentity (any azcore.TokenCredential), kept out of
// amqpsub so that its go.mod stays small:
//
//	type entraTokens struct{ cred azcore.TokenCredential }
//
//	func (e entraTokens) Token(ctx context.Context, _ string) (amqpsub.Token, error) {
//		t, err := e.cred.GetToken(ctx, policy.TokenRequestOptions{
//			Scopes: []string{"https://servicebus.azure.net/.default"},
//		})
//		if err != nil {
//			return amqpsub.Token{}, err
//		}
//		return amqpsub.Token{Type: amqpsub.TokenTypeJWT, Value: t.Token, Expiry: t.ExpiresOn}, nil
//	}
//
//	cred, err := azidentity.NewDefaultAzureCredential(nil) // azidentity caches and refreshes the token
//	...
//	c, err := amqpsub.ServiceBusWithToken("sb://<namespace>.servicebus.windows.net", entraTokens{cred})
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
// quotes none of the string's values (any of them may hold the key, when
// the ';' between two is missing).
var ErrConnectionString = errors.New("amqpsub: invalid Service Bus connection string")

// sbConnString is a parsed Service Bus connection string.
type sbConnString struct {
	host     string // the Endpoint's host, with :port when given
	entity   string // EntityPath; "" when absent
	keyName  string
	key      string // secret
	sas      string // secret: a pre-made SharedAccessSignature
	emulator bool
}

// parseSBConnString parses "Endpoint=sb://…;SharedAccessKeyName=…;
// SharedAccessKey=…" (or SharedAccessSignature=…), with EntityPath=… and
// UseDevelopmentEmulator=true optional, as the Azure SDKs do: keys are
// case-insensitive, segments are split on ';' and then on the first '=',
// empty segments are allowed. UseDevelopmentEmulator=true takes an sb://
// Endpoint on any host (plain AMQP, no TLS), as azservicebus does.
func parseSBConnString(s string) (*sbConnString, error) {
	var c sbConnString
	var endpoint, emulator string
	for _, seg := range strings.Split(s, ";") {
		if strings.TrimSpace(seg) == "" {
			continue
		}
		k, v, ok := strings.Cut(seg, "=")
		if !ok {
			return nil, fmt.Errorf("%w: a segment has no '=' (keys: Endpoint, SharedAccessKeyName, SharedAccessKey, SharedAccessSignature, EntityPath, UseDevelopmentEmulator)%s", ErrConnectionString, separatorHint(s))
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
		return nil, fmt.Errorf("%w: Endpoint is missing%s", ErrConnectionString, separatorHint(s))
	}
	u, err := url.Parse(endpoint)
	if err != nil || u.Host == "" {
		return nil, fmt.Errorf("%w: Endpoint is not a URL like sb://<namespace>.servicebus.windows.net/%s", ErrConnectionString, separatorHint(s))
	}
	if u.User != nil {
		return nil, fmt.Errorf("%w: Endpoint must not hold credentials", ErrConnectionString)
	}
	if !validHost(u.Hostname()) {
		return nil, fmt.Errorf("%w: the Endpoint's host is not a host name or an IP address%s", ErrConnectionString, separatorHint(s))
	}
	c.host = u.Host
	if emulator != "" {
		if c.emulator, err = strconv.ParseBool(emulator); err != nil {
			return nil, fmt.Errorf("%w: UseDevelopmentEmulator is not true or false%s", ErrConnectionString, separatorHint(s))
		}
	}
	// The emulator speaks plain AMQP, on whatever host it is reached by:
	// localhost, or its service name in a compose file. azservicebus
	// (internal/conn/conn.go, ParseConnectionString) takes any host but
	// wants the sb scheme with it.
	if c.emulator && u.Scheme != "sb" {
		return nil, fmt.Errorf("%w: UseDevelopmentEmulator needs an Endpoint of the form sb://<emulator host> or sb://<emulator host>:<port>", ErrConnectionString)
	}
	switch {
	case c.sas != "" && (c.keyName != "" || c.key != ""):
		return nil, fmt.Errorf("%w: give SharedAccessSignature or SharedAccessKeyName with SharedAccessKey, not both", ErrConnectionString)
	case c.sas != "":
	case c.keyName == "" && c.key == "":
		return nil, fmt.Errorf("%w: SharedAccessKeyName and SharedAccessKey (or SharedAccessSignature) are missing%s", ErrConnectionString, separatorHint(s))
	case c.keyName == "":
		return nil, fmt.Errorf("%w: SharedAccessKeyName is missing%s", ErrConnectionString, separatorHint(s))
	case c.key == "":
		return nil, fmt.Errorf("%w: SharedAccessKey is missing%s", ErrConnectionString, separatorHint(s))
	}
	return &c, nil
}

// separatorHint says, for a connection string that holds a line break or a
// tab, that its keys are separated with ';' (a .env file or a secret pasted
// with one key per line): the key then ends up inside another key's value.
func separatorHint(s string) string {
	if strings.ContainsAny(s, "\n\r\t") {
		return " (the string holds a line break or a tab: separate its keys with ';')"
	}
	return ""
}

// validHost reports whether h is an IP address or a host name (letters,
// digits, '-', '_' and dots): the namespace's FQDN, or the emulator's host,
// which may be a compose service name. It catches a secret pasted where
// the Endpoint should be, before anything quotes or dials it.
func validHost(h string) bool {
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
