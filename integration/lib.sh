# shellcheck shell=bash
# Process, port and lock helpers of the broker scripts (artemis.sh,
# artemis-cluster.sh, rabbitmq.sh, sbpeer/sbpeer.sh). Sourced, never run:
#
#   SCRIPT_NAME=artemis.sh
#   . "$SCRIPT_DIR/lib.sh"
#
# SCRIPT_NAME prefixes every message. Every wait here is bounded: each
# takes its limit in seconds and returns non-zero when it runs out.
# Works under `set -euo pipefail`.

# log MSG...: one line on stderr, prefixed with the script's name.
log() { echo "$SCRIPT_NAME: $*" >&2; }

# die MSG...: log MSG as an error and exit 1.
die() { log "ERROR: $*"; exit 1; }

# port_open HOST PORT: something accepts TCP connections on HOST:PORT
# (asked once, for 2 s at most).
port_open() { timeout 2 bash -c "exec 3<>/dev/tcp/$1/$2" 2>/dev/null; }

# pid_alive PID: the process exists and is not a zombie. A child of this
# shell that exited stays a zombie until the shell exits, and kill -0
# still succeeds on it; a zombie holds no port, file lock or memory, and
# whoever reaps it (often PID 1, since the brokers are detached) may take
# seconds to do so.
pid_alive() {
  local st
  [ -n "${1:-}" ] || return 1
  st=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
  st=${st##*) }
  [ "${st%% *}" != Z ]
}

# cmdline_has PID STRING...: PID runs and its command line (each argument
# followed by a space) contains every STRING.
cmdline_has() {
  local cmd s
  [ -n "${1:-}" ] && [ -r "/proc/$1/cmdline" ] || return 1
  cmd=$(tr '\0' ' ' 2>/dev/null <"/proc/$1/cmdline") || return 1
  shift
  for s in "$@"; do
    [[ "$cmd" == *"$s"* ]] || return 1
  done
}

# find_pid PIDFILE IS: the PID in PIDFILE if the command `IS PID` holds
# for it, else the first running process for which it holds (the PID file
# was lost); prints nothing if there is none.
find_pid() {
  local pidfile=$1 is=$2 pid="" p
  [ -f "$pidfile" ] && pid=$(cat "$pidfile" 2>/dev/null || true)
  if "$is" "$pid"; then echo "$pid"; return 0; fi
  for p in /proc/[0-9]*; do
    p=${p#/proc/}
    if "$is" "$p"; then echo "$p"; return 0; fi
  done
  return 0
}

# fail_with_log WHAT LOGFILE LINES [PIDFILE]: log WHAT and the last LINES
# lines of LOGFILE, remove PIDFILE if given, and exit 1: a start that failed.
fail_with_log() {
  log "$1; last lines of $2:"
  tail -n "$3" "$2" >&2 || true
  [ -z "${4:-}" ] || rm -f "$4"
  exit 1
}

# take_lock FILE SECS [FD]: an exclusive flock on FILE, held on file
# descriptor FD (default 9) until this shell exits; dies after SECS
# seconds without it. start_bg closes FDs 8 and 9 in what it starts.
take_lock() {
  local file=$1 secs=$2 fd=${3:-9}
  mkdir -p "$(dirname "$file")"
  eval "exec $fd>\"\$file\""
  flock -w "$secs" "$fd" || die "could not lock $file"
}

# start_bg [-C DIR] PIDFILE LOG CMD ARGS...: run CMD in the background,
# detached from the caller's session and signals (setsid, nohup), stdin
# /dev/null, stdout and stderr to LOG, lock FDs 8 and 9 closed, in DIR if
# given. Writes its PID to PIDFILE and sets BG_PID. CMD is exec'd, so the
# PID is CMD's own (or what CMD in turn execs).
start_bg() {
  local dir=.
  if [ "$1" = -C ]; then dir=$2; shift 2; fi
  local pidfile=$1 logfile=$2
  shift 2
  (cd "$dir" && exec setsid nohup "$@" </dev/null >"$logfile" 2>&1 8>&- 9>&-) &
  BG_PID=$!
  echo "$BG_PID" >"$pidfile"
}

# wait_for SECS ALIVE CHECK ARGS...: until `CHECK ARGS...` succeeds,
# asking every WAIT_POLL seconds (default 0.1). Returns 0 once it does, 1 as soon as the command
# ALIVE fails (what was to make CHECK succeed has died), 2 after SECS
# seconds. ALIVE is split at spaces and not otherwise parsed, e.g.
# "pid_alive 1234", or `true` for nothing to watch.
wait_for() {
  local secs=$1 alive=$2 deadline
  shift 2
  deadline=$((SECONDS + secs))
  until "$@"; do
    # shellcheck disable=SC2086
    $alive || return 1
    [ "$SECONDS" -lt "$deadline" ] || return 2
    sleep "${WAIT_POLL:-0.1}"
  done
  return 0
}

# wait_port HOST PORT SECS [ALIVE]: wait_for SECS ALIVE port_open HOST PORT.
wait_port() { wait_for "$3" "${4:-true}" port_open "$1" "$2"; }

# wait_gone PID SECS: until PID has exited (a zombie counts as gone, see
# pid_alive). Returns 1 if it is still alive after SECS seconds.
wait_gone() {
  local pid=$1 deadline=$((SECONDS + $2))
  while pid_alive "$pid"; do
    [ "$SECONDS" -lt "$deadline" ] || return 1
    sleep 0.1
  done
  return 0
}

# adopt_running PID PIDFILE READY WHERE: a start that finds PID (not empty)
# already running: writes it to PIDFILE, waits with `READY PID`, says it
# runs at WHERE and succeeds. Without PID it removes PIDFILE and fails: the
# caller starts the service.
adopt_running() {
  local pid=$1 pidfile=$2 ready=$3 where=$4
  if [ -z "$pid" ]; then
    rm -f "$pidfile"
    return 1
  fi
  echo "$pid" >"$pidfile"
  "$ready" "$pid"
  log "already running (pid $pid) on $where"
}

# report_status PID HEALTHY RUNNING UNHEALTHY: the answer of a status
# command. Without PID: prints "stopped", returns 3. Else, if the command
# HEALTHY succeeds: prints RUNNING, returns 0; if not: UNHEALTHY, 1.
report_status() {
  if [ -z "$1" ]; then echo "stopped"; return 3; fi
  if $2; then echo "$3"; return 0; fi
  echo "$4"
  return 1
}

# stop_service PID PIDFILE SECS: stop_pid PID SECS if PID is not empty (else
# nothing runs), remove PIDFILE and say so; dies if PID survived SIGKILL.
stop_service() {
  local pid=$1 pidfile=$2 secs=$3
  if [ -z "$pid" ]; then
    rm -f "$pidfile"
    log "not running"
    return 0
  fi
  log "stopping pid $pid"
  stop_pid "$pid" "$secs" || die "pid $pid survived SIGKILL"
  rm -f "$pidfile"
  log "stopped"
}

# stop_pid PID SECS [WHAT]: SIGTERM, up to SECS seconds for PID to exit,
# then SIGKILL and up to 10 s more. Returns 1 if it survived SIGKILL. WHAT
# names it in the message about the SIGKILL (default "pid").
stop_pid() {
  local pid=$1 secs=$2 what=${3:-pid}
  kill -TERM "$pid" 2>/dev/null || true
  wait_gone "$pid" "$secs" && return 0
  log "$what $pid still alive after ${secs}s; sending SIGKILL"
  kill -KILL "$pid" 2>/dev/null || true
  wait_gone "$pid" 10
}

# cached_or_lock ARTIFACT DIR [TEST]: a build script's cache check. When
# ARTIFACT passes `test TEST` (default -s: it exists and is not empty; -x
# for a program), print its path and exit 0; otherwise take an exclusive
# flock on DIR/.lock (FD 9, held until the script exits: a concurrent build
# of the same thing is waited for), and check again. Returns when the
# caller has to build ARTIFACT.
cached_or_lock() {
  local t=${3:--s}
  if [ "$t" "$1" ]; then
    echo "$1"
    exit 0
  fi
  mkdir -p "$2"
  exec 9>"$2/.lock"
  flock 9
  if [ "$t" "$1" ]; then # built by a concurrent call while we waited
    echo "$1"
    exit 0
  fi
}

# await_rabbit LOGDIR: wait until the calling script's RabbitMQ node accepts
# on $HOST:$PORT and has booted, within $START_TIMEOUT each, or fail the
# start; then log it, if the caller started it (its local t0). It uses the
# caller's node_alive, fail_start, ctl and beam_pid (rabbitmq.sh and
# rabbitmq4.sh both define them).
await_rabbit() {
  local rc=0
  wait_port "$HOST" "$PORT" "$START_TIMEOUT" node_alive || rc=$?
  case $rc in
    1) fail_start "RabbitMQ exited during start-up" ;;
    2) fail_start "RabbitMQ did not accept on $HOST:$PORT within ${START_TIMEOUT}s" ;;
  esac
  ctl -q await_startup --timeout "$START_TIMEOUT" </dev/null >/dev/null 2>&1 \
    || fail_start "rabbitmqctl await_startup failed"
  [ -n "${t0:-}" ] && log "started (vm pid $(beam_pid)) on $HOST:$PORT in $((SECONDS - t0))s; logs: $1"
  return 0
}
