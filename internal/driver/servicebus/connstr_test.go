package servicebus

import (
	"errors"
	"strings"
	"testing"
)

func TestParseConnectionString(t *testing.T) {
	const key = "s3cr3t+KEY/value=="
	for _, tc := range []struct {
		in      string
		want    ConnString
		missing string // a word the error must hold
	}{
		{in: "Endpoint=sb://ns.servicebus.windows.net/;SharedAccessKeyName=Root;SharedAccessKey=" + key,
			want: ConnString{Host: "ns.servicebus.windows.net", KeyName: "Root", Key: key}},
		{in: "endpoint=sb://ns.servicebus.windows.net/;sharedaccesskeyname=Root;sharedaccesskey=" + key + ";EntityPath=orders;",
			want: ConnString{Host: "ns.servicebus.windows.net", KeyName: "Root", Key: key, Entity: "orders"}},
		{in: "Endpoint=sb://ns.servicebus.windows.net;SharedAccessSignature=SharedAccessSignature sr=x&sig=" + key + "&se=1&skn=Root",
			want: ConnString{Host: "ns.servicebus.windows.net", SAS: "SharedAccessSignature sr=x&sig=" + key + "&se=1&skn=Root"}},
		{in: "Endpoint=sb://localhost;SharedAccessKeyName=Root;SharedAccessKey=" + key + ";UseDevelopmentEmulator=true;",
			want: ConnString{Host: "localhost", KeyName: "Root", Key: key, Emulator: true}},
		{in: "Endpoint=sb://127.0.0.1:5673;SharedAccessKeyName=Root;SharedAccessKey=" + key + ";UseDevelopmentEmulator=true",
			want: ConnString{Host: "127.0.0.1:5673", KeyName: "Root", Key: key, Emulator: true}},
		{in: "Endpoint=sb://ns.servicebus.windows.net:5671/;SharedAccessKeyName=Root;SharedAccessKey=" + key,
			want: ConnString{Host: "ns.servicebus.windows.net:5671", KeyName: "Root", Key: key}},
		{in: "SharedAccessKeyName=Root;SharedAccessKey=" + key, missing: "Endpoint is missing"},
		{in: "Endpoint=sb://ns.servicebus.windows.net/;SharedAccessKey=" + key, missing: "SharedAccessKeyName is missing"},
		{in: "Endpoint=sb://ns.servicebus.windows.net/;SharedAccessKeyName=Root", missing: "SharedAccessKey is missing"},
		{in: "Endpoint=sb://ns.servicebus.windows.net/", missing: "SharedAccessKeyName and SharedAccessKey"},
		// The emulator on any host, as azservicebus takes it: by its
		// service name in a compose file, say.
		{in: "Endpoint=sb://servicebus-emulator;SharedAccessKeyName=Root;SharedAccessKey=" + key + ";UseDevelopmentEmulator=true",
			want: ConnString{Host: "servicebus-emulator", KeyName: "Root", Key: key, Emulator: true}},
		{in: "Endpoint=sb://servicebus-Emulator:5672;SharedAccessKeyName=Root;SharedAccessKey=" + key + ";UseDevelopmentEmulator=true",
			want: ConnString{Host: "servicebus-Emulator:5672", KeyName: "Root", Key: key, Emulator: true}},
		{in: "Endpoint=sb://10.1.2.3;SharedAccessKeyName=Root;SharedAccessKey=" + key + ";UseDevelopmentEmulator=true",
			want: ConnString{Host: "10.1.2.3", KeyName: "Root", Key: key, Emulator: true}},
		{in: "Endpoint=amqps://servicebus-emulator;SharedAccessKeyName=Root;SharedAccessKey=" + key + ";UseDevelopmentEmulator=true", missing: "sb://<emulator host>"},
		{in: "Endpoint=sb://localhost;SharedAccessKeyName=Root;SharedAccessKey=" + key + ";UseDevelopmentEmulator=maybe", missing: "UseDevelopmentEmulator"},
		{in: "Endpoint=::not a url;SharedAccessKeyName=Root;SharedAccessKey=" + key, missing: "Endpoint"},
		{in: "Endpoint=sb://ns;SharedAccessKeyName=Root;garbage;SharedAccessKey=" + key, missing: "no '='"},
	} {
		got, err := ParseConnString(tc.in)
		if tc.missing != "" {
			if !errors.Is(err, ErrConnectionString) || !strings.Contains(err.Error(), tc.missing) {
				t.Errorf("%q: error %v, want one saying %q", tc.in, err, tc.missing)
			}
			if err != nil && strings.Contains(err.Error(), key) {
				t.Errorf("%q: the error quotes the Key: %v", tc.in, err)
			}
			continue
		}
		if err != nil {
			t.Errorf("%q: %v", tc.in, err)
			continue
		}
		if *got != tc.want {
			t.Errorf("%q: %+v, want %+v", tc.in, *got, tc.want)
		}
	}
}

// A connection string's EntityPath admits its entity, the subscriptions of
// a topic and the dead-letter queues of either, whatever their case; no
// other queue.
func TestInEntity(t *testing.T) {
	for _, tc := range []struct {
		entity, queue string
		in            bool
	}{
		{"orders", "orders", true},
		{"orders", "Orders", true},
		{"orders", "orders/$DeadLetterQueue", true},
		{"orders", "orders/$deadletterqueue", true},
		{"orders", "orders/$Transfer/$DeadLetterQueue", true},
		{"payments", "payments/Subscriptions/ledger", true},
		{"payments", "PAYMENTS/subscriptions/Ledger", true},
		{"payments", "payments/Subscriptions/ledger/$DeadLetterQueue", true},
		{"payments", "payments/Subscriptions/ledger/$Transfer/$DeadLetterQueue", true},
		{"payments/Subscriptions/ledger", "payments/Subscriptions/ledger", true},
		{"payments/Subscriptions/ledger", "Payments/Subscriptions/Ledger/$DeadLetterQueue", true},
		{"orders", "invoices", false},
		{"orders", "orders2", false},
		{"orders", "order", false},
		{"orders", "orders/eu", false}, // another queue: names may hold '/'
		{"orders", "orders/", false},
		{"payments", "payments/Subscriptions/", false},
		{"payments", "payments/Subscriptions/ledger/x", false},
		{"payments", "payments/Subscriptions/ledger/$DeadLetterQueue/x", false},
		{"payments/Subscriptions/ledger", "payments/Subscriptions/audit", false},
		{"payments/Subscriptions/ledger", "payments", false},
		{"payments/Subscriptions/ledger", "payments/Subscriptions/ledger/Subscriptions/x", false},
		{"orders/", "orders", true}, // an EntityPath written with a trailing '/'
		{"payments", "payments/Subscriptions/ledger/", false},
		{"payments", "payments/Subscriptions/$DeadLetterQueue", false}, // no subscription is named so
	} {
		if got := InEntity(tc.entity, tc.queue); got != tc.in {
			t.Errorf("InEntity(%q, %q) = %v, want %v", tc.entity, tc.queue, got, tc.in)
		}
	}
}
