#!/usr/bin/env bash
# Installs what `make demo`, `make test` and `make bench` need on Debian 12,
# idempotently: a second run that finds everything present changes nothing
# and takes well under a second. Run by the Makefile before those targets and
# by .ci/run; run it by hand as `bash integration/prereqs.sh test`.
#
#   prereqs.sh demo    Java 17+ and Maven (Artemis is downloaded with Maven),
#                      flock, Go
#   prereqs.sh rabbitmq  rabbitmq-server only (rabbitmq.sh start runs this)
#   prereqs.sh rabbitmq4 debootstrap only (rabbitmq4.sh start runs this): it
#                      makes the Debian trixie root that RabbitMQ 4 runs in
#   prereqs.sh test    demo's, plus a JDK (the JMS producer is built with
#                      Maven), gcc (go test -race needs cgo), openssl (the
#                      TLS test writes a keystore), rabbitmq-server (the
#                      second broker), debootstrap (rabbitmq4's),
#                      python3-qpid-proton (the Python producer)
#   prereqs.sh bench   test's, plus what the bench's reference consumers
#                      need besides: Proton C's receive example
#                      (libqpid-proton11-dev-examples, as source) and its
#                      headers and library (libqpid-proton11-dev), patch and
#                      pkg-config to build it (the JMS consumer is built with
#                      test's JDK and Maven, the Python receiver runs on
#                      test's python3-qpid-proton)
#
# Missing Debian packages are installed with apt-get as root, with a
# temporary /usr/sbin/policy-rc.d so that no system service starts (a
# rabbitmq-server service would take port 5672 from Artemis). Not root and
# something missing: it says what to install and exits 1.
set -euo pipefail

log() { printf 'prereqs.sh: %s\n' "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

# apt_install PKG...: install without starting services; restore policy-rc.d.
apt_install() {
  [ "$(id -u)" = 0 ] || die "missing Debian packages: $*; install them as root (apt-get install $*)"
  log "installing Debian packages: $*"
  local saved="" rc=0
  if [ -e /usr/sbin/policy-rc.d ]; then saved=$(mktemp); cp -p /usr/sbin/policy-rc.d "$saved"; fi
  printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
  chmod 755 /usr/sbin/policy-rc.d
  {
    DEBIAN_FRONTEND=noninteractive apt-get update -q &&
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "$@"
  } </dev/null || rc=$?
  if [ -n "$saved" ]; then mv -f "$saved" /usr/sbin/policy-rc.d; else rm -f /usr/sbin/policy-rc.d; fi
  [ "$rc" = 0 ] || die "apt-get install $* failed (exit $rc)"
}

set_=${1:-test}
case "$set_" in demo|test|rabbitmq|rabbitmq4|bench) ;; *) die "usage: prereqs.sh demo|test|rabbitmq|rabbitmq4|bench" ;; esac

need=()
rabbit_ok() { [ -x /usr/lib/rabbitmq/bin/rabbitmq-server ] && command -v epmd >/dev/null; }
if [ "$set_" = rabbitmq ]; then
  rabbit_ok || apt_install rabbitmq-server
  exit 0
fi
# RabbitMQ 4 comes from trixie inside a root of its own (rabbitmq4.sh);
# the host needs only debootstrap to make that root.
if [ "$set_" = rabbitmq4 ]; then
  command -v debootstrap >/dev/null || apt_install debootstrap
  exit 0
fi
command -v java >/dev/null || need+=(openjdk-17-jre-headless)
command -v mvn >/dev/null || need+=(maven)
command -v flock >/dev/null || need+=(util-linux)
if [ "$set_" != demo ]; then
  command -v javac >/dev/null || need+=(openjdk-17-jdk-headless)
  command -v gcc >/dev/null || need+=(gcc libc6-dev)
  command -v openssl >/dev/null || need+=(openssl)
  rabbit_ok || need+=(rabbitmq-server)
  command -v debootstrap >/dev/null || need+=(debootstrap)
  # The tests run Debian's python, not one earlier on PATH (pyenv's, say).
  /usr/bin/python3 -c 'import proton' 2>/dev/null || need+=(python3-qpid-proton)
fi
# The examples package holds receive.c as source; the bench patches it and
# compiles it against the -dev package (integration/bench/protonc/build.sh).
pkg_ok() { [ "$(dpkg-query -W -f='${Status}' "$1" 2>/dev/null)" = "install ok installed" ]; }
if [ "$set_" = bench ]; then
  pkg_ok libqpid-proton11-dev || need+=(libqpid-proton11-dev)
  pkg_ok libqpid-proton11-dev-examples || need+=(libqpid-proton11-dev-examples)
  command -v patch >/dev/null || need+=(patch)
  command -v pkg-config >/dev/null || need+=(pkgconf)
fi
if [ "${#need[@]}" -gt 0 ]; then
  apt_install "${need[@]}"
fi

jv=$(java -version 2>&1 | sed -n 's/.*version "\([0-9]*\).*/\1/p' | head -1)
[ -n "$jv" ] && [ "$jv" -ge 17 ] || die "Java 17+ needed, found: $(java -version 2>&1 | head -1)"
command -v go >/dev/null || die "go not found on PATH (Go 1.25+ is needed)"
/usr/bin/python3 -c 'import proton' 2>/dev/null || [ "$set_" = demo ] || die "python3-qpid-proton installed, but /usr/bin/python3 cannot import proton"
exit 0
