#!/usr/bin/env bash
# Lifecycle of the Apache Artemis test broker (no Docker needed).
#
#   artemis.sh start|stop|status|restart|kill9|reset|url|pid|log|cli ARGS...
#
#   start    download (once), create the instance (once), copy
#            integration/artemis/{broker.xml,login.config} into etc/, run the broker
#            in the background and wait until 127.0.0.1:5672 accepts.
#            Does nothing if it is already running.
#   stop     SIGTERM, wait up to 30 s, then SIGKILL. Idempotent.
#   status   exit 0 and print the PID if running and 5672 accepts; exit 3 if
#            stopped; exit 1 if the process is alive but 5672 does not accept.
#   restart  stop (if running) and start; the journal is kept.
#   kill9    kill -9 the broker's java process (fault tests). Journal kept.
#   reset    stop and delete the instance's data/ (journal, paging, ...).
#   url      print amqp://127.0.0.1:5672
#   pid      print the broker's PID (exit 3 if not running)
#   log      print the path of the console log
#   cli      run the distribution's `artemis` command against the running
#            broker (CORE port, test user), e.g.
#              artemis.sh cli queue create --name DLQ.orders --address DLQ \
#                --anycast --durable --filter "_AMQ_ORIG_ADDRESS = 'orders'" \
#                --preserve-on-no-consumers --auto-create-address --silent
#
# Environment:
#   AMQPSUB_CACHE              cache dir        (default ~/.cache/amqpsub)
#   AMQPSUB_ARTEMIS_HOME       instance dir     (default $AMQPSUB_CACHE/artemis-instance)
#   AMQPSUB_START_TIMEOUT      seconds to wait for the port (default 90)
#   AMQPSUB_ARTEMIS_JAVA_ARGS  JVM options      (default below, -Xmx1536M)
#   AMQPSUB_MVN_ARGS           extra mvn arguments for the one-time download
#   AMQPSUB_ARTEMIS_PORT       AMQP port        (default 5672)
#   AMQPSUB_ARTEMIS_CORE_PORT  CORE+AMQP port   (default 61616)
#   AMQPSUB_ARTEMIS_BROKER_XML broker.xml copied into etc/ on start
#                              (default integration/artemis/broker.xml; the
#                              fault tests give their broker one with an
#                              extra TLS acceptor)
#   AMQPSUB_ARTEMIS_WAIT       what `start` waits for: `port` (default), the
#                              AMQP port accepting; or `process`, the broker's
#                              java process running (a shared-store backup
#                              opens no port until it becomes active; see
#                              integration/artemis-cluster.sh)
#   A second broker (for tests that kill one) needs its own
#   AMQPSUB_ARTEMIS_HOME and both ports.
set -euo pipefail

readonly ARTEMIS_VERSION=2.40.0
readonly ARTEMIS_GAV="org.apache.activemq:apache-artemis:${ARTEMIS_VERSION}:tar.gz:bin"
readonly HOST=127.0.0.1
readonly PORT=${AMQPSUB_ARTEMIS_PORT:-5672}
readonly CORE_PORT=${AMQPSUB_ARTEMIS_CORE_PORT:-61616}

SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
SCRIPT_NAME=artemis.sh
# shellcheck source-path=SCRIPTDIR source=lib.sh
. "$SCRIPT_DIR/lib.sh"
CACHE=$(realpath -m "${AMQPSUB_CACHE:-${HOME:-/root}/.cache/amqpsub}")
DIST="$CACHE/apache-artemis-$ARTEMIS_VERSION"
TARBALL="$CACHE/apache-artemis-$ARTEMIS_VERSION-bin.tar.gz"
INSTANCE=$(realpath -m "${AMQPSUB_ARTEMIS_HOME:-$CACHE/artemis-instance}")
PIDFILE="$INSTANCE/artemis.pid"
LOG="$INSTANCE/log/console.log"
BROKER_XML=${AMQPSUB_ARTEMIS_BROKER_XML:-$SCRIPT_DIR/artemis/broker.xml}
LOGIN_CONFIG="$SCRIPT_DIR/artemis/login.config"
START_TIMEOUT=${AMQPSUB_START_TIMEOUT:-90}
WAIT_FOR=${AMQPSUB_ARTEMIS_WAIT:-port}
case "$WAIT_FOR" in port|process) ;; *) echo "artemis.sh: AMQPSUB_ARTEMIS_WAIT must be port or process, not '$WAIT_FOR'" >&2; exit 2 ;; esac
STOP_TIMEOUT=30
# The instance's etc/artemis.profile only sets JAVA_ARGS when it is empty;
# this is its default list with a smaller heap and without the hawtio
# (web console) options, which --no-web makes useless.
DEFAULT_JAVA_ARGS="-XX:AutoBoxCacheMax=20000 -XX:+UseG1GC -XX:+UseStringDeduplication -Xms512M -Xmx1536M -XX:+HeapDumpOnOutOfMemoryError -XX:HeapDumpPath=$INSTANCE/log/oom_dump.hprof -Dlog4j2.disableJmx=true --add-opens java.base/jdk.internal.misc=ALL-UNNAMED"
JAVA_ARGS_TO_USE="${AMQPSUB_ARTEMIS_JAVA_ARGS:-$DEFAULT_JAVA_ARGS} -Damqpsub.port=$PORT -Damqpsub.coreport=$CORE_PORT"

amqp_open() { port_open "$HOST" "$PORT"; }

# is_broker PID: the process exists and is the java broker of THIS instance.
is_broker() { cmdline_has "${1:-}" org.apache.activemq.artemis.boot.Artemis "-Dartemis.instance=$INSTANCE "; }

# broker_pid: PID from the pid file if valid, else a java process started for
# this instance directory (pid file lost). Prints nothing if none.
broker_pid() { find_pid "$PIDFILE" is_broker; }

with_lock() { take_lock "$CACHE/.artemis.lock" 300; }

check_java() {
  command -v java >/dev/null || die "java not found (need Java 17+)"
  local v
  v=$(java -version 2>&1 | sed -n 's/.*version "\([0-9]*\).*/\1/p' | head -1)
  [ -n "$v" ] && [ "$v" -ge 17 ] || die "Java 17+ needed, found: $(java -version 2>&1 | head -1)"
}

fetch_dist() {
  [ -x "$DIST/bin/artemis" ] && return 0
  mkdir -p "$CACHE"
  if [ ! -s "$TARBALL" ]; then
    command -v mvn >/dev/null || die "mvn not found (needed once to download Artemis)"
    log "downloading $ARTEMIS_GAV with Maven"
    local tmp
    tmp=$(mktemp -d)
    # shellcheck disable=SC2086
    if ! (cd "$tmp" && mvn -B -q -Dstyle.color=never ${AMQPSUB_MVN_ARGS:-} dependency:copy \
          -Dartifact="$ARTEMIS_GAV" -DoutputDirectory="$tmp/out" </dev/null >"$tmp/mvn.log" 2>&1); then
      cat "$tmp/mvn.log" >&2
      rm -rf "$tmp"; die "Maven download of $ARTEMIS_GAV failed"
    fi
    mv "$tmp/out/apache-artemis-$ARTEMIS_VERSION-bin.tar.gz" "$TARBALL.part"
    rm -rf "$tmp"
    mv "$TARBALL.part" "$TARBALL"
  fi
  log "unpacking $TARBALL"
  local tmpd
  tmpd=$(mktemp -d "$CACHE/.unpack.XXXXXX")
  tar -xzf "$TARBALL" -C "$tmpd" || { rm -rf "$tmpd"; die "cannot unpack $TARBALL"; }
  [ -x "$tmpd/apache-artemis-$ARTEMIS_VERSION/bin/artemis" ] || { rm -rf "$tmpd"; die "unexpected tarball layout"; }
  rm -rf "$DIST"
  mv "$tmpd/apache-artemis-$ARTEMIS_VERSION" "$DIST"
  rm -rf "$tmpd"
}

ensure_instance() {
  [ -f "$INSTANCE/.amqpsub-created" ] && [ -x "$INSTANCE/bin/artemis" ] && return 0
  fetch_dist
  log "creating broker instance in $INSTANCE"
  mkdir -p "$(dirname "$INSTANCE")"
  local force=()
  [ -e "$INSTANCE" ] && force=(--force)
  "$DIST/bin/artemis" create --silent "${force[@]}" \
      --host "$HOST" --no-web --no-autotune --no-fsync --nio \
      --user amqpsub --password amqpsub --allow-anonymous \
      "$INSTANCE" </dev/null >"$CACHE/artemis-create.log" 2>&1 \
    || { cat "$CACHE/artemis-create.log" >&2; die "artemis create failed"; }
  touch "$INSTANCE/.amqpsub-created"
}

# wait_ready PID: until the AMQP port accepts (AMQPSUB_ARTEMIS_WAIT=port) or
# PID is this instance's java process, i.e. bin/artemis has exec'd java
# (process: a broker whose port is not expected to open). Exits 1 if PID
# dies first or the wait outlasts START_TIMEOUT.
wait_ready() {
  local pid=$1 rc=0
  if [ "$WAIT_FOR" = process ]; then
    wait_for "$START_TIMEOUT" "pid_alive $pid" is_broker "$pid" || rc=$?
  else
    wait_port "$HOST" "$PORT" "$START_TIMEOUT" "pid_alive $pid" || rc=$?
  fi
  case $rc in
    0) return 0 ;;
    1) fail_with_log "broker process $pid exited during start-up" "$LOG" 60 "$PIDFILE" ;;
  esac
  [ "$WAIT_FOR" = process ] && die "pid $pid did not become the broker's java process within ${START_TIMEOUT}s"
  fail_with_log "broker (pid $pid) did not accept on $HOST:$PORT within ${START_TIMEOUT}s" "$LOG" 60
}

cmd_start() {
  with_lock
  local pid
  adopt_running "$(broker_pid)" "$PIDFILE" wait_ready "$HOST:$PORT" && return 0
  amqp_open && die "$HOST:$PORT already accepts connections, but not from this instance ($INSTANCE)"
  check_java
  ensure_instance
  # Our config wins over what `artemis create` wrote, on every start.
  cp "$BROKER_XML" "$INSTANCE/etc/broker.xml"
  cp "$LOGIN_CONFIG" "$INSTANCE/etc/login.config"
  mkdir -p "$INSTANCE/log"
  [ -f "$LOG" ] && mv -f "$LOG" "$LOG.1"
  local t0=$SECONDS
  # bin/artemis execs java, so BG_PID is the java PID.
  JAVA_ARGS="$JAVA_ARGS_TO_USE" start_bg "$PIDFILE" "$LOG" "$INSTANCE/bin/artemis" run
  pid=$BG_PID
  wait_ready "$pid"
  # Belt and braces: make sure the PID is the java process itself.
  if ! is_broker "$pid"; then
    local real
    real=$(broker_pid)
    [ -n "$real" ] || die "cannot find the broker's java process"
    pid=$real
    echo "$pid" >"$PIDFILE"
  fi
  if [ "$WAIT_FOR" = process ]; then
    log "started (pid $pid; $HOST:$PORT not waited for) in $((SECONDS - t0))s; log: $LOG"
  else
    log "started (pid $pid) on $HOST:$PORT in $((SECONDS - t0))s; log: $LOG"
  fi
}

cmd_stop() {
  with_lock
  stop_service "$(broker_pid)" "$PIDFILE" "$STOP_TIMEOUT"
}

cmd_kill9() {
  with_lock
  local pid
  pid=$(broker_pid)
  [ -n "$pid" ] || { log "not running"; return 0; }
  kill -KILL "$pid"
  wait_gone "$pid" 10 || die "pid $pid survived SIGKILL"
  rm -f "$PIDFILE"
  log "killed pid $pid with SIGKILL"
}

cmd_status() {
  local pid
  pid=$(broker_pid)
  report_status "$pid" amqp_open "running pid $pid amqp://$HOST:$PORT" \
    "starting-or-unhealthy pid $pid ($HOST:$PORT not accepting)"
}

cmd_reset() {
  cmd_stop
  if [ -d "$INSTANCE/data" ]; then
    rm -rf "${INSTANCE:?}/data"
    log "deleted $INSTANCE/data"
  fi
}

case "${1:-}" in
  start)   cmd_start ;;
  stop)    cmd_stop ;;
  status)  cmd_status ;;
  restart) cmd_stop; cmd_start ;;
  kill9)   cmd_kill9 ;;
  reset)   cmd_reset ;;
  url)     echo "amqp://$HOST:$PORT" ;;
  pid)     pid=$(broker_pid); [ -n "$pid" ] || exit 3; echo "$pid" ;;
  log)     echo "$LOG" ;;
  cli)     shift; [ -x "$INSTANCE/bin/artemis" ] || die "no instance at $INSTANCE: run start first"
           exec "$INSTANCE/bin/artemis" "$@" --url "tcp://$HOST:$CORE_PORT" --user amqpsub --password amqpsub ;;
  *) echo "usage: $0 start|stop|status|restart|kill9|reset|url|pid|log|cli ARGS..." >&2; exit 2 ;;
esac
