# amqpsub: build, test and broker helpers. See integration/README.md.
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c

GO ?= go
ARTEMIS_CTL  := $(abspath integration/artemis.sh)
RABBITMQ_CTL := $(abspath integration/rabbitmq.sh)
RABBITMQ4_CTL := $(abspath integration/rabbitmq4.sh)
CLUSTER_CTL  := $(abspath integration/artemis-cluster.sh)
AMQPSUB_ARTEMIS_URL  ?= amqp://127.0.0.1:5672
AMQPSUB_RABBITMQ_URL ?= amqp://guest:guest@127.0.0.1:5682
AMQPSUB_RABBITMQ4_URL ?= amqp://guest:guest@127.0.0.1:5692
INTEGRATION_TIMEOUT  ?= 40m

INTEGRATION_ENV := AMQPSUB_ARTEMIS_URL=$(AMQPSUB_ARTEMIS_URL) \
	AMQPSUB_RABBITMQ_URL=$(AMQPSUB_RABBITMQ_URL) \
	AMQPSUB_RABBITMQ4_URL=$(AMQPSUB_RABBITMQ4_URL) \
	AMQPSUB_ARTEMIS_CTL=$(ARTEMIS_CTL) \
	AMQPSUB_RABBITMQ_CTL=$(RABBITMQ_CTL) \
	AMQPSUB_RABBITMQ4_CTL=$(RABBITMQ4_CTL) \
	AMQPSUB_CLUSTER_CTL=$(CLUSTER_CTL)

.PHONY: checkout scaling credit trace faults-all golangci all prereqs prereqs-demo brokers brokers-stop artemis rabbitmq rabbitmq4 unit integration test artemistest demo bench fuzz fmt vet lint check

# Modules of their own (own go.mod) that `make lint` checks like the root
# one, with the root's .golangci.yml: the Artemis test helper and the
# adapters under contrib/. (integration/sbconformance is vetted by its test
# run only.)
LINT_MODULES := artemistest $(patsubst %/go.mod,%,$(wildcard contrib/*/go.mod))

all: lint unit

## prereqs: install what `make test` needs (Debian packages, as root); idempotent
prereqs:
	bash integration/prereqs.sh test

prereqs-demo:
	bash integration/prereqs.sh demo

## brokers: start Artemis (127.0.0.1:5672), RabbitMQ 3.10 (127.0.0.1:5682) and RabbitMQ 4 (127.0.0.1:5692); idempotent
brokers: prereqs
	bash $(ARTEMIS_CTL) start && bash $(RABBITMQ_CTL) start && bash $(RABBITMQ4_CTL) start

artemis: prereqs-demo
	bash $(ARTEMIS_CTL) start

rabbitmq: prereqs
	bash $(RABBITMQ_CTL) start

## rabbitmq4: start RabbitMQ 4.0.5 (127.0.0.1:5692; its Debian trixie root is made once, about 75 s)
rabbitmq4: prereqs
	bash $(RABBITMQ4_CTL) start

## brokers-stop: stop the three brokers (idempotent)
brokers-stop:
	rc=0; bash $(ARTEMIS_CTL) stop || rc=1; bash $(RABBITMQ_CTL) stop || rc=1; bash $(RABBITMQ4_CTL) stop || rc=1; exit $$rc

## unit: unit tests (everything except ./integration)
unit:
	pkgs=$$($(GO) list ./... | grep -v '/integration' || true); \
	if [ -n "$$pkgs" ]; then $(GO) test -race -count=1 $$pkgs; else echo "no packages"; fi

## integration: start the brokers, run the integration tests (they stay running)
integration: brokers
	$(INTEGRATION_ENV) $(GO) test -race -count=1 -timeout $(INTEGRATION_TIMEOUT) ./integration/...

## test: unit + integration; stops the brokers it started, even on failure
test: prereqs
	GO=$(GO) INTEGRATION_TIMEOUT=$(INTEGRATION_TIMEOUT) bash integration/test.sh

## checkout: build a module outside the repository against this checkout, as README's "Using a checkout" says
checkout:
	GO=$(GO) bash integration/checkout.sh

## artemistest: the tests of the artemistest module (starts its own Artemis processes; test.sh runs them too)
artemistest: prereqs
	cd artemistest && $(GO) vet ./... && $(GO) test -race -count=1 -timeout 10m ./...

## demo: the orders example against Artemis
demo: artemis
	$(GO) run ./examples/orders -url $(AMQPSUB_ARTEMIS_URL)

## bench: the benchmark program against every broker: Artemis, RabbitMQ 3.10,
## then RabbitMQ 4 on a classic and on a quorum queue (`brokers` starts all
## three; INTEGRATION_ENV gives the program their URLs and scripts)
bench: brokers
	bash integration/prereqs.sh bench
	$(INTEGRATION_ENV) $(GO) run ./integration/bench

## scaling: what replicas and a second cluster node give (docs/scaling.md);
## starts and stops the two-node cluster itself; a few minutes
scaling: prereqs
	AMQPSUB_SCALING=1 AMQPSUB_CLUSTER_CTL=$(CLUSTER_CTL) $(GO) test -count=1 -run TestArtemisScalingThroughput -v -timeout 30m ./integration

## credit: the adaptive credit against a fixed one (docs/performance.md):
## replica fairness in each lane mode on Artemis and a RabbitMQ 4 quorum
## queue, a crash and group spread on Artemis, locks on the Service Bus
## peer, what graceful stops release on a quorum queue; starts the brokers
## and the peer (left running); about 15 minutes
credit: brokers
	bash integration/sbpeer/sbpeer.sh start
	AMQPSUB_CREDIT=1 AMQPSUB_SBPEER_CONN=$$(bash integration/sbpeer/sbpeer.sh url) \
	AMQPSUB_SBPEER_CONTROL=$$(bash integration/sbpeer/sbpeer.sh ctl-url) $(INTEGRATION_ENV) \
	$(GO) test -count=1 -run 'TestArtemisCredit|TestRabbitMQ4Credit|TestServiceBusCredit|TestRabbitMQ4StopCost' -v -timeout 40m ./integration

## trace: the files one Artemis delivery, and one Service Bus delivery with
## a renewal and a settlement after a lost link, cross (docs/design.md,
## "One delivery's path"); starts Artemis and the peer (left running)
trace: artemis
	bash integration/sbpeer/sbpeer.sh start
	AMQPSUB_SBPEER_CONN=$$(bash integration/sbpeer/sbpeer.sh url) \
	AMQPSUB_SBPEER_CONTROL=$$(bash integration/sbpeer/sbpeer.sh ctl-url) $(INTEGRATION_ENV) \
	GO=$(GO) bash integration/trace.sh

## faults-all: every fault scenario (the tests of integration/faults_*_test.go)
## on every broker: make test's (Artemis, the Service Bus peer) and those
## behind the chaos build tag (faults injected on RabbitMQ); starts the
## brokers and the peer (left running)
FAULT_TESTS = $(shell sed -n 's/^func \(Test[A-Za-z0-9_]*\).*/\1/p' integration/faults_*_test.go | paste -sd'|')
faults-all: brokers
	bash integration/sbpeer/sbpeer.sh start
	AMQPSUB_SBPEER_CONN=$$(bash integration/sbpeer/sbpeer.sh url) \
	AMQPSUB_SBPEER_CONTROL=$$(bash integration/sbpeer/sbpeer.sh ctl-url) $(INTEGRATION_ENV) \
	$(GO) test -race -count=1 -tags chaos -run '^($(FAULT_TESTS))$$' -timeout $(INTEGRATION_TIMEOUT) ./integration

## fuzz: every fuzz target for FUZZTIME each (default 1m); CI runs them for 3s
fuzz:
	FUZZTIME=$${FUZZTIME:-1m} bash integration/fuzz.sh

fmt:
	@out=$$(gofmt -l .); \
	if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi

# The tests behind build tags (integration: chaos) are vetted and linted
# too, once with their tags.
BUILD_TAGS := chaos

vet:
	$(GO) vet ./...
	$(GO) vet -tags peer ./amqpsub
	$(GO) vet -tags $(BUILD_TAGS) ./integration/...
	@for m in $(LINT_MODULES); do (cd $$m && echo "go vet ($$m)" && $(GO) vet ./...) || exit 1; done

## lint: gofmt, go vet and golangci-lint (pinned, installed with go install if missing; config in .golangci.yml)
GOLANGCI_VERSION := 2.15.0
GOLANGCI := $(shell $(GO) env GOPATH)/bin/golangci-lint
golangci:
	@if ! "$(GOLANGCI)" version 2>/dev/null | grep -q 'has version $(GOLANGCI_VERSION) '; then \
		echo "installing golangci-lint v$(GOLANGCI_VERSION) into $(GOLANGCI)"; \
		$(GO) install github.com/golangci/golangci-lint/v2/cmd/golangci-lint@v$(GOLANGCI_VERSION); \
	fi
	"$(GOLANGCI)" run ./...
	"$(GOLANGCI)" run --build-tags $(BUILD_TAGS) ./integration/...
	@for m in $(LINT_MODULES); do (cd $$m && echo "golangci-lint ($$m)" && "$(GOLANGCI)" run --config $(CURDIR)/.golangci.yml ./...) || exit 1; done

lint: fmt vet golangci

check: lint test
