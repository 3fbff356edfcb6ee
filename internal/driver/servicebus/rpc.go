package servicebus

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"math"
	"sync"
	"time"

	"github.com/Azure/go-amqp"
	"github.com/amqpsub/amqpsub/internal/amqpint"
)

// rpc is a request/response link pair on a Service Bus node ($cbs or an
// entity's $management): requests go out on a sender to the node with a
// message-id and reply-to; the node answers on a receiver whose target is
// that reply-to, with correlation-id = the request's message-id.
//
// One goroutine, started by newRPC, routes the answers. When the pair dies
// (the service detaches an idle link, say) while the session lives, it
// attaches a new pair on the same session, so that lock renewal goes on
// without the receive link; requests made meanwhile wait for it. It gives
// up (and every later call fails at once with an error wrapping
// ErrNodeGone) when the session or connection is gone, when the new pair
// cannot be attached, or when a pair died before it answered anything and
// within rpcHealthy of its attach: a node that drops every pair at once is
// not attached again in a loop. done is closed when it has given up.
type rpc struct {
	node string
	sess *amqp.Session
	done chan struct{} // closed when the routing goroutine has returned

	mu      sync.Mutex
	snd     *amqp.Sender   // nil while no pair is attached
	rcv     *amqp.Receiver // the pair's receiver
	reply   string         // the pair's reply address
	pending map[string]chan *amqp.Message
	// reopening is not nil while the routing goroutine attaches a new
	// pair, and closed when it is done.
	reopening chan struct{}
	err       error // why no pair is attached, while snd is nil
}

// ErrNodeGone is wrapped by the error of a call to a node whose link pair is
// gone for good (see rpc).
var ErrNodeGone = errors.New("amqpsub: the link pair to the node is gone")

// rpcHealthy is how long a pair that never answered must have lived for the
// routing goroutine to attach a new one when it dies.
const rpcHealthy = 10 * time.Second

// rpcReattachTimeout bounds the attach of a new pair after one died.
const rpcReattachTimeout = 10 * time.Second

func randomID() string {
	var b [16]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// newRPC attaches the link pair to node on sess, within ctx.
func newRPC(ctx context.Context, sess *amqp.Session, node string) (*rpc, error) {
	r := &rpc{node: node, sess: sess, pending: map[string]chan *amqp.Message{}, done: make(chan struct{})}
	snd, rcv, reply, err := r.attachPair(ctx)
	if err != nil {
		return nil, err
	}
	r.snd, r.rcv, r.reply = snd, rcv, reply
	go r.route(rcv) //nolint:gosec // G118: the router serves the node, not one request; it ends with the node's receiver and close waits for it (r.done)
	return r, nil
}

// attachPair attaches a receiver with a fresh reply address and a sender to
// the node, within ctx.
func (r *rpc) attachPair(ctx context.Context) (*amqp.Sender, *amqp.Receiver, string, error) {
	reply := r.node + "-reply-" + randomID()
	rcv, err := r.sess.NewReceiver(ctx, r.node, &amqp.ReceiverOptions{TargetAddress: reply, Credit: 64})
	if err != nil {
		return nil, nil, "", fmt.Errorf("amqpsub: attach to %s: %w", r.node, err)
	}
	snd, err := r.sess.NewSender(ctx, r.node, nil)
	if err != nil {
		closeAbandoned(ctx, rcv)
		return nil, nil, "", fmt.Errorf("amqpsub: attach to %s: %w", r.node, err)
	}
	return snd, rcv, reply, nil
}

// closer is a link to close (*amqp.Sender, *amqp.Receiver).
type closer interface {
	Close(ctx context.Context) error
}

// closeAbandoned closes a link that is no longer used (not nil), waiting
// at most a second, and no later than ctx ends, for the peer's answer
// (go-amqp goes on closing it in the background).
func closeAbandoned(ctx context.Context, l closer) {
	ctx, cancel := context.WithTimeout(ctx, time.Second)
	defer cancel()
	_ = l.Close(ctx)
}

// route hands each answer to the request waiting for it, and attaches a new
// pair when one dies (see rpc), until it gives up.
func (r *rpc) route(rcv *amqp.Receiver) {
	defer close(r.done)
	opened := time.Now()
	for {
		answered, err := r.serve(rcv)
		again := answered || time.Since(opened) >= rpcHealthy
		var reopened chan struct{}
		r.mu.Lock()
		old := r.snd
		r.snd, r.rcv, r.err = nil, nil, err
		for id, ch := range r.pending {
			close(ch)
			delete(r.pending, id)
		}
		if again {
			reopened = make(chan struct{})
			r.reopening = reopened
		} else {
			r.err = fmt.Errorf("%w: %w (it died %v after it was attached, before it answered)",
				ErrNodeGone, err, time.Since(opened).Round(time.Millisecond))
		}
		r.mu.Unlock()
		ctx, cancel := context.WithTimeout(context.Background(), rpcReattachTimeout)
		if old != nil {
			closeAbandoned(ctx, old)
		}
		if !again {
			cancel()
			return
		}
		snd, nrcv, reply, aerr := r.attachPair(ctx)
		cancel()
		r.mu.Lock()
		r.reopening = nil
		if aerr == nil {
			r.snd, r.rcv, r.reply, r.err = snd, nrcv, reply, nil
		} else {
			r.err = fmt.Errorf("%w: %w (attaching a new pair after: %v)", ErrNodeGone, aerr, err)
		}
		r.mu.Unlock()
		close(reopened)
		if aerr != nil {
			return
		}
		rcv, opened = nrcv, time.Now()
	}
}

// serve routes the answers rcv brings until it fails; answered says
// whether it brought any to a request.
func (r *rpc) serve(rcv *amqp.Receiver) (answered bool, err error) {
	for {
		m, err := rcv.Receive(context.Background(), nil)
		if err != nil {
			return answered, err
		}
		_ = rcv.AcceptMessage(context.Background(), m)
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
			answered = true
		}
	}
}

// call sends req and returns the answer. It returns ctx's error when ctx
// ends first: the request is then in doubt (it may have been carried out).
// While a new pair is being attached it waits for it, within ctx; once the
// pair is gone for good it fails at once with an error wrapping
// ErrNodeGone.
func (r *rpc) call(ctx context.Context, req *amqp.Message) (*amqp.Message, error) {
	id := randomID()
	ch := make(chan *amqp.Message, 1)
	var snd *amqp.Sender
	for {
		r.mu.Lock()
		snd = r.snd
		reply, wait, err := r.reply, r.reopening, r.err
		if snd != nil {
			r.pending[id] = ch
		}
		r.mu.Unlock()
		if snd != nil {
			if req.Properties == nil {
				req.Properties = &amqp.MessageProperties{}
			}
			req.Properties.MessageID = id
			req.Properties.ReplyTo = &reply
			break
		}
		if wait == nil {
			return nil, fmt.Errorf("amqpsub: %s: %w", r.node, err)
		}
		select {
		case <-wait:
		case <-ctx.Done():
			return nil, fmt.Errorf("amqpsub: %s did not answer: %w", r.node, ctx.Err())
		}
	}
	forget := func() {
		r.mu.Lock()
		delete(r.pending, id)
		r.mu.Unlock()
	}
	if err := snd.Send(ctx, req, nil); err != nil {
		forget()
		var le *amqp.LinkError
		if errors.As(err, &le) {
			// The sender is gone but its receiver may live on: close the
			// receiver too, so that the routing goroutine attaches a new
			// pair.
			r.mu.Lock()
			rcv := r.rcv
			if r.snd != snd {
				rcv = nil // that pair is gone already
			}
			r.mu.Unlock()
			if rcv != nil {
				closeAbandoned(ctx, rcv)
			}
		}
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

// status reads a Service Bus answer's status code and description; $cbs
// names them status-code/status-description, $management
// statusCode/statusDescription.
func status(m *amqp.Message) (int, string) {
	code := -1
	for _, k := range []string{"statusCode", "status-code"} {
		if n, ok := amqpint.Int(m.ApplicationProperties[k]); ok && n >= 0 && n <= math.MaxInt32 {
			code = int(n)
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
