#!/usr/bin/env bash
# Builds the JMS consumer once and prints the path of its jar; run it with
#   java -jar "$(bash integration/jms-consumer/build.sh)" --queue Q ...
#
# The shaded jar is cached under $AMQPSUB_CACHE/jms-consumer/<hash>/, keyed
# by a hash of this script, pom.xml and src/, so a later call prints the
# path at once (no Maven, no network). The build runs in a temporary copy of
# the project: the source tree gets no target/. Concurrent calls wait for
# one another (flock). Idempotent.
#
# Environment:
#   AMQPSUB_CACHE     cache dir (default ~/.cache/amqpsub)
#   AMQPSUB_MVN_ARGS  extra mvn arguments (e.g. -o once ~/.m2 is filled)
set -euo pipefail

DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
CACHE=$(realpath -m "${AMQPSUB_CACHE:-${HOME:-/root}/.cache/amqpsub}")

log() { echo "jms-consumer/build.sh: $*" >&2; }
die() { log "ERROR: $*"; exit 1; }

hash=$(cd "$DIR" && { echo build.sh; echo pom.xml; find src -type f | LC_ALL=C sort; } |
  while read -r f; do printf '%s\0' "$f"; sha256sum <"$f"; done | sha256sum | cut -c1-16)
OUT="$CACHE/jms-consumer/$hash"
JAR="$OUT/jms-consumer.jar"

if [ -s "$JAR" ]; then
  echo "$JAR"
  exit 0
fi

command -v java >/dev/null || die "java not found (Java 17+ is needed)"
command -v javac >/dev/null || die "javac not found (a JDK 17+ is needed once, to build the consumer: Debian openjdk-17-jdk-headless)"
command -v mvn >/dev/null || die "mvn not found (Maven is needed once, to build the consumer: Debian maven)"
mkdir -p "$CACHE/jms-consumer"
exec 9>"$CACHE/jms-consumer/.lock"
flock 9
if [ -s "$JAR" ]; then # built by a concurrent call while we waited
  echo "$JAR"
  exit 0
fi

tmp=$(mktemp -d "$CACHE/jms-consumer/build.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
cp -r "$DIR/pom.xml" "$DIR/src" "$tmp/"
log "building (once, cached in $OUT)"
# shellcheck disable=SC2086
if ! (cd "$tmp" && mvn -B -q -Dstyle.color=never ${AMQPSUB_MVN_ARGS:-} package </dev/null >"$tmp/mvn.log" 2>&1); then
  cat "$tmp/mvn.log" >&2
  die "mvn package failed"
fi
[ -s "$tmp/target/jms-consumer.jar" ] || die "mvn left no target/jms-consumer.jar"
mkdir -p "$OUT"
cp "$tmp/target/jms-consumer.jar" "$OUT/.jms-consumer.jar.tmp"
mv "$OUT/.jms-consumer.jar.tmp" "$JAR"
echo "$JAR"
