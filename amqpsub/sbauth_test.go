package amqpsub

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"
)

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
	if v := signSAS("foo", "superSecret", "http://MiCrosoft.com", 1); !strings.HasPrefix(v, "SharedAccessSignature sr=http%3a%2f%2fmicrosoft.com&") {
		t.Fatalf("audience not escaped and lower-cased: %s", v)
	}
}

func TestParseConnectionString(t *testing.T) {
	const key = "s3cr3t+KEY/value=="
	for _, tc := range []struct {
		in      string
		want    sbConnString
		missing string // a word the error must hold
	}{
		{in: "Endpoint=sb://ns.servicebus.windows.net/;SharedAccessKeyName=Root;SharedAccessKey=" + key,
			want: sbConnString{host: "ns.servicebus.windows.net", keyName: "Root", key: key}},
		{in: "endpoint=sb://ns.servicebus.windows.net/;sharedaccesskeyname=Root;sharedaccesskey=" + key + ";EntityPath=orders;",
			want: sbConnString{host: "ns.servicebus.windows.net", keyName: "Root", key: key, entity: "orders"}},
		{in: "Endpoint=sb://ns.servicebus.windows.net;SharedAccessSignature=SharedAccessSignature sr=x&sig=" + key + "&se=1&skn=Root",
			want: sbConnString{host: "ns.servicebus.windows.net", sas: "SharedAccessSignature sr=x&sig=" + key + "&se=1&skn=Root"}},
		{in: "Endpoint=sb://localhost;SharedAccessKeyName=Root;SharedAccessKey=" + key + ";UseDevelopmentEmulator=true;",
			want: sbConnString{host: "localhost", keyName: "Root", key: key, emulator: true}},
		{in: "Endpoint=sb://127.0.0.1:5673;SharedAccessKeyName=Root;SharedAccessKey=" + key + ";UseDevelopmentEmulator=true",
			want: sbConnString{host: "127.0.0.1:5673", keyName: "Root", key: key, emulator: true}},
		{in: "SharedAccessKeyName=Root;SharedAccessKey=" + key, missing: "Endpoint is missing"},
		{in: "Endpoint=sb://ns.servicebus.windows.net/;SharedAccessKey=" + key, missing: "SharedAccessKeyName is missing"},
		{in: "Endpoint=sb://ns.servicebus.windows.net/;SharedAccessKeyName=Root", missing: "SharedAccessKey is missing"},
		{in: "Endpoint=sb://ns.servicebus.windows.net/", missing: "SharedAccessKeyName and SharedAccessKey"},
		{in: "Endpoint=sb://ns.servicebus.windows.net/;SharedAccessKeyName=Root;SharedAccessKey=" + key + ";UseDevelopmentEmulator=true", missing: "localhost"},
		{in: "Endpoint=sb://localhost;SharedAccessKeyName=Root;SharedAccessKey=" + key + ";UseDevelopmentEmulator=maybe", missing: "UseDevelopmentEmulator"},
		{in: "Endpoint=::not a url;SharedAccessKeyName=Root;SharedAccessKey=" + key, missing: "Endpoint"},
		{in: "Endpoint=sb://ns;SharedAccessKeyName=Root;garbage;SharedAccessKey=" + key, missing: "no '='"},
	} {
		got, err := parseSBConnString(tc.in)
		if tc.missing != "" {
			if !errors.Is(err, ErrConnectionString) || !strings.Contains(err.Error(), tc.missing) {
				t.Errorf("%q: error %v, want one saying %q", tc.in, err, tc.missing)
			}
			if err != nil && strings.Contains(err.Error(), key) {
				t.Errorf("%q: the error quotes the key: %v", tc.in, err)
			}
			continue
		}
		if err != nil {
			t.Errorf("%q: %v", tc.in, err)
			continue
		}
		got.endpointIn = ""
		if *got != tc.want {
			t.Errorf("%q: %+v, want %+v", tc.in, *got, tc.want)
		}
	}
}

// Connection strings come from users' configuration: any string parses or
// fails with ErrConnectionString, never panics, and an error never quotes
// the key or the signature.
func FuzzParseConnectionString(f *testing.F) {
	f.Add("Endpoint=sb://ns.servicebus.windows.net/;SharedAccessKeyName=Root;SharedAccessKey=k3y", "k3y")
	f.Add("Endpoint=sb://localhost:5672;SharedAccessSignature=sig;UseDevelopmentEmulator=true", "sig")
	f.Add(";;=;Endpoint=;EntityPath=a=b", "zz")
	f.Fuzz(func(t *testing.T, s, secret string) {
		if len(secret) < 3 || strings.ContainsAny(secret, ";=") {
			return
		}
		in := s + ";SharedAccessKey=" + secret
		c, err := parseSBConnString(in)
		if err != nil {
			if !errors.Is(err, ErrConnectionString) {
				t.Fatalf("error %v does not wrap ErrConnectionString", err)
			}
			if strings.Contains(err.Error(), secret) && !strings.Contains(strings.ReplaceAll(in, "SharedAccessKey="+secret, ""), secret) {
				t.Fatalf("the error quotes the key: %v", err)
			}
			return
		}
		if c.host == "" || (c.sas == "" && (c.keyName == "" || c.key == "")) {
			t.Fatalf("parsed %+v from %q", *c, in)
		}
	})
}
