#!/usr/bin/env bash
# `make test`: unit tests, then the integration tests against real brokers.
# Starts Artemis and RabbitMQ if they are not running, and stops (only) the
# ones it started when it exits, also on failure or Ctrl-C. Exits non-zero
# if either test run failed.
#
# Environment: GO (default go), GOTESTFLAGS (extra `go test` flags),
# INTEGRATION_TIMEOUT (default 40m), plus everything artemis.sh and
# rabbitmq.sh read.
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
ROOT=$(pwd)
GO=${GO:-go}
ARTEMIS_CTL="$ROOT/integration/artemis.sh"
RABBITMQ_CTL="$ROOT/integration/rabbitmq.sh"
# shellcheck disable=SC2206
EXTRA=(${GOTESTFLAGS:-})

started=()
cleanup() {
  local s
  for s in "${started[@]}"; do
    bash "$s" stop || true
  done
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

section() { printf '\n==== %s ====\n' "$*"; }

section "unit tests"
pkgs=$("$GO" list ./... | grep -v '/integration' || true)
unit_rc=0
if [ -n "$pkgs" ]; then
  # shellcheck disable=SC2086
  "$GO" test -race -count=1 "${EXTRA[@]}" $pkgs || unit_rc=$?
else
  echo "no unit test packages"
fi

section "fuzz (short runs; FUZZTIME=5m make fuzz for long ones)"
fuzz_rc=0
FUZZTIME=${FUZZTIME:-8s} bash integration/fuzz.sh || fuzz_rc=$?

section "brokers"
for ctl in "$ARTEMIS_CTL" "$RABBITMQ_CTL"; do
  if ! bash "$ctl" status >/dev/null 2>&1; then
    started+=("$ctl")
  fi
  if ! bash "$ctl" start; then
    echo "FAIL: could not start the broker with $ctl start" >&2
    exit 1
  fi
done

section "integration tests"
integ_rc=0
AMQPSUB_ARTEMIS_URL=${AMQPSUB_ARTEMIS_URL:-$(bash "$ARTEMIS_CTL" url)} \
AMQPSUB_RABBITMQ_URL=${AMQPSUB_RABBITMQ_URL:-$(bash "$RABBITMQ_CTL" url)} \
AMQPSUB_ARTEMIS_CTL=$ARTEMIS_CTL \
AMQPSUB_RABBITMQ_CTL=$RABBITMQ_CTL \
  "$GO" test -race -count=1 -timeout "${INTEGRATION_TIMEOUT:-40m}" "${EXTRA[@]}" ./integration/... \
  || integ_rc=$?

section "summary"
[ "$unit_rc" = 0 ] && echo "unit tests: ok" || echo "unit tests: FAIL (exit $unit_rc)"
[ "$fuzz_rc" = 0 ] && echo "fuzz: ok" || echo "fuzz: FAIL (exit $fuzz_rc)"
[ "$integ_rc" = 0 ] && echo "integration tests: ok" || echo "integration tests: FAIL (exit $integ_rc)"
[ "$unit_rc" = 0 ] && [ "$fuzz_rc" = 0 ] && [ "$integ_rc" = 0 ]
