package amqpsub

// Service Bus through ServiceBus, ServiceBusWithToken, New and Run, with no
// server but a listener of the test's own: the connection string and the
// endpoint (SAS signing, parse errors that quote no value, the emulator on
// any host, the port dialled), and tokens without an Expiry. The tests
// against the Service Bus peer are in servicebus_peer_test.go (build tag
// peer).

import (
	"context"
	"errors"
	"io"
	"math/rand/v2"
	"net"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"

	"github.com/amqpsub/amqpsub/internal/driver/servicebus"
)

// Helpers for the tests that run against the scripted Service Bus peer
// (integration/sbpeer), for the internals a black-box test cannot reach.
// They skip without AMQPSUB_SBPEER_CONN and AMQPSUB_SBPEER_CONTROL.

func sbTestLog(t *testing.T) *zap.Logger { return zaptest.NewLogger(t, zaptest.Level(zap.WarnLevel)) }

// An explicit port in the endpoint is dialled, with TLS unless the
// emulator is asked for, and errors name the host and port dialled.
func TestServiceBusEndpointPort(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	addr := ln.Addr().String()
	// What each connection opens with: a TLS ClientHello (0x16) or the
	// AMQP header.
	first := make(chan byte, 16)
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			b := make([]byte, 1)
			_ = c.SetDeadline(time.Now().Add(5 * time.Second))
			if _, err := io.ReadFull(c, b); err == nil {
				first <- b[0]
			}
			c.Close()
		}
	}()
	tp := SASTokenProvider("Root", "k", time.Hour)
	for _, tc := range []struct {
		name string
		c    func() (Connector, error)
		tls  bool
	}{
		{"connection string", func() (Connector, error) {
			return ServiceBus("Endpoint=sb://" + addr + "/;SharedAccessKeyName=Root;SharedAccessKey=k")
		}, true},
		{"connection string, emulator", func() (Connector, error) {
			return ServiceBus("Endpoint=sb://" + addr + ";SharedAccessKeyName=Root;SharedAccessKey=k;UseDevelopmentEmulator=true")
		}, false},
		{"sb://", func() (Connector, error) { return ServiceBusWithToken("sb://"+addr, tp) }, true},
		{"amqps://", func() (Connector, error) { return ServiceBusWithToken("amqps://"+addr+"/", tp) }, true},
		{"amqp://", func() (Connector, error) { return ServiceBusWithToken("amqp://"+addr, tp) }, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c, err := tc.c()
			if err != nil {
				t.Fatal(err)
			}
			s, err := New(c, "q", HandlerFunc(func(context.Context, *Delivery) error { return nil }),
				DialTimeout(2*time.Second), Logger(sbTestLog(t)))
			if err != nil {
				t.Fatal(err)
			}
			err = s.Run(context.Background())
			t.Logf("Run: %v", err)
			if err == nil || !strings.Contains(err.Error(), addr) {
				t.Errorf("Run = %v: want an error naming %s", err, addr)
			}
			select {
			case b := <-first:
				if isTLS := b == 0x16; isTLS != tc.tls {
					t.Fatalf("the connection opened with %#x: TLS %v, want %v", b, isTLS, tc.tls)
				}
			case <-time.After(5 * time.Second):
				t.Fatalf("no connection to %s", addr)
			}
		})
	}
}

// The known answer of the Azure SDK for Go's own test of its SAS signer
// (sdk/messaging/azservicebus/internal/sas/sas_test.go,
// TestTokenProviderWithKey): key name "keyName", key "key", audience
// "audience", expiry 2020-01-01T01:02:03Z + 72 h.
func TestSASTokenKnownAnswer(t *testing.T) {
	now, _ := time.Parse(time.RFC3339, "2020-01-01T01:02:03Z")
	p := sasProvider{keyName: "keyName", key: "key", lifetime: 72 * time.Hour, now: func() time.Time { return now }}
	tok, err := p.Token(context.Background(), "audience")
	if err != nil {
		t.Fatal(err)
	}
	const want = "SharedAccessSignature sr=audience&sig=8UM0iIfFCfeBSqxSdBMW8pUbhAm7mnjSUaIZTZx8V0g%3D&se=1578099723&skn=keyName"
	if tok.Value != want || tok.Type != TokenTypeSAS || tok.Expiry.Unix() != 1578099723 {
		t.Fatalf("token %+v\nwant %s", tok, want)
	}
	// The same test file's TestNewSigner: the audience is escaped, then
	// lower-cased.
	if v := servicebus.SignSAS("foo", "superSecret", "http://MiCrosoft.com", 1); !strings.HasPrefix(v, "SharedAccessSignature sr=http%3a%2f%2fmicrosoft.com&") {
		t.Fatalf("audience not escaped and lower-cased: %s", v)
	}
}

// The key must not reach an error through another key's value: a string
// with line breaks or tabs where the ';' should be, or a whole connection
// string given to ServiceBusWithToken.
func TestConnectionStringErrorsQuoteNoValue(t *testing.T) {
	const secret = "c2VjcmV0LWtleS12YWx1ZQ=="
	for _, cs := range []string{
		// one key per line (a .env file or a Kubernetes secret pasted as is)
		"Endpoint=sb://ns.servicebus.windows.net/\nSharedAccessKeyName=RootManageSharedAccessKey\nSharedAccessKey=" + secret,
		"Endpoint=sb://ns.servicebus.windows.net/\r\nSharedAccessKeyName=Root\r\nSharedAccessKey=" + secret,
		// a tab where the ';' should be
		"Endpoint=sb://ns.servicebus.windows.net/\tSharedAccessKey=" + secret + ";SharedAccessKeyName=Root",
		// UseDevelopmentEmulator on a line of its own, the key after it
		"Endpoint=sb://localhost;SharedAccessKeyName=Root;UseDevelopmentEmulator=true\nSharedAccessKey=" + secret,
		// the key in the Endpoint's place
		"Endpoint=" + secret + ";SharedAccessKeyName=Root",
		"Endpoint=sb://" + secret + ";SharedAccessKeyName=Root;SharedAccessKey=k;UseDevelopmentEmulator=true",
		"Endpoint=sb://localhost;SharedAccessKeyName=Root;SharedAccessKey=k;UseDevelopmentEmulator=" + secret,
	} {
		_, err := ServiceBus(cs)
		if err == nil || !errors.Is(err, ErrConnectionString) {
			t.Errorf("%q: %v, want an error wrapping ErrConnectionString", cs, err)
			continue
		}
		if strings.Contains(err.Error(), secret) {
			t.Errorf("the error quotes the key: %v", err)
		}
		if strings.ContainsAny(cs, "\n\t") && !strings.Contains(err.Error(), "separate its keys with ';'") {
			t.Errorf("no hint about the separators: %v", err)
		}
	}
	for _, endpoint := range []string{
		"Endpoint=sb://ns.servicebus.windows.net/;SharedAccessKeyName=Root;SharedAccessKey=" + secret,
		"sb://ns.servicebus.windows.net/\nSharedAccessKey=" + secret,
		"amqp://" + secret + ":5672",
		"http://ns/" + secret,
	} {
		_, err := ServiceBusWithToken(endpoint, SASTokenProvider("Root", "k", time.Hour))
		if err == nil || !errors.Is(err, ErrInvalidOption) {
			t.Errorf("%q: %v, want an error wrapping ErrInvalidOption", endpoint, err)
			continue
		}
		if strings.Contains(err.Error(), secret) {
			t.Errorf("the error quotes the endpoint: %v", err)
		}
	}
}

// fuzzSecret returns a key made of chunks of random base64 drawn from seed
// (long enough never to occur in an error's own words), joined by mid: any
// bytes, a separator too.
func fuzzSecret(seed uint64, mid string) (secret string, chunks []string) {
	const b64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
	r := rand.New(rand.NewPCG(seed, seed^0x5bd1e995))
	for range 2 {
		b := make([]byte, 12)
		for i := range b {
			b[i] = b64[r.IntN(len(b64))]
		}
		chunks = append(chunks, string(b))
	}
	return chunks[0] + mid + chunks[1] + "==", chunks
}

// Connection strings come from users' configuration: any string parses or
// fails with ErrConnectionString, never panics, and no error, of ServiceBus
// or of ServiceBusWithToken given the string by mistake, holds any part of
// the key, wherever it stands: as SharedAccessKey or SharedAccessSignature,
// inside another key's value, after a line break or a tab in place of ';',
// or as a value of its own.
func FuzzParseConnectionString(f *testing.F) {
	for _, seed := range []struct {
		s, prefix, mid string
		at             uint
		sep            byte
	}{
		{"Endpoint=sb://ns.servicebus.windows.net/;SharedAccessKeyName=Root", ";SharedAccessKey=", "", 1000, ';'},
		{"Endpoint=sb://ns.servicebus.windows.net/\nSharedAccessKeyName=Root", "\nSharedAccessKey=", "", 1000, '\n'},
		{"Endpoint=sb://ns.servicebus.windows.net/\tSharedAccessKeyName=Root", "\tSharedAccessKey=", "", 42, '\t'},
		{"Endpoint=sb://localhost;SharedAccessKeyName=Root;UseDevelopmentEmulator=true", "\nSharedAccessKey=", "", 1000, ';'},
		{"Endpoint=sb://localhost:5672;UseDevelopmentEmulator=true", ";SharedAccessSignature=SharedAccessSignature sr=x&sig=", "=;", 1000, '&'},
		{"Endpoint=sb://ns/;SharedAccessKeyName=Root;SharedAccessKey=k", "", ";", 12, ';'},
		{";;=;Endpoint=;EntityPath=a=b", "", "\n", 0, ' '},
		{"Endpoint=;SharedAccessKeyName=Root;SharedAccessKey=k", "sb://", "", 9, ';'},
	} {
		f.Add(seed.s, seed.at, seed.sep, seed.prefix, seed.mid, uint64(len(seed.s)))
	}
	f.Fuzz(func(t *testing.T, s string, at uint, sep byte, prefix, mid string, seed uint64) {
		if len(mid) > 4 || len(prefix) > 64 {
			return
		}
		secret, chunks := fuzzSecret(seed, mid)
		pos := int(min(at, uint(len(s))))
		in := s[:pos] + prefix + secret + string(sep) + s[pos:]
		leaks := func(err error) bool {
			for _, c := range chunks {
				if strings.Contains(err.Error(), c) {
					return true
				}
			}
			return false
		}
		c, err := servicebus.ParseConnString(in)
		if err != nil {
			if !errors.Is(err, ErrConnectionString) {
				t.Fatalf("error %v does not wrap ErrConnectionString", err)
			}
			if leaks(err) {
				t.Fatalf("the error holds the key %q: %v", secret, err)
			}
		} else if c.Host == "" || (c.SAS == "" && (c.KeyName == "" || c.Key == "")) {
			t.Fatalf("parsed %+v from %q", *c, in)
		}
		if _, err := ServiceBusWithToken(in, SASTokenProvider("Root", "k", time.Hour)); err != nil && leaks(err) {
			t.Fatalf("ServiceBusWithToken's error holds the key %q: %v", secret, err)
		}
	})
}

// The emulator is reached by any host name, with plain AMQP to its port or
// 5672, and its audiences are amqp:// ones; without the emulator the same
// host gets TLS on 5671.
func TestServiceBusEmulatorOnAnyHost(t *testing.T) {
	tp := SASTokenProvider("Root", "k", time.Hour)
	for _, tc := range []struct {
		name     string
		make     func() (Connector, error)
		emulator bool
		dial     string
		audience string
	}{
		{"connection string, service name", func() (Connector, error) {
			return ServiceBus("Endpoint=sb://servicebus-emulator;SharedAccessKeyName=Root;SharedAccessKey=k;UseDevelopmentEmulator=true;")
		}, true, "amqp://servicebus-emulator:5672 (Service Bus emulator)", "amqp://servicebus-emulator/q"},
		{"connection string, service name and port", func() (Connector, error) {
			return ServiceBus("Endpoint=sb://servicebus-emulator:5673;SharedAccessKeyName=Root;SharedAccessKey=k;UseDevelopmentEmulator=true")
		}, true, "amqp://servicebus-emulator:5673 (Service Bus emulator)", "amqp://servicebus-emulator:5673/q"},
		{"connection string, no emulator", func() (Connector, error) {
			return ServiceBus("Endpoint=sb://servicebus-emulator;SharedAccessKeyName=Root;SharedAccessKey=k")
		}, false, "sb://servicebus-emulator:5671", "amqps://servicebus-emulator/q"},
		{"amqp:// endpoint, service name", func() (Connector, error) {
			return ServiceBusWithToken("amqp://servicebus-emulator", tp)
		}, true, "amqp://servicebus-emulator:5672 (Service Bus emulator)", "amqp://servicebus-emulator/q"},
		{"amqp:// endpoint, another address", func() (Connector, error) {
			return ServiceBusWithToken("amqp://10.1.2.3:5672", tp)
		}, true, "amqp://10.1.2.3:5672 (Service Bus emulator)", "amqp://10.1.2.3:5672/q"},
	} {
		c, err := tc.make()
		if err != nil {
			t.Errorf("%s: %v", tc.name, err)
			continue
		}
		sc := c.(*sbConnector)
		if sc.emulator != tc.emulator || sc.String() != tc.dial || sc.audience("q") != tc.audience {
			t.Errorf("%s: emulator %v, dials %s, audience %s; want %v, %s, %s", tc.name,
				sc.emulator, sc.String(), sc.audience("q"), tc.emulator, tc.dial, tc.audience)
		}
	}
}

type fixedToken Token

func (f fixedToken) Token(context.Context, string) (Token, error) { return Token(f), nil }

// A token with no Expiry would never be refreshed: only a pre-made SAS
// token may have none.
func TestZeroExpiryOnlyForSAS(t *testing.T) {
	_, err := tokenFunc(fixedToken{Type: TokenTypeJWT, Value: "eyJ"})(context.Background(), "amqps://ns/q")
	if !errors.Is(err, ErrInvalidOption) {
		t.Fatalf("a JWT with no Expiry: %v, want an error wrapping ErrInvalidOption", err)
	}
	t.Log(err)
	if _, err := tokenFunc(fixedToken{Type: TokenTypeSAS, Value: "SharedAccessSignature sr=x"})(context.Background(), "amqps://ns/q"); err != nil {
		t.Fatalf("a pre-made SAS token with no Expiry: %v", err)
	}
}
