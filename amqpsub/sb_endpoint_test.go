package amqpsub

import (
	"context"
	"io"
	"net"
	"net/url"
	"os"
	"strings"
	"testing"
	"time"
)

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

// An AMQP server that is not Service Bus (Artemis) gives no claims-based
// security answer: the error says what to check.
func TestServiceBusOnAnotherServer(t *testing.T) {
	raw := os.Getenv("AMQPSUB_ARTEMIS_URL")
	if raw == "" {
		t.Skip("no AMQP server that is not Service Bus (AMQPSUB_ARTEMIS_URL)")
	}
	u, err := url.Parse(raw)
	if err != nil {
		t.Fatal(err)
	}
	c, err := ServiceBusWithToken("amqp://"+u.Host, SASTokenProvider("Root", "k", time.Hour))
	if err != nil {
		t.Fatal(err)
	}
	s, err := New(c, "fx-not-service-bus", HandlerFunc(func(context.Context, *Delivery) error { return nil }),
		DialTimeout(2*time.Second), Logger(sbTestLog(t)))
	if err != nil {
		t.Fatal(err)
	}
	err = s.Run(context.Background())
	t.Logf("Run: %v", err)
	if err == nil || !strings.Contains(err.Error(), "is this a Service Bus endpoint?") {
		t.Fatalf("Run = %v: want a hint that this is not Service Bus", err)
	}
}
