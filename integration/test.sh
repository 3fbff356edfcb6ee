#!/usr/bin/env bash
# `make test`: unit tests, the artemistest module's tests (which start
# their own Artemis processes), then the integration tests against real
# brokers, then go vet and go test in each contrib module
# (contrib/*/go.mod). Starts Artemis, RabbitMQ 3.10 and RabbitMQ 4 if they
# are not running, and stops (only) the ones it started when it exits, also
# on failure or Ctrl-C. Exits non-zero if any stage failed.
#
# Environment: GO (default go), GOTESTFLAGS (extra `go test` flags),
# INTEGRATION_TIMEOUT (default 40m), plus everything artemis.sh,
# rabbitmq.sh and rabbitmq4.sh read.
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
ROOT=$(pwd)
GO=${GO:-go}
ARTEMIS_CTL="$ROOT/integration/artemis.sh"
# The cluster and HA tests start (and stop) their own brokers with it.
CLUSTER_CTL="$ROOT/integration/artemis-cluster.sh"
RABBITMQ_CTL="$ROOT/integration/rabbitmq.sh"
RABBITMQ4_CTL="$ROOT/integration/rabbitmq4.sh"
# shellcheck disable=SC2206
EXTRA=(${GOTESTFLAGS:-})

started=()
cleanup() {
  local s
  for s in "${started[@]}"; do
    case $s in
    fn:*) "${s#fn:}" stop || true ;; # a function of this script
    *) bash "$s" stop || true ;;
    esac
  done
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# section NAME starts a stage; the summary prints each stage's wall time.
stage_names=()
stage_starts=()
section() {
  printf '\n==== %s ====\n' "$*"
  stage_names+=("$*")
  stage_starts+=("$SECONDS")
}
# timings prints how long each stage took, and the whole run.
timings() {
  local i end
  echo "stage times:"
  for i in "${!stage_names[@]}"; do
    [ "${stage_names[$i]}" != summary ] || continue
    end=${stage_starts[$((i + 1))]:-$SECONDS}
    printf '  %5ss  %s\n' "$((end - stage_starts[i]))" "${stage_names[$i]}"
  done
  printf '  %5ss  all\n' "$SECONDS"
}

section "unit tests"
pkgs=$("$GO" list ./... | grep -v '/integration' || true)
unit_rc=0
if [ -n "$pkgs" ]; then
  # Without the brokers' variables, whatever the caller's environment
  # holds: the few tests of these packages that need a broker or the
  # Service Bus peer skip here and run in the integration stage below.
  # shellcheck disable=SC2086
  env -u AMQPSUB_ARTEMIS_URL -u AMQPSUB_RABBITMQ_URL -u AMQPSUB_RABBITMQ4_URL -u AMQPSUB_SBPEER_CONN -u AMQPSUB_SBPEER_CONTROL -u AMQPSUB_CLUSTER_CTL \
    "$GO" test -race -count=1 "${EXTRA[@]}" $pkgs || unit_rc=$?
else
  echo "no unit test packages"
fi

section "an outside module against this checkout (README: Using a checkout)"
checkout_rc=0
GO=$GO bash "$ROOT/integration/checkout.sh" || checkout_rc=$?

section "fuzz (short runs; FUZZTIME=5m make fuzz for long ones)"
fuzz_rc=0
FUZZTIME=${FUZZTIME:-3s} bash integration/fuzz.sh || fuzz_rc=$?

# ==== artemistest (a module of its own: artemistest/go.mod) ====
# The helper that starts Artemis for Go tests. Its tests start and stop
# their own brokers, as local processes on free ports of 127.0.0.1 (the
# distribution from the cache, downloaded with Maven if missing): the
# local-process path. This machine has no Docker engine: the container
# path is compiled and vetted here, never run. They run in the background
# beside the brokers' start and the Service Bus peer's conformance test
# (each waits mostly on a JVM or the peer), and their output is printed
# after those.
section "artemistest (Artemis for Go tests: local-process path), in the background"
artemistest_rc=0
artemistest_out=$(mktemp)
(cd "$ROOT/artemistest" &&
  "$GO" vet ./... &&
  "$GO" test -race -count=1 -timeout 10m "${EXTRA[@]}" ./...) >"$artemistest_out" 2>&1 &
artemistest_pid=$!
# ==== end of the artemistest block ====

section "brokers"
ctls=("$ARTEMIS_CTL" "$RABBITMQ_CTL" "$RABBITMQ4_CTL")
if [ "$(id -u)" != 0 ] && [ -z "${AMQPSUB_RABBITMQ4_URL:-}" ]; then
  # RabbitMQ 4 runs chrooted, which needs root; the other brokers do not.
  echo "WARNING: not root: RabbitMQ 4 is not started, and its tests skip (run as root, or set AMQPSUB_RABBITMQ4_URL and AMQPSUB_RABBITMQ4_CTL)" >&2
  ctls=("$ARTEMIS_CTL" "$RABBITMQ_CTL")
  no_rabbitmq4=1
fi
for ctl in "${ctls[@]}"; do
  if ! bash "$ctl" status >/dev/null 2>&1; then
    started+=("$ctl")
  fi
  if ! bash "$ctl" start; then
    echo "FAIL: could not start the broker with $ctl start" >&2
    exit 1
  fi
done

# ==== Service Bus peer (integration/sbpeer) and its conformance test ====
# Starts the scripted Service Bus peer if it is not running (and stops it at
# exit only if this script started it, like the brokers), exports its
# connection string and control URL for the integration tests, and
# checks the peer against the official azservicebus client (a module of its
# own, integration/sbconformance). See integration/sbpeer/README.md.
SBPEER_CTL="$ROOT/integration/sbpeer/sbpeer.sh"
section "Service Bus peer conformance (official azservicebus client)"
sbconf_rc=0
if ! bash "$SBPEER_CTL" status >/dev/null 2>&1; then
  started+=("$SBPEER_CTL")
fi
if bash "$SBPEER_CTL" start; then
  export AMQPSUB_SBPEER_CONN=${AMQPSUB_SBPEER_CONN:-$(bash "$SBPEER_CTL" url)}
  export AMQPSUB_SBPEER_CONTROL=${AMQPSUB_SBPEER_CONTROL:-$(bash "$SBPEER_CTL" ctl-url)}
  (cd "$ROOT/integration/sbconformance" &&
    "$GO" test -race -count=1 -timeout 10m "${EXTRA[@]}" ./...) || sbconf_rc=$?
else
  echo "FAIL: could not start the Service Bus peer with $SBPEER_CTL start" >&2
  sbconf_rc=1
fi
# A second peer for ./amqpsub's own Service Bus tests, which run beside
# ./integration's: the peer's settings (a link idle timeout, what a lost
# connection does to locks) and its global counters are shared by every
# test that uses it, so the two packages get one each.
sbpeer2() {
  AMQPSUB_CACHE="${AMQPSUB_CACHE:-${HOME:-/root}/.cache/amqpsub}/peer2" \
    AMQPSUB_SBPEER_PORT=5675 AMQPSUB_SBPEER_CONTROL_PORT=5676 bash "$SBPEER_CTL" "$@"
}
SBPEER2_CONN= SBPEER2_CONTROL=
if [ "$sbconf_rc" = 0 ]; then
  if ! sbpeer2 status >/dev/null 2>&1; then
    started+=(fn:sbpeer2)
  fi
  if sbpeer2 start; then
    SBPEER2_CONN=$(sbpeer2 url) SBPEER2_CONTROL=$(sbpeer2 ctl-url)
  else
    echo "FAIL: could not start the second Service Bus peer" >&2
    sbconf_rc=1
  fi
fi
# ==== end of the Service Bus peer block ====

section "artemistest: its output"
wait "$artemistest_pid" || artemistest_rc=$?
cat "$artemistest_out"
rm -f "$artemistest_out"

# The brokers' addresses, for the integration stage and the contrib stage.
artemis_url=${AMQPSUB_ARTEMIS_URL:-$(bash "$ARTEMIS_CTL" url)}
rabbitmq_url=${AMQPSUB_RABBITMQ_URL:-$(bash "$RABBITMQ_CTL" url)}
rabbitmq4_url=${AMQPSUB_RABBITMQ4_URL:-$(bash "$RABBITMQ4_CTL" url)}
[ -z "${no_rabbitmq4:-}" ] || rabbitmq4_url=

section "integration tests"
# ./amqpsub again, with the peer tag, the brokers and the second peer up,
# beside ./integration/...: its tests against the Service Bus peer
# (servicebus_peer_test.go, built only with the peer tag, which the unit
# stage above leaves out).
integ_rc=0
amqpsub_rc=0
export AMQPSUB_ARTEMIS_URL=$artemis_url \
  AMQPSUB_RABBITMQ_URL=$rabbitmq_url \
  AMQPSUB_RABBITMQ4_URL=$rabbitmq4_url \
  AMQPSUB_ARTEMIS_CTL=$ARTEMIS_CTL \
  AMQPSUB_RABBITMQ_CTL=$RABBITMQ_CTL \
  AMQPSUB_RABBITMQ4_CTL=$RABBITMQ4_CTL \
  AMQPSUB_CLUSTER_CTL=${AMQPSUB_CLUSTER_CTL-$CLUSTER_CTL}
amqpsub_out=$(mktemp)
AMQPSUB_SBPEER_CONN=${SBPEER2_CONN:-${AMQPSUB_SBPEER_CONN:-}} AMQPSUB_SBPEER_CONTROL=${SBPEER2_CONTROL:-${AMQPSUB_SBPEER_CONTROL:-}} \
  "$GO" test -race -count=1 -tags peer -timeout "${INTEGRATION_TIMEOUT:-40m}" "${EXTRA[@]}" ./amqpsub >"$amqpsub_out" 2>&1 &
amqpsub_pid=$!
"$GO" test -race -count=1 -timeout "${INTEGRATION_TIMEOUT:-40m}" "${EXTRA[@]}" ./integration/... || integ_rc=$?
wait "$amqpsub_pid" || amqpsub_rc=$?
cat "$amqpsub_out"
rm -f "$amqpsub_out"
[ "$amqpsub_rc" = 0 ] || integ_rc=$amqpsub_rc

section "contrib modules"
# Each adapter under contrib/ (amqpotel, amqpprom, ...) is a module of its
# own, which neither `go list ./...` nor the stages above reach: vet and
# test each one here, with the brokers up and their addresses set, so that
# its integration tests run rather than skip.
contrib_rc=0
contrib_failed=()
for mod in "$ROOT"/contrib/*/go.mod; do
  [ -e "$mod" ] || continue
  dir=$(dirname "$mod")
  name=${dir#"$ROOT"/}
  echo "--- $name: go vet, go test"
  if ! (cd "$dir" &&
    "$GO" vet ./... &&
    AMQPSUB_ARTEMIS_URL=$artemis_url \
    AMQPSUB_RABBITMQ_URL=$rabbitmq_url \
    AMQPSUB_RABBITMQ4_URL=$rabbitmq4_url \
    AMQPSUB_ARTEMIS_CTL=$ARTEMIS_CTL \
    AMQPSUB_RABBITMQ_CTL=$RABBITMQ_CTL \
    AMQPSUB_RABBITMQ4_CTL=$RABBITMQ4_CTL \
      "$GO" test -race -count=1 -timeout 10m "${EXTRA[@]}" ./...); then
    contrib_rc=1
    contrib_failed+=("$name")
  fi
done

section "summary"
timings
[ "$unit_rc" = 0 ] && echo "unit tests: ok" || echo "unit tests: FAIL (exit $unit_rc)"
[ "$fuzz_rc" = 0 ] && echo "fuzz: ok" || echo "fuzz: FAIL (exit $fuzz_rc)"
[ "$checkout_rc" = 0 ] && echo "outside module on this checkout: ok" || echo "outside module on this checkout: FAIL (exit $checkout_rc)"
[ "$integ_rc" = 0 ] && echo "integration tests: ok" || echo "integration tests: FAIL (exit $integ_rc)"
[ "$sbconf_rc" = 0 ] && echo "Service Bus peer conformance: ok" || echo "Service Bus peer conformance: FAIL (exit $sbconf_rc)"
[ "$artemistest_rc" = 0 ] && echo "artemistest: ok" || echo "artemistest: FAIL (exit $artemistest_rc)"
[ "$contrib_rc" = 0 ] && echo "contrib modules: ok" || echo "contrib modules: FAIL (${contrib_failed[*]})"
[ "$unit_rc" = 0 ] && [ "$fuzz_rc" = 0 ] && [ "$checkout_rc" = 0 ] && [ "$integ_rc" = 0 ] && [ "$sbconf_rc" = 0 ] && [ "$artemistest_rc" = 0 ] && [ "$contrib_rc" = 0 ]
