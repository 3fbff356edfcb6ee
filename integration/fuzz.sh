#!/usr/bin/env bash
# Runs every Go fuzz target in the module for FUZZTIME each (default 8s):
# short, bounded runs in CI (integration/test.sh), long ones locally with
# FUZZTIME=5m make fuzz. A target is any `func FuzzX(f *testing.F)` in a
# _test.go file outside integration/. Exits non-zero if any target fails.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
GO=${GO:-go}
FUZZTIME=${FUZZTIME:-8s}
rc=0
while IFS=: read -r file _ line; do
  name=$(sed -n 's/^func \(Fuzz[A-Za-z0-9_]*\)(.*/\1/p' <<<"$line")
  [ -n "$name" ] || continue
  pkg=./$(dirname "$file")
  echo "fuzz $pkg $name for $FUZZTIME"
  "$GO" test -run '^$' -fuzz "^${name}\$" -fuzztime "$FUZZTIME" "$pkg" || rc=1
done < <(grep -rn --include='*_test.go' '^func Fuzz' . | grep -v '^./integration/' | sort)
exit "$rc"
