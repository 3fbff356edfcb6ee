package amqpsub

import "github.com/amqpsub/amqpsub/internal/driver/generic"

// Generic assumes only the AMQP 1.0 specification: the queue name is the
// address, [Retry] is modified{delivery-failed}.
var Generic = newProfile(generic.New(RejectCondition))

func init() { known = append(known, Generic) }
