#!/usr/bin/env bash
# Lifecycle of the RabbitMQ 3.10 test broker with AMQP 1.0 (plugin
# rabbitmq_amqp1_0), run as a plain background process (not systemd), with
# all its state under the cache dir.
#
#   rabbitmq.sh start|stop|status|restart|reset|url|declare QUEUE|delete QUEUE|purge QUEUE|list|ctl ARGS...
#
#   start         install Debian rabbitmq-server if missing, enable the AMQP 1.0
#                 plugin offline, start epmd (127.0.0.1) if none runs, start
#                 the node and wait until 127.0.0.1:5682 accepts. Idempotent.
#   stop          stop the node (SIGTERM, 30 s, then SIGKILL) and the epmd this
#                 script started. Idempotent.
#   status        exit 0 if running (prints rabbitmqctl status and checks that
#                 rabbitmq_amqp1_0 is running), 3 if stopped, 1 if unhealthy.
#   reset         stop and delete the node's database (queues, messages).
#   url           print amqp://guest:guest@127.0.0.1:5682
#   declare Q     declare a durable classic queue Q in vhost / (rabbitmqctl
#                 eval rabbit_amqqueue:declare/6). Idempotent. Then attach
#                 AMQP 1.0 links to /amq/queue/Q.
#   delete Q      delete queue Q (rabbitmqctl delete_queue).
#   purge Q       purge queue Q (rabbitmqctl purge_queue).
#   list          rabbitmqctl list_queues name messages consumers
#   ctl ARGS      run rabbitmqctl with this node's environment.
#
# Environment:
#   AMQPSUB_CACHE          cache dir (default ~/.cache/amqpsub); state in $AMQPSUB_CACHE/rabbitmq
#   AMQPSUB_START_TIMEOUT  seconds to wait for the port (default 90)
#   AMQPSUB_RABBITMQ_PORT  AMQP port (default 5682)
set -euo pipefail

readonly HOST=127.0.0.1
PORT=${AMQPSUB_RABBITMQ_PORT:-5682}
DIST_PORT=$((PORT + 20000))       # 25682
EPMD_PORT=${ERL_EPMD_PORT:-4369}
CACHE=$(realpath -m "${AMQPSUB_CACHE:-${HOME:-/root}/.cache/amqpsub}")
RDIR="$CACHE/rabbitmq"
START_TIMEOUT=${AMQPSUB_START_TIMEOUT:-90}
STOP_TIMEOUT=30
RMQ_BIN=/usr/lib/rabbitmq/bin
NODE=amqpsub@localhost

WRAPPER_PIDFILE="$RDIR/server.pid"   # the rabbitmq-server shell wrapper
BEAM_PIDFILE="$RDIR/rabbitmq.pid"    # written by RabbitMQ: the Erlang VM
EPMD_PIDFILE="$RDIR/epmd.pid"        # only if this script started epmd
CONSOLE_LOG="$RDIR/log/console.log"

log() { echo "rabbitmq.sh: $*" >&2; }
die() { log "ERROR: $*"; exit 1; }

# Everything RabbitMQ and its CLI tools read. /etc/rabbitmq is ignored.
export RABBITMQ_NODENAME=$NODE
export RABBITMQ_CONFIG_FILE="$RDIR/rabbitmq.conf"
export RABBITMQ_ADVANCED_CONFIG_FILE="$RDIR/advanced.config"
export RABBITMQ_CONF_ENV_FILE="$RDIR/rabbitmq-env.conf"
export RABBITMQ_ENABLED_PLUGINS_FILE="$RDIR/enabled_plugins"
export RABBITMQ_MNESIA_BASE="$RDIR/mnesia"
export RABBITMQ_LOG_BASE="$RDIR/log"
export RABBITMQ_PID_FILE="$BEAM_PIDFILE"
export RABBITMQ_DIST_PORT=$DIST_PORT
export RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS="-kernel inet_dist_use_interface {127,0,0,1}"
export RABBITMQ_CTL_ERL_ARGS="-kernel inet_dist_use_interface {127,0,0,1}"
export ERL_EPMD_ADDRESS=$HOST
export ERL_EPMD_PORT=$EPMD_PORT
# Erlang cookie lives in $HOME; keep ours private to this node.
export HOME="$RDIR/home"

port_open() { timeout 2 bash -c "exec 3<>/dev/tcp/$1/$2" 2>/dev/null; }

alive() { [ -n "${1:-}" ] && kill -0 "$1" 2>/dev/null; }

# cmd_has PID STRING: /proc/PID/cmdline contains STRING
cmd_has() {
  [ -r "/proc/$1/cmdline" ] || return 1
  [[ "$(tr '\0' ' ' <"/proc/$1/cmdline" 2>/dev/null)" == *"$2"* ]]
}

# children PID: PIDs whose parent is PID (no procps needed).
children() {
  local f line fields
  for f in /proc/[0-9]*/stat; do
    line=$(cat "$f" 2>/dev/null) || continue
    read -r -a fields <<<"${line##*) }"   # state ppid pgrp ...
    if [ "${fields[1]:-}" = "$1" ]; then f=${f#/proc/}; echo "${f%/stat}"; fi
  done
  return 0
}

beam_pid() {
  local p=""
  [ -f "$BEAM_PIDFILE" ] && p=$(tr -dc '0-9' <"$BEAM_PIDFILE" 2>/dev/null || true)
  if alive "$p" && cmd_has "$p" "-home $HOME "; then echo "$p"; return 0; fi
  # PID file not written yet (or lost): the VM is the wrapper's child.
  local w
  w=$(wrapper_pid)
  if [ -n "$w" ]; then
    for p in $(children "$w"); do
      cmd_has "$p" "-home $HOME " && { echo "$p"; return 0; }
    done
  fi
  return 0
}

wrapper_pid() {
  local p=""
  [ -f "$WRAPPER_PIDFILE" ] && p=$(cat "$WRAPPER_PIDFILE" 2>/dev/null || true)
  if alive "$p" && cmd_has "$p" "rabbitmq-server"; then echo "$p"; fi
  return 0
}

epmd_pid() {
  local p=""
  [ -f "$EPMD_PIDFILE" ] && p=$(cat "$EPMD_PIDFILE" 2>/dev/null || true)
  if alive "$p" && cmd_has "$p" "epmd"; then echo "$p"; fi
  return 0
}

ctl() { "$RMQ_BIN/rabbitmqctl" -n "$NODE" "$@"; }

with_lock() {
  mkdir -p "$RDIR"
  exec 9>"$RDIR/.lock"
  flock -w 300 9 || die "could not lock $RDIR/.lock"
}

ensure_installed() {
  [ -x "$RMQ_BIN/rabbitmq-server" ] && command -v epmd >/dev/null && return 0
  bash "$(dirname "${BASH_SOURCE[0]}")/prereqs.sh" rabbitmq
  [ -x "$RMQ_BIN/rabbitmq-server" ] || die "rabbitmq-server still missing after install"
}

write_config() {
  mkdir -p "$RDIR/home" "$RDIR/log" "$RDIR/mnesia"
  : >"$RABBITMQ_CONF_ENV_FILE"
  cat >"$RABBITMQ_CONFIG_FILE" <<EOF
# Generated by integration/rabbitmq.sh; edits are overwritten on start.
listeners.tcp.1 = $HOST:$PORT
# guest/guest, allowed from loopback only (the default).
default_user = guest
default_pass = guest
loopback_users.guest = true
# AMQP 1.0 clients using SASL ANONYMOUS act as this user.
amqp1_0.default_user = guest
amqp1_0.default_vhost = /
log.file.level = info
log.console = false
disk_free_limit.absolute = 50MB
EOF
  if [ ! -s "$RABBITMQ_ENABLED_PLUGINS_FILE" ]; then
    "$RMQ_BIN/rabbitmq-plugins" enable --offline rabbitmq_amqp1_0 </dev/null >/dev/null \
      || die "rabbitmq-plugins enable --offline rabbitmq_amqp1_0 failed"
  fi
}

ensure_epmd() {
  if [ -n "$(epmd_pid)" ]; then return 0; fi
  rm -f "$EPMD_PIDFILE"
  if port_open "$HOST" "$EPMD_PORT"; then
    log "using the epmd already listening on $HOST:$EPMD_PORT (not ours; stop will leave it)"
    return 0
  fi
  setsid nohup epmd -address "$HOST" -port "$EPMD_PORT" </dev/null >"$RDIR/log/epmd.log" 2>&1 9>&- &
  echo $! >"$EPMD_PIDFILE"
  for _ in $(seq 1 50); do
    port_open "$HOST" "$EPMD_PORT" && return 0
    sleep 0.1
  done
  die "epmd did not start (see $RDIR/log/epmd.log)"
}

fail_start() {
  log "$1; last lines of the logs:"
  tail -n 30 "$CONSOLE_LOG" >&2 2>/dev/null || true
  tail -n 30 "$RDIR/log/$NODE.log" >&2 2>/dev/null || true
  exit 1
}

cmd_start() {
  with_lock
  local w b
  w=$(wrapper_pid); b=$(beam_pid)
  if [ -z "$w$b" ] && port_open "$HOST" "$PORT"; then
    die "$HOST:$PORT already accepts connections, but not from this node ($RDIR)"
  fi
  if [ -z "$w$b" ]; then
    ensure_installed
    write_config
    ensure_epmd
    rm -f "$BEAM_PIDFILE"
    [ -f "$CONSOLE_LOG" ] && mv -f "$CONSOLE_LOG" "$CONSOLE_LOG.1"
    local t0=$SECONDS
    # The wrapper runs the Erlang VM as its child and turns SIGTERM into a
    # clean stop; RabbitMQ writes the VM's PID to $BEAM_PIDFILE.
    (cd "$RDIR" && exec setsid nohup "$RMQ_BIN/rabbitmq-server" </dev/null >"$CONSOLE_LOG" 2>&1 9>&-) &
    w=$!
    echo "$w" >"$WRAPPER_PIDFILE"
    log "starting node $NODE (wrapper pid $w)"
  else
    log "already running (wrapper pid ${w:-?}, vm pid ${b:-?})"
  fi
  local deadline=$((SECONDS + START_TIMEOUT))
  while ! port_open "$HOST" "$PORT"; do
    [ -n "$(wrapper_pid)$(beam_pid)" ] || fail_start "RabbitMQ exited during start-up"
    [ "$SECONDS" -lt "$deadline" ] || fail_start "RabbitMQ did not accept on $HOST:$PORT within ${START_TIMEOUT}s"
    sleep 0.25
  done
  ctl -q await_startup --timeout "$START_TIMEOUT" </dev/null >/dev/null 2>&1 \
    || fail_start "rabbitmqctl await_startup failed"
  [ -n "${t0:-}" ] && log "started (vm pid $(beam_pid)) on $HOST:$PORT in $((SECONDS - t0))s; logs: $RDIR/log"
  return 0
}

wait_gone() {
  local pid=$1 secs=$2 deadline
  deadline=$((SECONDS + secs))
  while kill -0 "$pid" 2>/dev/null; do
    [ "$SECONDS" -ge "$deadline" ] && return 1
    sleep 0.2
  done
}

cmd_stop() {
  with_lock
  local w b e
  w=$(wrapper_pid); b=$(beam_pid)
  if [ -n "$b" ]; then
    log "stopping node $NODE (vm pid $b)"
    kill -TERM "$b" 2>/dev/null || true
    if ! wait_gone "$b" "$STOP_TIMEOUT"; then
      log "vm pid $b still alive after ${STOP_TIMEOUT}s; sending SIGKILL"
      kill -KILL "$b" 2>/dev/null || true
      wait_gone "$b" 10 || die "vm pid $b survived SIGKILL"
    fi
  elif [ -n "$w" ]; then
    kill -TERM "$w" 2>/dev/null || true
  fi
  if [ -n "$w" ] && ! wait_gone "$w" 10; then
    kill -KILL "$w" 2>/dev/null || true
  fi
  rm -f "$BEAM_PIDFILE" "$WRAPPER_PIDFILE"
  e=$(epmd_pid)
  if [ -n "$e" ]; then
    kill -TERM "$e" 2>/dev/null || true
    wait_gone "$e" 5 || kill -KILL "$e" 2>/dev/null || true
    log "stopped epmd (pid $e)"
  fi
  rm -f "$EPMD_PIDFILE"
  if [ -n "$w$b" ]; then log "stopped"; else log "not running"; fi
  return 0
}

cmd_status() {
  local b
  b=$(beam_pid)
  if [ -z "$b$(wrapper_pid)" ]; then echo "stopped"; return 3; fi
  if ! port_open "$HOST" "$PORT"; then
    echo "starting-or-unhealthy ($HOST:$PORT not accepting)"; return 1
  fi
  local out active
  out=$(ctl status </dev/null 2>&1) || { echo "$out"; echo "unhealthy: rabbitmqctl status failed"; return 1; }
  grep -E '^(Node name|RabbitMQ version|Interface):' <<<"$out" || true
  active=$(ctl -q eval 'lists:member(rabbitmq_amqp1_0, rabbit_plugins:active()).' </dev/null 2>&1 || true)
  if [ "$active" != "true" ]; then
    echo "unhealthy: plugin rabbitmq_amqp1_0 is not running ($active)"; return 1
  fi
  echo "running vm pid $b amqp://guest:guest@$HOST:$PORT (plugin rabbitmq_amqp1_0 running)"
}

check_queue_name() {
  [ -n "${1:-}" ] || die "queue name required"
  [[ "$1" =~ ^[A-Za-z0-9._:-]+$ ]] || die "queue name must match [A-Za-z0-9._:-]+: $1"
}

cmd_declare() {
  check_queue_name "${1:-}"
  # declare(QueueName, Durable, AutoDelete, Args, Owner, ActingUser)
  local out
  out=$(ctl eval "case rabbit_amqqueue:declare(rabbit_misc:r(<<\"/\">>, queue, <<\"$1\">>), true, false, [], none, <<\"amqpsub\">>) of {new, _} -> new; {existing, _} -> existing; Other -> Other end." </dev/null 2>&1) \
    || die "declare $1 failed: $out"
  case "$out" in
    new|existing) echo "$out" ;;
    *) die "declare $1 failed: $out" ;;
  esac
}

case "${1:-}" in
  start)   cmd_start ;;
  stop)    cmd_stop ;;
  status)  cmd_status ;;
  restart) cmd_stop; cmd_start ;;
  reset)   cmd_stop; rm -rf "${RDIR:?}/mnesia"; log "deleted $RDIR/mnesia" ;;
  url)     echo "amqp://guest:guest@$HOST:$PORT" ;;
  declare) cmd_declare "${2:-}" ;;
  delete)  check_queue_name "${2:-}"; ctl -q delete_queue "$2" </dev/null ;;
  purge)   check_queue_name "${2:-}"; ctl -q purge_queue "$2" </dev/null ;;
  list)    ctl -q list_queues name messages consumers durable </dev/null ;;
  ctl)     shift; ctl "$@" ;;
  *) echo "usage: $0 start|stop|status|restart|reset|url|declare Q|delete Q|purge Q|list|ctl ARGS..." >&2; exit 2 ;;
esac
