#!/usr/bin/env bash
# Lifecycle of the RabbitMQ 4.0.5 test broker (native AMQP 1.0), run as a
# plain background process (not systemd) inside a Debian trixie root of its
# own, with all its state under the cache dir. Debian 12 has no RabbitMQ 4:
# trixie's rabbitmq-server 4.0.5 and Erlang 27.3 need trixie's glibc and
# OpenSSL, so they run chrooted in a root made with debootstrap.
#
#   rabbitmq4.sh install|start|stop|status|restart|reset|url|declare Q classic|quorum|delete Q|purge Q|count Q|list|ctl ARGS...
#
#   install       make the trixie root with rabbitmq-server in it, once:
#                 restored from the cached tarball of it (about 8 s), or
#                 made with debootstrap and apt-get (about 75 s, some 78 MB
#                 of downloads), and then cached as that tarball. Idempotent.
#   start         install if missing, start our epmd (127.0.0.1), start the
#                 node and wait until 127.0.0.1:5692 accepts and the node
#                 has booted. Idempotent.
#   stop          stop the node (SIGTERM, 30 s, then SIGKILL) and the epmd
#                 this script started, by their PIDs. Idempotent.
#   status        exit 0 if running (prints a few lines of rabbitmqctl
#                 status), 3 if stopped, 1 if unhealthy.
#   reset         stop and delete the node's database (queues, messages).
#   url           print amqp://guest:guest@127.0.0.1:5692
#   declare Q K   declare the durable queue Q of kind K (classic or quorum)
#                 that dead-letters to the default exchange with routing key
#                 Q.dlq, and the durable classic queue Q.dlq that collects
#                 them. A quorum queue keeps RabbitMQ's default delivery-limit
#                 (20) unless AMQPSUB_RABBITMQ4_DELIVERY_LIMIT is set.
#                 Prints new or existing; fails if Q exists with other
#                 arguments. Then attach AMQP 1.0 links to /queues/Q.
#   delete Q      delete queue Q and Q.dlq (either may be missing).
#   purge Q       purge queue Q.
#   count Q       print the number of messages ready in Q.
#   list          rabbitmqctl list_queues name type messages_ready ...
#   ctl ARGS      run rabbitmqctl (inside the root) against this node.
#
# Needs root (chroot, and a private mount namespace for /proc and the state
# dir, so no mount is left behind on the host). Everything listens on
# 127.0.0.1 only (epmd also on ::1, which it always adds).
#
# Environment:
#   AMQPSUB_CACHE          cache dir (default ~/.cache/amqpsub); root, tarball and state in $AMQPSUB_CACHE/rabbitmq4
#   AMQPSUB_START_TIMEOUT  seconds to wait for the port (default 90)
#   AMQPSUB_RABBITMQ4_PORT       AMQP port (default 5692)
#   AMQPSUB_RABBITMQ4_DIST_PORT  Erlang distribution port (default AMQP port + 20000: 25692);
#                                rabbitmqctl uses the 20 ports from this + 10000 (35692-35711)
#   AMQPSUB_RABBITMQ4_EPMD_PORT  epmd port (default 4371; the 3.10 broker's epmd has 4369)
#   AMQPSUB_RABBITMQ4_DELIVERY_LIMIT  x-delivery-limit of quorum queues `declare` makes (default: none, RabbitMQ's 20)
#   AMQPSUB_RABBITMQ4_MIRROR     Debian mirror for debootstrap (default http://deb.debian.org/debian)
set -euo pipefail

SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
SCRIPT_NAME=rabbitmq4.sh
# shellcheck source-path=SCRIPTDIR source=lib.sh
. "$SCRIPT_DIR/lib.sh"

readonly HOST=127.0.0.1
PORT=${AMQPSUB_RABBITMQ4_PORT:-5692}
DIST_PORT=${AMQPSUB_RABBITMQ4_DIST_PORT:-$((PORT + 20000))}   # 25692
CTL_PORT_MIN=$((DIST_PORT + 10000))                           # 35692
EPMD_PORT=${AMQPSUB_RABBITMQ4_EPMD_PORT:-4371}
MIRROR=${AMQPSUB_RABBITMQ4_MIRROR:-http://deb.debian.org/debian}
DELIVERY_LIMIT=${AMQPSUB_RABBITMQ4_DELIVERY_LIMIT:-}
CACHE=$(realpath -m "${AMQPSUB_CACHE:-${HOME:-/root}/.cache/amqpsub}")
RDIR="$CACHE/rabbitmq4"
START_TIMEOUT=${AMQPSUB_START_TIMEOUT:-90}
STOP_TIMEOUT=30
SUITE=trixie
NODE=amqpsub4@localhost

ROOT="$RDIR/root"                    # the trixie root (restored from $TARBALL when missing)
TARBALL="$RDIR/root-$SUITE.tar.gz"   # that root, as installed
READY="$ROOT/.amqpsub-root"          # written last into a finished root: what it holds
STATE="$RDIR/state"                  # config, mnesia, logs, cookie; /amqpsub inside the root
IN=/amqpsub                          # $STATE as the processes in the root see it
RMQ_BIN=/usr/lib/rabbitmq/bin        # inside the root

WRAPPER_PIDFILE="$STATE/server.pid"  # the rabbitmq-server shell wrapper
BEAM_PIDFILE="$STATE/rabbitmq.pid"   # written by RabbitMQ: the Erlang VM
EPMD_PIDFILE="$STATE/epmd.pid"
CONSOLE_LOG="$STATE/log/console.log"

# Everything RabbitMQ and its CLI tools read, as paths inside the root.
# /etc/rabbitmq is ignored; inherited RABBITMQ_* variables (the 3.10
# broker's, say) are dropped.
while read -r v; do unset "$v"; done < <(compgen -e | grep '^RABBITMQ_' || true)
export RABBITMQ_NODENAME=$NODE
export RABBITMQ_CONFIG_FILE="$IN/rabbitmq.conf"
export RABBITMQ_ADVANCED_CONFIG_FILE="$IN/advanced.config"
export RABBITMQ_CONF_ENV_FILE="$IN/rabbitmq-env.conf"
export RABBITMQ_ENABLED_PLUGINS_FILE="$IN/enabled_plugins"
export RABBITMQ_MNESIA_BASE="$IN/mnesia"
export RABBITMQ_LOG_BASE="$IN/log"
export RABBITMQ_PID_FILE="$IN/rabbitmq.pid"
export RABBITMQ_NODE_IP_ADDRESS=$HOST
export RABBITMQ_NODE_PORT=$PORT
export RABBITMQ_DIST_PORT=$DIST_PORT
export RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS="-kernel inet_dist_use_interface {127,0,0,1}"
# Without these the CLI tools' own distribution listener binds 0.0.0.0:35672.
export RABBITMQ_CTL_ERL_ARGS="-kernel inet_dist_use_interface {127,0,0,1}"
export RABBITMQ_CTL_DIST_PORT_MIN=$CTL_PORT_MIN
export RABBITMQ_CTL_DIST_PORT_MAX=$((CTL_PORT_MIN + 19))
export ERL_EPMD_ADDRESS=$HOST
export ERL_EPMD_PORT=$EPMD_PORT
# The Erlang cookie lives in $HOME; keep ours private to this node.
export HOME="$IN/home"
export PATH=/usr/sbin:/usr/bin:/sbin:/bin
export LANG=C.UTF-8 LC_ALL=C.UTF-8

# IN_ROOT CMD ARGS...: run CMD in the root, in a mount namespace of its
# own with /proc and $STATE (at $IN) mounted. The mounts exist only in
# that namespace and go with its last process: none is ever left on the
# host, whatever happens. unshare, sh and chroot exec, so the PID is CMD's.
# shellcheck disable=SC2016 # $0, $1, $2 are sh's, not ours
IN_ROOT=(unshare --mount --propagation private
  sh -c 'mount -t proc proc "$0/proc" && mount --bind "$1" "$0$2" && shift 2 && exec chroot "$0" "$@"'
  "$ROOT" "$STATE" "$IN")

# in_root_of PID: PID runs in our root (a process of another root, or of
# the host, is not ours, whatever its command line). A root deleted under
# running processes reads "ROOT (deleted)": still ours, to be stopped.
in_root_of() {
  local r
  [ -n "${1:-}" ] && r=$(readlink "/proc/$1/root" 2>/dev/null) || return 1
  [ "$r" = "$ROOT" ] || [ "$r" = "$ROOT (deleted)" ]
}
is_wrapper() { pid_alive "${1:-}" && in_root_of "$1" && cmdline_has "$1" "$RMQ_BIN/rabbitmq-server"; }
is_beam() { pid_alive "${1:-}" && in_root_of "$1" && cmdline_has "$1" "beam.smp" "-s rabbit boot "; }
is_epmd() { pid_alive "${1:-}" && in_root_of "$1" && cmdline_has "$1" "epmd -address $HOST -port $EPMD_PORT"; }

# root_pids: the PIDs of every process in our root (one find, not a fork
# per process of the machine).
root_pids() {
  local glob
  glob=$(printf '%s' "$ROOT" | sed 's/[][*?\\]/\\&/g')   # -lname takes a pattern
  find /proc/[0-9]*/root -maxdepth 0 \( -lname "$glob" -o -lname "$glob (deleted)" \) 2>/dev/null | cut -d/ -f3
}

# find_in_root PIDFILE IS: find_pid, looking only at the processes in our
# root when the PID file is lost or stale.
find_in_root() {
  local pidfile=$1 is=$2 pid="" p
  [ -f "$pidfile" ] && pid=$(tr -dc '0-9' <"$pidfile" 2>/dev/null || true)
  if "$is" "$pid"; then echo "$pid"; return 0; fi
  for p in $(root_pids); do
    if "$is" "$p"; then echo "$p"; return 0; fi
  done
  return 0
}

wrapper_pid() { find_in_root "$WRAPPER_PIDFILE" is_wrapper; }
beam_pid() { find_in_root "$BEAM_PIDFILE" is_beam; }
epmd_pid() { find_in_root "$EPMD_PIDFILE" is_epmd; }

ctl() {
  [ -f "$READY" ] || die "RabbitMQ 4 is not installed in $ROOT: run $0 install (or start)"
  mkdir -p "$STATE"
  "${IN_ROOT[@]}" "$RMQ_BIN/rabbitmqctl" -n "$NODE" "$@"
}

with_lock() { take_lock "$RDIR/.lock" 600; }

need_root() {
  [ "$(id -u)" = 0 ] || die "needs root: the broker runs chrooted in $ROOT, with /proc mounted"
}

# node_alive: the wrapper or the Erlang VM runs.
node_alive() { [ -n "$(wrapper_pid)$(beam_pid)" ]; }

# remove_tree DIR: rm -rf DIR, unless something is mounted under it (then
# rm would reach into the mounted tree): dies instead.
remove_tree() {
  local dir=$1 m
  [ -e "$dir" ] || return 0
  while read -r _ m _; do
    m=$(printf '%b' "$m")   # /proc/self/mounts escapes spaces as \040
    if [ "$m" = "$dir" ] || [[ "$m" == "$dir"/* ]]; then
      die "$m is mounted; not deleting $dir"
    fi
  done </proc/self/mounts
  rm -rf --one-file-system "$dir"
}

# write_hosts DIR: an /etc/hosts for DIR (debootstrap's minbase has none,
# and the node name's host, localhost, must resolve).
write_hosts() {
  printf '127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n' >"$1/etc/hosts"
}

# build_root DIR: debootstrap trixie into DIR and install rabbitmq-server
# in it, without starting anything; then trim it.
build_root() {
  local dir=$1 t0=$SECONDS
  command -v debootstrap >/dev/null || bash "$SCRIPT_DIR/prereqs.sh" rabbitmq4
  command -v debootstrap >/dev/null || die "debootstrap still missing after install"
  log "making a Debian $SUITE root in $dir with debootstrap (about 75 s; log: $RDIR/install.log)"
  # In a namespace of its own: the /proc and /sys debootstrap mounts in the
  # root vanish with it even if it fails.
  timeout 1200 unshare --mount --propagation private \
    debootstrap --variant=minbase "$SUITE" "$dir" "$MIRROR" </dev/null >"$RDIR/install.log" 2>&1 \
    || fail_with_log "debootstrap $SUITE failed" "$RDIR/install.log" 20
  # No service may start from a package's postinst (rabbitmq-server's
  # would take the default ports).
  printf '#!/bin/sh\nexit 101\n' >"$dir/usr/sbin/policy-rc.d"
  chmod 755 "$dir/usr/sbin/policy-rc.d"
  write_hosts "$dir"
  mkdir -p "$dir$IN"
  log "installing rabbitmq-server in the root"
  # shellcheck disable=SC2016 # $0 is sh's
  timeout 900 unshare --mount --propagation private sh -c '
      mount -t proc proc "$0/proc" &&
      DEBIAN_FRONTEND=noninteractive chroot "$0" sh -c "apt-get update -q && apt-get install -y -q --no-install-recommends rabbitmq-server && apt-get clean"' \
    "$dir" </dev/null >>"$RDIR/install.log" 2>&1 \
    || fail_with_log "apt-get install rabbitmq-server in the root failed" "$RDIR/install.log" 20
  rm -rf "${dir:?}"/var/lib/apt/lists/* "$dir"/usr/share/doc/* "$dir"/usr/share/man/* \
    "$dir"/usr/share/locale/* "$dir"/usr/share/info/*
  local v erl
  # shellcheck disable=SC2016 # ${Version} is dpkg-query's
  v=$(chroot "$dir" dpkg-query -W -f='${Version}' rabbitmq-server)
  # shellcheck disable=SC2016
  erl=$(chroot "$dir" dpkg-query -W -f='${Version}' erlang-base)
  [[ "$v" == 4.* ]] || die "the $SUITE root has rabbitmq-server $v, not 4.x"
  printf 'suite=%s\nrabbitmq-server=%s\nerlang-base=%s\n' "$SUITE" "$v" "$erl" >"$dir/.amqpsub-root"
  log "root ready in $((SECONDS - t0))s: rabbitmq-server $v, erlang-base $erl, $(du -sh "$dir" | cut -f1)"
}

# ensure_root: a finished root in $ROOT, restored from $TARBALL or built
# (then cached as $TARBALL). Called with the lock held.
ensure_root() {
  local t0=$SECONDS tmp="$ROOT.new"
  if [ ! -f "$READY" ]; then
    need_root
    remove_tree "$tmp"
    remove_tree "$ROOT"   # an unfinished one
    mkdir -p "$tmp"
    if [ -s "$TARBALL" ]; then
      log "restoring the root from $TARBALL"
      if ! tar -xzf "$TARBALL" -C "$tmp" || [ ! -f "$tmp/.amqpsub-root" ]; then
        # A damaged cache must not block every later start: set it aside
        # and build the root anew.
        log "$TARBALL is damaged or holds no finished root; moving it to $TARBALL.bad and building the root anew"
        mv -f "$TARBALL" "$TARBALL.bad"
        remove_tree "$tmp"
        mkdir -p "$tmp"
        build_root "$tmp"
      fi
    else
      build_root "$tmp"
    fi
    mv "$tmp" "$ROOT"
    log "root in $ROOT after $((SECONDS - t0))s"
  fi
  if [ ! -s "$TARBALL" ]; then
    log "caching the root as $TARBALL"
    tar -czf "$TARBALL.tmp" --one-file-system -C "$ROOT" . && mv -f "$TARBALL.tmp" "$TARBALL"
  fi
  [ -f "$ROOT/etc/hosts" ] || write_hosts "$ROOT"
  mkdir -p "$ROOT$IN"
}

write_config() {
  mkdir -p "$STATE/home" "$STATE/log" "$STATE/mnesia"
  : >"$STATE/rabbitmq-env.conf"
  : >"$STATE/enabled_plugins"   # AMQP 1.0 is built in since 4.0; no plugin needed
  cat >"$STATE/rabbitmq.conf" <<EOF
# Generated by integration/rabbitmq4.sh; edits are overwritten on start.
listeners.tcp.1 = $HOST:$PORT
distribution.listener.interface = $HOST
distribution.listener.port_range.min = $DIST_PORT
distribution.listener.port_range.max = $DIST_PORT
# guest/guest, allowed from loopback only (the default).
default_user = guest
default_pass = guest
loopback_users.guest = true
log.file.level = info
log.console = false
disk_free_limit.absolute = 50MB
EOF
}

# ensure_epmd: our epmd on 127.0.0.1:$EPMD_PORT. Started here because one
# that rabbitmqctl or the node starts binds 0.0.0.0.
ensure_epmd() {
  if [ -n "$(epmd_pid)" ]; then return 0; fi
  rm -f "$EPMD_PIDFILE"
  if port_open "$HOST" "$EPMD_PORT"; then
    log "using the epmd already listening on $HOST:$EPMD_PORT (not ours; stop will leave it)"
    return 0
  fi
  start_bg "$EPMD_PIDFILE" "$STATE/log/epmd.log" "${IN_ROOT[@]}" epmd -address "$HOST" -port "$EPMD_PORT"
  wait_port "$HOST" "$EPMD_PORT" 10 "pid_alive $BG_PID" || die "epmd did not start (see $STATE/log/epmd.log)"
}

fail_start() {
  log "$1; last lines of the logs:"
  tail -n 30 "$CONSOLE_LOG" >&2 2>/dev/null || true
  tail -n 30 "$STATE/log/$NODE.log" >&2 2>/dev/null || true
  exit 1
}

cmd_install() {
  need_root
  with_lock
  ensure_root
  log "installed: $(tr '\n' ' ' <"$READY")in $ROOT"
}

cmd_start() {
  need_root
  with_lock
  local w b
  w=$(wrapper_pid); b=$(beam_pid)
  if [ -z "$w$b" ] && port_open "$HOST" "$PORT"; then
    die "$HOST:$PORT already accepts connections, but not from this node ($RDIR)"
  fi
  if [ -z "$w$b" ]; then
    local t0=$SECONDS
    ensure_root
    write_config
    ensure_epmd
    rm -f "$BEAM_PIDFILE"
    [ -f "$CONSOLE_LOG" ] && mv -f "$CONSOLE_LOG" "$CONSOLE_LOG.1"
    # The wrapper runs the Erlang VM as its child and turns SIGTERM into a
    # clean stop; RabbitMQ writes the VM's PID to $BEAM_PIDFILE.
    start_bg -C "$STATE" "$WRAPPER_PIDFILE" "$CONSOLE_LOG" "${IN_ROOT[@]}" "$RMQ_BIN/rabbitmq-server"
    w=$BG_PID
    log "starting node $NODE (wrapper pid $w)"
  else
    [ -z "$w" ] || echo "$w" >"$WRAPPER_PIDFILE"   # found without (or despite) the PID files
    [ -z "$b" ] || echo "$b" >"$BEAM_PIDFILE"
    log "already running (wrapper pid ${w:-?}, vm pid ${b:-?})"
  fi
  await_rabbit "$STATE/log"
}

# leftovers: PIDs of processes still running in our root (after the VM and
# epmd stopped: a stuck rabbitmqctl, say).
leftovers() {
  local p
  for p in $(root_pids); do
    pid_alive "$p" && echo "$p"
  done
  return 0
}

cmd_stop() {
  need_root
  with_lock
  local w b e p t0=$SECONDS
  w=$(wrapper_pid); b=$(beam_pid)
  if [ -n "$b" ]; then
    log "stopping node $NODE (vm pid $b)"
    stop_pid "$b" "$STOP_TIMEOUT" "vm pid" || die "vm pid $b survived SIGKILL"
  elif [ -n "$w" ]; then
    kill -TERM "$w" 2>/dev/null || true
  fi
  if [ -n "$w" ] && ! wait_gone "$w" 10; then
    kill -KILL "$w" 2>/dev/null || true
  fi
  rm -f "$BEAM_PIDFILE" "$WRAPPER_PIDFILE"
  e=$(epmd_pid)
  if [ -n "$e" ]; then
    stop_pid "$e" 5 "epmd pid" || die "epmd pid $e survived SIGKILL"
    log "stopped epmd (pid $e)"
  fi
  rm -f "$EPMD_PIDFILE"
  for p in $(leftovers); do
    log "stopping pid $p, left in $ROOT: $(tr '\0' ' ' <"/proc/$p/cmdline" 2>/dev/null | cut -c1-80)"
    stop_pid "$p" 5 || log "pid $p survived SIGKILL"
  done
  if [ -n "$w$b" ]; then log "stopped in $((SECONDS - t0))s"; else log "not running"; fi
  return 0
}

cmd_status() {
  local b
  b=$(beam_pid)
  if [ -z "$b$(wrapper_pid)" ]; then echo "stopped"; return 3; fi
  if ! port_open "$HOST" "$PORT"; then
    echo "starting-or-unhealthy ($HOST:$PORT not accepting)"; return 1
  fi
  local out
  out=$(ctl status </dev/null 2>&1) || { echo "$out"; echo "unhealthy: rabbitmqctl status failed"; return 1; }
  grep -E '^(Node name|RabbitMQ version|Erlang configuration|Interface):' <<<"$out" || true
  echo "running vm pid $b amqp://guest:guest@$HOST:$PORT"
}

check_queue_name() {
  [ -n "${1:-}" ] || die "queue name required"
  [[ "$1" =~ ^[A-Za-z0-9._:-]+$ ]] || die "queue name must match [A-Za-z0-9._:-]+: $1"
}

# declare_expr NAME ARGS: an Erlang expression declaring the durable queue
# NAME with the argument table ARGS in vhost /, giving new or existing, or
# why not (also when an existing NAME has other arguments).
declare_expr() {
  cat <<EOF
Args = $2,
case rabbit_amqqueue:declare(rabbit_misc:r(<<"/">>, queue, <<"$1">>), true, false, Args, none, <<"amqpsub">>) of
  {new, _} -> new;
  {new, _, _} -> new;
  {existing, Q} ->
    try rabbit_amqqueue:assert_equivalence(Q, true, false, Args, none) of
      _ -> existing
    catch exit:E -> {not_equivalent, E}
    end;
  Other -> Other
end.
EOF
}

# eval_word WHAT EXPR WORD...: rabbitmqctl eval EXPR; prints its result and
# succeeds if that is one of WORD..., else dies with what it gave.
eval_word() {
  local what=$1 expr=$2 out w
  shift 2
  out=$(ctl -q eval "$expr" </dev/null 2>&1) || die "$what failed: $out"
  for w in "$@"; do
    if [ "$out" = "$w" ]; then echo "$out"; return 0; fi
  done
  die "$what failed: $out"
}

cmd_declare() {
  local q=${1:-} kind=${2:-} args
  check_queue_name "$q"
  check_queue_name "$q.dlq"
  args="[{<<\"x-dead-letter-exchange\">>, longstr, <<>>}, {<<\"x-dead-letter-routing-key\">>, longstr, <<\"$q.dlq\">>}"
  case "$kind" in
    classic) args+=", {<<\"x-queue-type\">>, longstr, <<\"classic\">>}" ;;
    quorum)
      args+=", {<<\"x-queue-type\">>, longstr, <<\"quorum\">>}"
      if [ -n "$DELIVERY_LIMIT" ]; then
        [[ "$DELIVERY_LIMIT" =~ ^-?[0-9]+$ ]] || die "AMQPSUB_RABBITMQ4_DELIVERY_LIMIT must be an integer: $DELIVERY_LIMIT"
        args+=", {<<\"x-delivery-limit\">>, long, $DELIVERY_LIMIT}"
      fi
      ;;
    *) die "declare $q: kind must be classic or quorum, not '${kind}'" ;;
  esac
  args+="]"
  eval_word "declare $q.dlq" "$(declare_expr "$q.dlq" "[{<<\"x-queue-type\">>, longstr, <<\"classic\">>}]")" new existing >/dev/null
  eval_word "declare $q ($kind)" "$(declare_expr "$q" "$args")" new existing
}

cmd_delete() {
  local q=${1:-} n
  check_queue_name "$q"
  for n in "$q" "$q.dlq"; do
    eval_word "delete $n" "case rabbit_amqqueue:lookup(rabbit_misc:r(<<\"/\">>, queue, <<\"$n\">>)) of
        {ok, Q} -> case rabbit_amqqueue:delete(Q, false, false, <<\"amqpsub\">>) of {ok, _} -> deleted; Err -> Err end;
        {error, not_found} -> absent
      end." deleted absent >/dev/null
  done
}

cmd_count() {
  local q=${1:-} out
  check_queue_name "$q"
  out=$(ctl -q eval "case rabbit_amqqueue:lookup(rabbit_misc:r(<<\"/\">>, queue, <<\"$q\">>)) of
      {ok, Q} -> proplists:get_value(messages_ready, rabbit_amqqueue:info(Q, [messages_ready]));
      {error, not_found} -> not_found
    end." </dev/null 2>&1) || die "count $q failed: $out"
  [[ "$out" =~ ^[0-9]+$ ]] || die "count $q failed: $out"
  echo "$out"
}

usage="usage: $0 install|start|stop|status|restart|reset|url|declare Q classic|quorum|delete Q|purge Q|count Q|list|ctl ARGS..."
case "${1:-}" in
  install) cmd_install ;;
  start)   cmd_start ;;
  stop)    cmd_stop ;;
  status)  cmd_status ;;
  restart) cmd_stop; cmd_start ;;
  reset)   cmd_stop; rm -rf "${STATE:?}/mnesia"; log "deleted $STATE/mnesia" ;;
  url)     echo "amqp://guest:guest@$HOST:$PORT" ;;
  declare) cmd_declare "${2:-}" "${3:-}" ;;
  delete)  cmd_delete "${2:-}" ;;
  purge)   check_queue_name "${2:-}"; ctl -q purge_queue "$2" </dev/null ;;
  count)   cmd_count "${2:-}" ;;
  list)    ctl -q list_queues name type messages_ready messages_unacknowledged consumers durable </dev/null ;;
  ctl)     shift; ctl "$@" ;;
  *) echo "$usage" >&2; exit 2 ;;
esac
