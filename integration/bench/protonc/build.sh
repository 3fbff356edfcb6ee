#!/usr/bin/env bash
# Builds Qpid Proton C's `receive` example, as Debian ships it
# (libqpid-proton11-dev-examples, /usr/share/proton/examples/c/receive.c),
# with receive.c.patch applied, and prints the path of the binary:
#
#   "$(bash integration/bench/protonc/build.sh)" HOST PORT ADDRESS COUNT [WINDOW]
#
# The patch keeps the example's event loop, decoding and per-message
# accept + settle, and changes only what the bench needs (see the patch):
#   - COUNT > 0 no longer grants all COUNT credits at once: the link keeps the
#     WINDOW the example's receive-forever mode keeps (upstream a fixed
#     BATCH of 1000): WINDOW at attach, topped back up to WINDOW whenever the
#     credit falls below WINDOW/2;
#   - the session and link open once the connection is open (upstream: all
#     three at once), so that the clock starts where the bench's go-amqp
#     loop starts it;
#   - bodies are decoded but not printed; stdout carries instead
#     "start|first|progress|last <CLOCK_MONOTONIC ns> <count>" lines;
#   - it exits 1 if the connection ends before COUNT messages arrived.
#
# Cached under $AMQPSUB_CACHE/bench-protonc/<hash>/, keyed by a hash of this
# script, the patch and the upstream source, so a later call prints the path
# at once. Concurrent calls wait for one another (flock). Idempotent.
#
# Needs gcc, patch, pkg-config and the Debian packages libqpid-proton11-dev and
# libqpid-proton11-dev-examples: `bash integration/prereqs.sh bench`.
set -euo pipefail

DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
CACHE=$(realpath -m "${AMQPSUB_CACHE:-${HOME:-/root}/.cache/amqpsub}")
SRC=/usr/share/proton/examples/c/receive.c

SCRIPT_NAME=protonc/build.sh
# shellcheck source=../../lib.sh
. "$DIR/../../lib.sh"

[ -r "$SRC" ] || die "$SRC not found: install libqpid-proton11-dev-examples (bash integration/prereqs.sh bench)"
hash=$(cat "$DIR/build.sh" "$DIR/receive.c.patch" "$SRC" | sha256sum | cut -c1-16)
OUT="$CACHE/bench-protonc/$hash"
BIN="$OUT/receive"

cached_or_lock "$BIN" "$CACHE/bench-protonc" -x

for t in gcc patch pkg-config; do
  command -v "$t" >/dev/null || die "$t not found (bash integration/prereqs.sh bench)"
done
pkg-config --exists libqpid-proton ||
  die "pkg-config finds no libqpid-proton: install libqpid-proton11-dev (bash integration/prereqs.sh bench)"

tmp=$(mktemp -d "$CACHE/bench-protonc/build.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
cp "$SRC" "$tmp/receive.c"
patch -s -p1 -d "$tmp" <"$DIR/receive.c.patch" || die "receive.c.patch does not apply to $SRC"
# Debian's -dev package has only the all-in-one libqpid-proton.pc (the
# examples' Makefile.pkgconfig asks for -core and -proactor, which it lacks).
# shellcheck disable=SC2046
gcc -O2 -Wall -Wextra -o "$tmp/receive" "$tmp/receive.c" $(pkg-config --cflags --libs libqpid-proton) ||
  die "gcc failed"
mkdir -p "$OUT"
cp "$tmp/receive" "$OUT/.receive.tmp"
cp "$tmp/receive.c" "$OUT/receive.c" # what was built, for reading
mv "$OUT/.receive.tmp" "$BIN"
echo "$BIN"
