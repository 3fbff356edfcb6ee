#!/usr/bin/env bash
# Builds one of the JMS test programs (jms-consumer, jms-producer) once and
# prints the path of its shaded jar. Run through the program's own build.sh:
#
#   java -jar "$(bash integration/jms-consumer/build.sh)" --queue Q ...
#
# The jar is cached under $AMQPSUB_CACHE/NAME/<hash>/, keyed by a hash of
# this script, the program's build.sh, pom.xml and src/, so a later call
# prints the path at once (no Maven, no network). The build runs in a
# temporary copy of the project: the source tree gets no target/.
# Concurrent calls wait for one another (flock). Idempotent.
#
# Usage: jms-build.sh NAME ROLE   (NAME the directory, ROLE for messages)
#
# Environment:
#   AMQPSUB_CACHE     cache dir (default ~/.cache/amqpsub)
#   AMQPSUB_MVN_ARGS  extra mvn arguments (e.g. -o once ~/.m2 is filled)
set -euo pipefail

NAME=$1 ROLE=$2
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
DIR="$HERE/$NAME"
CACHE=$(realpath -m "${AMQPSUB_CACHE:-${HOME:-/root}/.cache/amqpsub}")
SCRIPT_NAME="$NAME/build.sh"
# shellcheck source=lib.sh
. "$HERE/lib.sh"

hash=$( { sha256sum <"$HERE/jms-build.sh"; cd "$DIR" && { echo build.sh; echo pom.xml; find src -type f | LC_ALL=C sort; } |
  while read -r f; do printf '%s\0' "$f"; sha256sum <"$f"; done; } | sha256sum | cut -c1-16)
OUT="$CACHE/$NAME/$hash"
JAR="$OUT/$NAME.jar"

cached_or_lock "$JAR" "$CACHE/$NAME"
command -v java >/dev/null || die "java not found (Java 17+ is needed)"
command -v javac >/dev/null || die "javac not found (a JDK 17+ is needed once, to build the $ROLE: Debian openjdk-17-jdk-headless)"
command -v mvn >/dev/null || die "mvn not found (Maven is needed once, to build the $ROLE: Debian maven)"

tmp=$(mktemp -d "$CACHE/$NAME/build.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
cp -r "$DIR/pom.xml" "$DIR/src" "$tmp/"
log "building (once, cached in $OUT)"
# shellcheck disable=SC2086
if ! (cd "$tmp" && mvn -B -q -Dstyle.color=never ${AMQPSUB_MVN_ARGS:-} package </dev/null >"$tmp/mvn.log" 2>&1); then
  cat "$tmp/mvn.log" >&2
  die "mvn package failed"
fi
[ -s "$tmp/target/$NAME.jar" ] || die "mvn left no target/$NAME.jar"
mkdir -p "$OUT"
cp "$tmp/target/$NAME.jar" "$OUT/.$NAME.jar.tmp"
mv "$OUT/.$NAME.jar.tmp" "$JAR"
echo "$JAR"
