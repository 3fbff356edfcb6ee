module github.com/amqpsub/amqpsub

go 1.25

require (
	github.com/Azure/go-amqp v1.7.0
	github.com/cespare/xxhash/v2 v2.3.0
	go.uber.org/goleak v1.3.0
	go.uber.org/zap v1.28.0
)

require go.uber.org/multierr v1.10.0 // indirect
