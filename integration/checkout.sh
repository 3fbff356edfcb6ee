#!/usr/bin/env bash
# Builds a module outside this repository against this checkout, exactly
# as README.md's "Using a checkout" says: a new module that imports the
# core, both adapters and artemistest gets the go mod edit lines of that
# section, then go mod tidy, go build, go vet and a compile of its tests.
# It proves the recipe, the replace lines and the placeholder versions
# together, with the module proxy for everything else.
#
# Usage: bash integration/checkout.sh   (make checkout; make test runs it)
set -euo pipefail

CHECKOUT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
GO=${GO:-go}
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
cd "$dir"

"$GO" mod init example.com/yourservice 2>/dev/null
mkdir -p cmd/consumer
cat >cmd/consumer/main.go <<'GO'
package main

import (
	"context"
	"log"
	"os/signal"
	"syscall"

	"github.com/amqpsub/amqpsub/amqpsub"
	"github.com/amqpsub/amqpsub/contrib/amqpotel"
	"github.com/amqpsub/amqpsub/contrib/amqpprom"
	"github.com/prometheus/client_golang/prometheus"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM)
	defer stop()
	h := amqpsub.HandlerFunc(func(context.Context, *amqpsub.Delivery) error { return nil })
	m := amqpprom.New(prometheus.DefaultRegisterer)
	sub, err := amqpsub.New(amqpsub.Dial("amqp://127.0.0.1:5672", nil), "orders",
		amqpotel.Handler("orders", h), amqpsub.WorkersByKey(8), amqpsub.WithMetrics(m))
	if err != nil {
		log.Fatal(err)
	}
	if err := sub.Run(ctx); err != nil {
		log.Fatal(err)
	}
}
GO
cat >cmd/consumer/main_test.go <<'GO'
package main

import (
	"testing"

	"github.com/amqpsub/amqpsub/artemistest"
)

func TestBroker(t *testing.T) {
	_ = artemistest.Start
	t.Skip("compiled only")
}
GO

# README.md, "Using a checkout": its sh block, run as written but for the
# clone (the checkout is the clone) and the cd (this module is the service),
# with this checkout's path for /src/amqpsub. A wrong line there fails here.
recipe=$(awk '/^### Using a checkout/ {s = 1; next} s && /^```sh$/ {b = 1; next} b && /^```$/ {exit} b' "$CHECKOUT/README.md" |
  grep -v -e '^git clone ' -e '^cd yourservice$')
[ -n "$recipe" ] || { echo "checkout.sh: no sh block under README.md's \"### Using a checkout\"" >&2; exit 1; }
grep -q 'go mod tidy' <<<"$recipe" || { echo "checkout.sh: README's recipe does not run go mod tidy" >&2; exit 1; }
recipe=${recipe//\/src\/amqpsub/$CHECKOUT}
go() { command "$GO" "$@"; }
eval "$recipe"
unset -f go
"$GO" build ./...
"$GO" vet ./...
"$GO" test -count=1 ./... >/dev/null
# tidy must keep the placeholders and the replaces, not drop them
for m in "" /contrib/amqpprom /contrib/amqpotel /artemistest; do
  grep -q "github.com/amqpsub/amqpsub$m v0.0.0" go.mod || { echo "checkout.sh: go mod tidy dropped github.com/amqpsub/amqpsub$m" >&2; exit 1; }
  grep -q "github.com/amqpsub/amqpsub$m => $CHECKOUT" go.mod || { echo "checkout.sh: go mod tidy dropped the replace of github.com/amqpsub/amqpsub$m" >&2; exit 1; }
done
echo "checkout.sh: an outside module builds, vets and compiles its tests against $CHECKOUT"
