#!/usr/bin/env bash
# Lifecycle of sbpeer, the scripted Azure Service Bus peer (peer.py).
#
#   sbpeer.sh start|stop|status|restart|url|ctl-url|pid|log|ctl
#
#   start    run peer.py in the background (Debian's /usr/bin/python3 with
#            python3-qpid-proton) and wait until its AMQP port accepts and
#            its control API answers. Does nothing if it is already running.
#   stop     SIGTERM, wait up to 10 s, then SIGKILL. Idempotent.
#   status   exit 0 and print the PID if running and both ports answer;
#            exit 3 if stopped; exit 1 if the process is alive but does not
#            answer.
#   restart  stop (if running) and start. The peer keeps no state on disk:
#            a restart empties every entity.
#   url      print the emulator connection string for the official SDKs and
#            amqpsub:
#            Endpoint=sb://127.0.0.1:5673;SharedAccessKeyName=RootManageSharedAccessKey;SharedAccessKey=<key>;UseDevelopmentEmulator=true;
#   ctl-url  print the control API's base URL, http://127.0.0.1:5674
#   ctl      without arguments: as ctl-url. With arguments,
#            `ctl METHOD PATH [JSON]` sends one control request and prints
#            the JSON answer; exit 1 on an HTTP error. Examples:
#              sbpeer.sh ctl POST /entities '{"name":"q1","lock_duration_ms":2000}'
#              sbpeer.sh ctl GET '/messages?entity=q1/$DeadLetterQueue'
#              sbpeer.sh ctl GET /counters
#   pid      print the peer's PID (exit 3 if not running)
#   log      print the path of the peer's log
#
# Environment:
#   AMQPSUB_CACHE                cache dir (default ~/.cache/amqpsub); state
#                                in $AMQPSUB_CACHE/sbpeer
#   AMQPSUB_SBPEER_PORT          AMQP port (default 5673)
#   AMQPSUB_SBPEER_CONTROL_PORT  control API port (default 5674)
#   AMQPSUB_SBPEER_KEY           SharedAccessKey of RootManageSharedAccessKey
#                                (default: a fixed test key, not a secret)
#   AMQPSUB_SBPEER_ARGS          extra peer.py arguments (e.g. --verbose)
#   AMQPSUB_START_TIMEOUT        seconds to wait for the ports (default 30)
# A second peer needs its own AMQPSUB_CACHE (or both ports).
set -euo pipefail

readonly HOST=127.0.0.1
readonly PORT=${AMQPSUB_SBPEER_PORT:-5673}
readonly CONTROL_PORT=${AMQPSUB_SBPEER_CONTROL_PORT:-5674}
readonly KEY_NAME=RootManageSharedAccessKey
readonly KEY=${AMQPSUB_SBPEER_KEY:-c2JwZWVyLXRlc3Qta2V5LW5vdC1hLXNlY3JldA==}
readonly PYTHON=/usr/bin/python3

SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
SCRIPT_NAME=sbpeer.sh
# shellcheck source-path=SCRIPTDIR source=../lib.sh
. "$SCRIPT_DIR/../lib.sh"
PEER="$SCRIPT_DIR/peer.py"
CACHE=$(realpath -m "${AMQPSUB_CACHE:-${HOME:-/root}/.cache/amqpsub}")
STATE="$CACHE/sbpeer"
PIDFILE="$STATE/sbpeer.pid"
LOG="$STATE/sbpeer.log"
START_TIMEOUT=${AMQPSUB_START_TIMEOUT:-30}
STOP_TIMEOUT=10
CONTROL_URL="http://$HOST:$CONTROL_PORT"

# ctl_request METHOD PATH [JSON]: one control request; prints the answer.
ctl_request() {
  "$PYTHON" - "$CONTROL_URL" "$@" <<'PY'
import sys, urllib.request, urllib.error
base, method, path = sys.argv[1], sys.argv[2].upper(), sys.argv[3]
body = sys.argv[4].encode() if len(sys.argv) > 4 else None
if not path.startswith("/"):
    path = "/" + path
req = urllib.request.Request(base + path, data=body, method=method,
                             headers={"Content-Type": "application/json"})
try:
    with urllib.request.urlopen(req, timeout=30) as r:
        sys.stdout.write(r.read().decode())
except urllib.error.HTTPError as e:
    sys.stdout.write(e.read().decode())
    sys.exit(1)
except OSError as e:
    sys.stderr.write("sbpeer.sh: control API at %s: %s\n" % (base, e))
    sys.exit(1)
PY
}

# healthy: the control API answers and the peer listens on the AMQP port
# (asking it rather than probing the port keeps the peer's log clean).
healthy() { ctl_request GET /health 2>/dev/null | grep -q '"listening": true'; }

# is_peer PID: the process exists and is peer.py serving OUR port.
is_peer() { cmdline_has "${1:-}" "$PEER " "--port $PORT "; }

# peer_pid: PID from the pid file if valid, else a peer.py process for this
# port (pid file lost). Prints nothing if none.
peer_pid() { find_pid "$PIDFILE" is_peer; }

with_lock() { take_lock "$STATE/.lock" 60; }

# wait_ready PID: until the peer is healthy; exits 1 if PID dies first or
# the wait outlasts START_TIMEOUT.
wait_ready() {
  local pid=$1 rc=0
  wait_for "$START_TIMEOUT" "pid_alive $pid" healthy || rc=$?
  case $rc in
    0) return 0 ;;
    1) fail_with_log "peer process $pid exited during start-up" "$LOG" 40 "$PIDFILE" ;;
  esac
  fail_with_log "peer (pid $pid) not ready on $HOST:$PORT / $CONTROL_URL within ${START_TIMEOUT}s" "$LOG" 40
}

cmd_start() {
  with_lock
  local pid
  adopt_running "$(peer_pid)" "$PIDFILE" wait_ready "$HOST:$PORT, control $CONTROL_URL" && return 0
  port_open "$HOST" "$PORT" && die "$HOST:$PORT already accepts connections, but not from sbpeer"
  port_open "$HOST" "$CONTROL_PORT" && die "$HOST:$CONTROL_PORT already accepts connections, but not from sbpeer"
  "$PYTHON" -c 'import proton' 2>/dev/null \
    || die "$PYTHON cannot import proton; install python3-qpid-proton (bash integration/prereqs.sh test)"
  [ -f "$LOG" ] && mv -f "$LOG" "$LOG.1"
  # python is exec'd, so BG_PID is the peer itself.
  # shellcheck disable=SC2086
  AMQPSUB_SBPEER_KEY="$KEY" start_bg "$PIDFILE" "$LOG" "$PYTHON" "$PEER" --port "$PORT" \
      --control-port "$CONTROL_PORT" --key-name "$KEY_NAME" ${AMQPSUB_SBPEER_ARGS:-}
  pid=$BG_PID
  wait_ready "$pid"
  log "started (pid $pid) on $HOST:$PORT, control $CONTROL_URL; log: $LOG"
}

cmd_stop() {
  with_lock
  stop_service "$(peer_pid)" "$PIDFILE" "$STOP_TIMEOUT"
}

cmd_status() {
  local pid
  pid=$(peer_pid)
  report_status "$pid" healthy "running pid $pid amqp://$HOST:$PORT control $CONTROL_URL" \
    "starting-or-unhealthy pid $pid"
}

case "${1:-}" in
  start)   cmd_start ;;
  stop)    cmd_stop ;;
  status)  cmd_status ;;
  restart) cmd_stop; cmd_start ;;
  url)     echo "Endpoint=sb://$HOST:$PORT;SharedAccessKeyName=$KEY_NAME;SharedAccessKey=$KEY;UseDevelopmentEmulator=true;" ;;
  ctl-url) echo "$CONTROL_URL" ;;
  ctl)     shift
           if [ $# -eq 0 ]; then echo "$CONTROL_URL"
           elif [ $# -lt 2 ] || [ $# -gt 3 ]; then
             echo "usage: $0 ctl [METHOD PATH [JSON]]" >&2; exit 2
           else ctl_request "$@"; fi ;;
  pid)     pid=$(peer_pid); [ -n "$pid" ] || exit 3; echo "$pid" ;;
  log)     echo "$LOG" ;;
  *) echo "usage: $0 start|stop|status|restart|url|ctl-url|pid|log|ctl [METHOD PATH [JSON]]" >&2; exit 2 ;;
esac
