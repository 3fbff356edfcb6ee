#!/usr/bin/env bash
# trace.sh: the files one delivery's path crosses, from its receive to its
# disposition (docs/design.md, "One delivery's path"). Runs each trace test
# of integration/trace_test.go twice under a coverage profile: once with
# its delivery and once without (AMQPSUB_TRACE_BASELINE=1), and prints the
# files of the module that hold a block only the run with the delivery
# executed, with how many such blocks each holds. internal/publish (the
# tests' publisher) is left out. Needs what the tests need: Artemis
# (AMQPSUB_ARTEMIS_URL) and the Service Bus peer (AMQPSUB_SBPEER_CONN,
# AMQPSUB_SBPEER_CONTROL); `make trace` starts Artemis and the peer.
#
# Usage: integration/trace.sh [TestTraceArtemisDelivery|TestTraceServiceBusDelivery ...]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
GO=${GO:-go}
mod=github.com/amqpsub/amqpsub
tests=("$@")
[ ${#tests[@]} -gt 0 ] || tests=(TestTraceArtemisDelivery TestTraceServiceBusDelivery)
dir=$(mktemp -d)
trap '[ -n "${KEEP:-}" ] || rm -rf "$dir"' EXIT
for t in "${tests[@]}"; do
  for run in delivery baseline; do
    base=0
    [ "$run" = delivery ] || base=1
    AMQPSUB_TRACE_BASELINE=$base "$GO" test -v -count=1 -run "^$t\$" -covermode=count \
      -coverpkg="$mod/amqpsub,$mod/internal/..." -coverprofile="$dir/$run.out" ./integration/ >"$dir/$run.log" 2>&1 ||
      { cat "$dir/$run.log" >&2; exit 1; }
    if ! grep -q -- "--- PASS: $t " "$dir/$run.log"; then
      echo "$t did not pass (is its broker up?):" >&2
      cat "$dir/$run.log" >&2
      exit 1
    fi
  done
  echo "$t:"
  # A block's line is "file:range statements count"; a file counts when a
  # block of it ran in the delivery's run and never in the baseline.
  awk -v mod="$mod/" '
    FNR == 1 { next }
    FILENAME ~ /baseline/ { n = $NF; $NF = ""; base[$0] += n; next }
    { n = $NF; $NF = ""; if (n > 0) del[$0] += n }
    END {
      for (b in del) if (!(b in base) || base[b] == 0) { split(b, part, ":"); files[part[1]]++ }
      for (name in files) { g = name; sub(mod, "", g); if (g !~ /^internal\/publish\//) printf "%4d  %s\n", files[name], g }
    }' "$dir/baseline.out" "$dir/delivery.out" | sort -k2 | tee "$dir/files"
  echo "  $(wc -l <"$dir/files") files"
done
