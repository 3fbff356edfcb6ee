package pump

import (
	"context"
	"fmt"

	"github.com/Azure/go-amqp"

	"github.com/amqpsub/amqpsub/internal/driver"
)

// receiveLoop hands every delivery of src to the inbox until src fails or
// ctx ends. It is the only goroutine that blocks on the link. When drained
// ends (a Hold's drain was answered), it takes what is still prefetched and
// then pushes a nil marker: everything sent before the answer is ahead of it.
func receiveLoop(ctx, drained context.Context, src driver.Source, in *burst[*amqp.Message]) {
	rctx := drained
	for {
		msg, err := src.Receive(rctx, nil)
		if err != nil {
			if ctx.Err() == nil && rctx != ctx && drained.Err() != nil {
				// The call that failed may have been waiting before the
				// answer; one that starts now looks at the prefetch first.
				for {
					m, err := src.Receive(drained, nil)
					if err != nil {
						break
					}
					in.push(m)
				}
				in.push(nil)
				rctx = ctx
				continue
			}
			if ctx.Err() == nil {
				in.fail(fmt.Errorf("pump: receive: %w", err))
			}
			return
		}
		in.push(msg)
	}
}
