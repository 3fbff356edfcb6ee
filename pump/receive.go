package pump

import (
	"context"
	"fmt"

	"github.com/Azure/go-amqp"
)

// receiveLoop hands every delivery of src to the inbox until src fails or
// ctx ends. It is the only goroutine that blocks on the link.
func receiveLoop(ctx context.Context, src Source, in *burst[*amqp.Message]) {
	for {
		msg, err := src.Receive(ctx, nil)
		if err != nil {
			if ctx.Err() == nil {
				in.fail(fmt.Errorf("pump: receive: %w", err))
			}
			return
		}
		in.push(msg)
	}
}
