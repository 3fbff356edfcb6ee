// Command sbsend sends N messages to a Service Bus queue or topic through
// the official Go client (azservicebus), for amqpsub's integration tests:
// amqpsub's module must not import the Azure SDK, so its tests build and
// run this instead.
//
//	go build -o sbsend ./cmd/sbsend   (in integration/sbconformance)
//	sbsend -conn "$AMQPSUB_SBPEER_CONN" -entity q1 -count 1000 \
//	    [-sessions 20 | -session-ids a,b,c] [-id-prefix m-] [-start 0] \
//	    [-prop traceparent=00-...-01]... [-batch 100] [-pad 0] [-timeout 2m]
//
// Message i (from -start, counting from 0) has message-id <id-prefix><i>.
// With sessions, it belongs to session ids[i mod len(ids)] (its AMQP
// group-id; -sessions N names them s000, s001, ...) and its body is the
// UTF-8 text "<session>/<seq>", seq being its 1-based position within the
// session in this run; without sessions the body is "<seq>" = i+1. The
// application properties are "n" (i, int64), "seq" (int64) and every -prop.
// -pad appends that many '.' to the body. Messages go in MessageBatches of
// up to -batch (1: one SendMessage each); order is kept. It exits 0 once
// every message was accepted, 1 on any error, 2 on bad flags.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"strings"
	"time"

	"github.com/Azure/azure-sdk-for-go/sdk/messaging/azservicebus"
)

type props []string

func (p *props) String() string { return strings.Join(*p, ",") }
func (p *props) Set(v string) error {
	if !strings.Contains(v, "=") {
		return fmt.Errorf("%q: want key=value", v)
	}
	*p = append(*p, v)
	return nil
}

func main() {
	conn := flag.String("conn", os.Getenv("AMQPSUB_SBPEER_CONN"), "connection string (default $AMQPSUB_SBPEER_CONN)")
	entity := flag.String("entity", "", "queue or topic (required)")
	count := flag.Int("count", 100, "messages to send")
	start := flag.Int("start", 0, "index of the first message")
	sessions := flag.Int("sessions", 0, "number of session ids (s000, s001, ...), round-robin; 0: no session id")
	sessionIDs := flag.String("session-ids", "", "comma-separated session ids, round-robin (instead of -sessions)")
	idPrefix := flag.String("id-prefix", "m-", "message-id prefix")
	batch := flag.Int("batch", 100, "messages per MessageBatch (1: SendMessage each)")
	pad := flag.Int("pad", 0, "bytes of padding appended to each body")
	timeout := flag.Duration("timeout", 2*time.Minute, "give up after this long")
	var extra props
	flag.Var(&extra, "prop", "application property key=value (string), repeatable (e.g. traceparent=...)")
	flag.Parse()

	if *conn == "" || *entity == "" || *count < 0 || *batch < 1 || *sessions < 0 {
		fmt.Fprintln(os.Stderr, "sbsend: -conn (or $AMQPSUB_SBPEER_CONN) and -entity are required; -count >= 0, -batch >= 1")
		flag.Usage()
		os.Exit(2)
	}
	var ids []string
	switch {
	case *sessionIDs != "":
		ids = strings.Split(*sessionIDs, ",")
	case *sessions > 0:
		for i := range *sessions {
			ids = append(ids, fmt.Sprintf("s%03d", i))
		}
	}
	kv := map[string]any{}
	for _, p := range extra {
		k, v, _ := strings.Cut(p, "=")
		kv[k] = v
	}

	ctx, cancel := context.WithTimeout(context.Background(), *timeout)
	defer cancel()
	t0 := time.Now()
	if err := run(ctx, *conn, *entity, *start, *count, ids, *idPrefix, *batch, *pad, kv); err != nil {
		fmt.Fprintf(os.Stderr, "sbsend: %v\n", err)
		os.Exit(1)
	}
	d := time.Since(t0)
	fmt.Fprintf(os.Stderr, "sbsend: sent %d messages to %s in %v (%.0f msg/s)\n", *count, *entity, d.Round(time.Millisecond), float64(*count)/d.Seconds())
}

func run(ctx context.Context, conn, entity string, start, count int, ids []string, idPrefix string, batchSize, pad int, kv map[string]any) error {
	client, err := azservicebus.NewClientFromConnectionString(conn, nil)
	if err != nil {
		return err
	}
	defer client.Close(context.Background())
	sender, err := client.NewSender(entity, nil)
	if err != nil {
		return err
	}
	defer sender.Close(context.Background())

	perSession := map[string]int{}
	build := func(i int) *azservicebus.Message {
		id := fmt.Sprintf("%s%d", idPrefix, i)
		var body string
		var seq int
		m := &azservicebus.Message{MessageID: &id}
		if len(ids) > 0 {
			sid := ids[i%len(ids)]
			perSession[sid]++
			seq = perSession[sid]
			body = fmt.Sprintf("%s/%d", sid, seq)
			m.SessionID = &sid
		} else {
			seq = i + 1
			body = fmt.Sprintf("%d", seq)
		}
		if pad > 0 {
			body += strings.Repeat(".", pad)
		}
		m.Body = []byte(body)
		m.ApplicationProperties = map[string]any{"n": int64(i), "seq": int64(seq)}
		for k, v := range kv {
			m.ApplicationProperties[k] = v
		}
		return m
	}

	if batchSize == 1 {
		for i := start; i < start+count; i++ {
			if err := sender.SendMessage(ctx, build(i), nil); err != nil {
				return fmt.Errorf("message %d: %w", i, err)
			}
		}
		return nil
	}
	// One batch per session id (Service Bus wants a batch's messages in one
	// session on partitioned entities); order within a session is kept.
	batches := map[string]*azservicebus.MessageBatch{}
	var order []string
	flush := func(sid string) error {
		b := batches[sid]
		if b == nil || b.NumMessages() == 0 {
			return nil
		}
		delete(batches, sid)
		if err := sender.SendMessageBatch(ctx, b, nil); err != nil {
			return fmt.Errorf("batch of %d messages (session %q): %w", b.NumMessages(), sid, err)
		}
		return nil
	}
	for i := start; i < start+count; i++ {
		m := build(i)
		sid := ""
		if m.SessionID != nil {
			sid = *m.SessionID
		}
		for {
			b := batches[sid]
			if b == nil {
				if b, err = sender.NewMessageBatch(ctx, nil); err != nil {
					return err
				}
				batches[sid] = b
				order = append(order, sid)
			}
			err := b.AddMessage(m, nil)
			if err == nil {
				break
			}
			if !errors.Is(err, azservicebus.ErrMessageTooLarge) || b.NumMessages() == 0 {
				return fmt.Errorf("message %d: %w", i, err)
			}
			if err := flush(sid); err != nil { // full: send, retry in a new one
				return err
			}
		}
		if int(batches[sid].NumMessages()) >= batchSize {
			if err := flush(sid); err != nil {
				return err
			}
		}
	}
	for _, sid := range order {
		if err := flush(sid); err != nil {
			return err
		}
	}
	return nil
}
