package amqpsub

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/Azure/go-amqp"
)

// rpc is a request/response link pair on a Service Bus node ($cbs or an
// entity's $management): requests go out on a sender to the node with a
// message-id and reply-to; the node answers on a receiver whose target is
// that reply-to, with correlation-id = the request's message-id. One
// goroutine, started by newRPC and ended by close, routes the answers.
type rpc struct {
	node  string
	snd   *amqp.Sender
	rcv   *amqp.Receiver
	reply string

	mu      sync.Mutex
	pending map[string]chan *amqp.Message
	err     error // why the routing goroutine ended, once it has
	done    chan struct{}
}

func randomID() string {
	var b [16]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// newRPC attaches the link pair to node on sess.
func newRPC(ctx context.Context, sess *amqp.Session, node string) (*rpc, error) {
	r := &rpc{node: node, reply: node + "-reply-" + randomID(), pending: map[string]chan *amqp.Message{}, done: make(chan struct{})}
	var err error
	if r.rcv, err = sess.NewReceiver(ctx, node, &amqp.ReceiverOptions{TargetAddress: r.reply, Credit: 64}); err != nil {
		return nil, fmt.Errorf("amqpsub: attach to %s: %w", node, err)
	}
	if r.snd, err = sess.NewSender(ctx, node, nil); err != nil {
		cctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		_ = r.rcv.Close(cctx)
		return nil, fmt.Errorf("amqpsub: attach to %s: %w", node, err)
	}
	go r.route()
	return r, nil
}

// route hands each answer to the request waiting for it, until the
// receiver fails (its session or connection closed).
func (r *rpc) route() {
	defer close(r.done)
	for {
		m, err := r.rcv.Receive(context.Background(), nil)
		if err != nil {
			r.mu.Lock()
			r.err = err
			for id, ch := range r.pending {
				close(ch)
				delete(r.pending, id)
			}
			r.mu.Unlock()
			return
		}
		_ = r.rcv.AcceptMessage(context.Background(), m)
		var id string
		if m.Properties != nil {
			id, _ = m.Properties.CorrelationID.(string)
		}
		r.mu.Lock()
		ch := r.pending[id]
		delete(r.pending, id)
		r.mu.Unlock()
		if ch != nil {
			ch <- m
		}
	}
}

// call sends req and returns the answer, or ctx's error; a call whose ctx
// ends leaves the request in doubt.
func (r *rpc) call(ctx context.Context, req *amqp.Message) (*amqp.Message, error) {
	id := randomID()
	if req.Properties == nil {
		req.Properties = &amqp.MessageProperties{}
	}
	req.Properties.MessageID = id
	req.Properties.ReplyTo = &r.reply
	ch := make(chan *amqp.Message, 1)
	r.mu.Lock()
	if r.err != nil {
		err := r.err
		r.mu.Unlock()
		return nil, fmt.Errorf("amqpsub: %s: %w", r.node, err)
	}
	r.pending[id] = ch
	r.mu.Unlock()
	forget := func() {
		r.mu.Lock()
		delete(r.pending, id)
		r.mu.Unlock()
	}
	if err := r.snd.Send(ctx, req, nil); err != nil {
		forget()
		return nil, fmt.Errorf("amqpsub: request to %s: %w", r.node, err)
	}
	select {
	case m, ok := <-ch:
		if !ok {
			return nil, fmt.Errorf("amqpsub: %s closed before it answered: %w", r.node, r.lastErr())
		}
		return m, nil
	case <-ctx.Done():
		forget()
		return nil, fmt.Errorf("amqpsub: %s did not answer: %w", r.node, ctx.Err())
	}
}

func (r *rpc) lastErr() error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.err == nil {
		return errors.New("closed")
	}
	return r.err
}

// wait waits for the routing goroutine, which ends once the session or
// connection under the links is closed.
func (r *rpc) wait() { <-r.done }

// status reads a Service Bus answer's status code and description; $cbs
// names them status-code/status-description, $management
// statusCode/statusDescription.
func status(m *amqp.Message) (int, string) {
	code := -1
	for _, k := range []string{"statusCode", "status-code"} {
		switch v := m.ApplicationProperties[k].(type) {
		case int32:
			code = int(v)
		case int64:
			code = int(v)
		case int:
			code = v
		case uint32:
			code = int(v)
		}
		if code >= 0 {
			break
		}
	}
	var desc string
	for _, k := range []string{"statusDescription", "status-description"} {
		if d, ok := m.ApplicationProperties[k].(string); ok {
			desc = d
			break
		}
	}
	return code, desc
}
