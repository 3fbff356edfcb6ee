#!/usr/bin/env bash
# Two multi-broker Artemis topologies for the cluster and HA tests,
# each node an instance run by integration/artemis.sh (same download, same
# `artemis create`, same stop-by-PID), on 127.0.0.1 with its own ports and
# directories under $AMQPSUB_CACHE (default ~/.cache/amqpsub).
#
#   artemis-cluster.sh cluster start|stop|status|reset
#   artemis-cluster.sh cluster start-node|stop-node|kill9|url|pid|log N   (N = 1 or 2)
#   artemis-cluster.sh cluster cli N ARGS...
#   artemis-cluster.sh ha start|stop|status|reset
#   artemis-cluster.sh ha start-node|stop-node|kill9|url|pid|log primary|backup
#   artemis-cluster.sh ha wait-live primary|backup [SECONDS]
#
# cluster: two nodes joined by a cluster connection over static connectors
#   (no multicast discovery), message-load-balancing ON_DEMAND,
#   redistribution-delay 0 on every address, and a clustered grouping
#   handler, LOCAL on node 1 and REMOTE on node 2.
#     node 1  AMQP 127.0.0.1:5721  CORE+AMQP 61721  instance artemis-cluster-1
#     node 2  AMQP 127.0.0.1:5722  CORE+AMQP 61722  instance artemis-cluster-2
#   `start` starts both (each waits for its AMQP port) and then waits until
#   each node's bridge to the other is connected (AMQ221027 in its log).
#
# ha: a primary/backup pair with shared-store HA: both nodes keep their
#   bindings, journal, paging and large messages in one directory,
#   artemis-ha-shared, and the backup takes over when it gets the journal's
#   file lock, i.e. when the primary's process is gone (kill -9).
#     primary AMQP 127.0.0.1:5711  CORE+AMQP 61711  instance artemis-ha-primary
#     backup  AMQP 127.0.0.1:5712  CORE+AMQP 61712  instance artemis-ha-backup
#   `start` starts the primary (waits for its AMQP port), then the backup,
#   which opens no port while it is passive: it is "started" when its process
#   runs and it has announced itself to the primary (AMQ221031 in its log).
#   `wait-live backup` waits until the backup's AMQP port accepts (after
#   `kill9 primary`) and prints how long that took. A clean stop of the
#   primary does not fail over (failover-on-shutdown false); `stop` stops
#   the backup first.
#
# Every node uses integration/artemis/broker.xml (queues, address settings,
# security, acceptors) with the additions above, written to
# $AMQPSUB_CACHE/artemis-cluster-conf/NODE.broker.xml on every start, and
# integration/artemis/login.config. Cluster connections authenticate with
# the cluster user below. Ports 5672/61616 (the shared test broker) and
# 5702/5703/61702 (the fault tests' broker) are never used here.
#
# start is idempotent (a running node is left alone); stop is SIGTERM, then
# SIGKILL after 30 s, by the PID of each node's java process; reset stops and
# deletes the data. status exits 0 when every node runs (the backup: its
# process), 3 when none does, 1 otherwise.
#
# Environment (besides what integration/artemis.sh reads):
#   AMQPSUB_CACHE               cache dir (default ~/.cache/amqpsub)
#   AMQPSUB_CLUSTER_JAVA_ARGS   JVM options of every node (default below: -Xmx512M, serial GC)
#   AMQPSUB_CLUSTER_TIMEOUT     seconds to wait for a cluster to form or a
#                               backup to announce itself (default 90)
set -euo pipefail

readonly HOST=127.0.0.1
SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
SCRIPT_NAME=artemis-cluster.sh
# shellcheck source-path=SCRIPTDIR source=lib.sh
. "$SCRIPT_DIR/lib.sh"
ARTEMIS_SH="$SCRIPT_DIR/artemis.sh"
SRC_XML="$SCRIPT_DIR/artemis/broker.xml"
CACHE=$(realpath -m "${AMQPSUB_CACHE:-${HOME:-/root}/.cache/amqpsub}")
CONF_DIR="$CACHE/artemis-cluster-conf"
SHARED="$CACHE/artemis-ha-shared"
FORM_TIMEOUT=${AMQPSUB_CLUSTER_TIMEOUT:-90}
# The cluster connections log in with these (Artemis checks them itself, not
# through JAAS). Test values, like the amqpsub/amqpsub user.
readonly CLUSTER_USER=amqpsub-cluster
readonly CLUSTER_PASSWORD=amqpsub-cluster-secret
# Grouping handler: how long a node waits for the LOCAL handler's decision
# on a new group before it asks again (Artemis: default 5000 ms; after 11
# unanswered tries it routes the message without grouping). 1 s keeps the
# test of a dead LOCAL node short; on 127.0.0.1 a decision takes
# milliseconds.
readonly GROUPING_TIMEOUT_MS=1000

usage() {
  cat >&2 <<'EOF'
usage: artemis-cluster.sh cluster start|stop|status|reset
       artemis-cluster.sh cluster start-node|stop-node|kill9|url|pid|log 1|2
       artemis-cluster.sh cluster cli 1|2 ARGS...
       artemis-cluster.sh ha start|stop|status|reset
       artemis-cluster.sh ha start-node|stop-node|kill9|url|pid|log primary|backup
       artemis-cluster.sh ha wait-live primary|backup [SECONDS]
EOF
  exit 2
}

# ---- the nodes --------------------------------------------------------------
# A node is c1, c2 (cluster) or primary, backup (ha).

node_name() { # TOPOLOGY ARG -> node
  case "$1:${2:-}" in
    cluster:1) echo c1 ;; cluster:2) echo c2 ;;
    ha:primary) echo primary ;; ha:backup) echo backup ;;
    cluster:*) die "cluster node must be 1 or 2, not '${2:-}'" ;;
    ha:*) die "ha node must be primary or backup, not '${2:-}'" ;;
  esac
}
node_home() {
  case $1 in
    c1) echo "$CACHE/artemis-cluster-1" ;; c2) echo "$CACHE/artemis-cluster-2" ;;
    primary) echo "$CACHE/artemis-ha-primary" ;; backup) echo "$CACHE/artemis-ha-backup" ;;
  esac
}
node_port() { case $1 in c1) echo 5721 ;; c2) echo 5722 ;; primary) echo 5711 ;; backup) echo 5712 ;; esac; }
node_core() { case $1 in c1) echo 61721 ;; c2) echo 61722 ;; primary) echo 61711 ;; backup) echo 61712 ;; esac; }
node_peer() { case $1 in c1) echo c2 ;; c2) echo c1 ;; primary) echo backup ;; backup) echo primary ;; esac; }
node_label() { case $1 in c1) echo "node 1" ;; c2) echo "node 2" ;; *) echo "$1" ;; esac; }
topology_nodes() { case $1 in cluster) echo "c1 c2" ;; ha) echo "primary backup" ;; esac; }

java_args() {
  local home
  home=$(node_home "$1")
  # A quarter of the shared test broker's heap; the serial collector keeps
  # two or four JVMs from each running a set of GC threads on two cores.
  echo "${AMQPSUB_CLUSTER_JAVA_ARGS:--XX:AutoBoxCacheMax=20000 -XX:+UseSerialGC -Xms64M -Xmx512M -XX:+HeapDumpOnOutOfMemoryError -XX:HeapDumpPath=$home/log/oom_dump.hprof -Dlog4j2.disableJmx=true --add-opens java.base/jdk.internal.misc=ALL-UNNAMED}"
}

# art NODE CMD...: integration/artemis.sh for that node. fd 8 (our lock) is
# closed so that no broker inherits it.
art() {
  local node=$1 wait=port
  shift
  [ "$node" = backup ] && wait=process
  AMQPSUB_ARTEMIS_HOME=$(node_home "$node") \
  AMQPSUB_ARTEMIS_PORT=$(node_port "$node") \
  AMQPSUB_ARTEMIS_CORE_PORT=$(node_core "$node") \
  AMQPSUB_ARTEMIS_BROKER_XML="$CONF_DIR/$node.broker.xml" \
  AMQPSUB_ARTEMIS_JAVA_ARGS="$(java_args "$node")" \
  AMQPSUB_ARTEMIS_WAIT=$wait \
    bash "$ARTEMIS_SH" "$@" 8>&-
}

node_log() { echo "$(node_home "$1")/log/console.log"; }
node_running() { art "$1" pid >/dev/null 2>&1; }
node_open() { port_open "$HOST" "$(node_port "$1")"; }

# fd 8, not 9: artemis.sh takes its own lock on 9.
with_lock() { take_lock "$CACHE/.artemis-cluster.lock" 600 8; }

# ---- broker.xml ---------------------------------------------------------------

# additions NODE: the XML this node adds inside <core>.
additions() {
  local node=$1 peer
  peer=$(node_peer "$node")
  cat <<EOF
      <!-- ==== added by integration/artemis-cluster.sh for node $node ==== -->
      <cluster-user>$CLUSTER_USER</cluster-user>
      <cluster-password>$CLUSTER_PASSWORD</cluster-password>

      <connectors>
         <!-- This node as the others should reach it (sent to them in the
              cluster topology), and its peer: static discovery. -->
         <connector name="$node">tcp://$HOST:$(node_core "$node")</connector>
         <connector name="$peer">tcp://$HOST:$(node_core "$peer")</connector>
      </connectors>

      <cluster-connections>
         <cluster-connection name="amqpsub-$(topology_of "$node")">
            <connector-ref>$node</connector-ref>
            <retry-interval>500</retry-interval>
            <max-retry-interval>2000</max-retry-interval>
            <!-- -1: a node that dies is waited for forever; its queues'
                 bindings (and the groups bound to them) stay. -->
            <reconnect-attempts>-1</reconnect-attempts>
            <initial-connect-attempts>-1</initial-connect-attempts>
            <use-duplicate-detection>true</use-duplicate-detection>
            <message-load-balancing>ON_DEMAND</message-load-balancing>
            <max-hops>1</max-hops>
            <static-connectors>
               <connector-ref>$peer</connector-ref>
            </static-connectors>
         </cluster-connection>
      </cluster-connections>
EOF
  case $node in
    c1|c2)
      local type=REMOTE
      [ "$node" = c1 ] && type=LOCAL
      cat <<EOF

      <!-- Clustered message groups: node 1 decides which node's queue each
           group goes to (LOCAL), node 2 asks it (REMOTE). No group-timeout:
           a group stays bound until its queue's binding is removed. -->
      <grouping-handler name="amqpsub-grouping">
         <type>$type</type>
         <timeout>$GROUPING_TIMEOUT_MS</timeout>
      </grouping-handler>
EOF
      ;;
    primary)
      cat <<EOF

      <!-- Shared store: the journal in $SHARED is the pair's. A clean stop
           does not hand over to the backup; a crash does. -->
      <ha-policy>
         <shared-store>
            <primary>
               <failover-on-shutdown>false</failover-on-shutdown>
            </primary>
         </shared-store>
      </ha-policy>
EOF
      ;;
    backup)
      cat <<EOF

      <!-- Takes over when the primary's process is gone; hands back (and
           waits as a backup again) when the primary is started again. -->
      <ha-policy>
         <shared-store>
            <backup>
               <allow-failback>true</allow-failback>
               <restart-backup>true</restart-backup>
               <failover-on-shutdown>false</failover-on-shutdown>
            </backup>
         </shared-store>
      </ha-policy>
EOF
      ;;
  esac
  echo "      <!-- ==== end of the additions ==== -->"
}

topology_of() { case $1 in c1|c2) echo cluster ;; primary|backup) echo ha ;; esac; }

# write_xml NODE: integration/artemis/broker.xml with this node's additions,
# its own <name>, redistribution-delay 0 on `#` (cluster), and the shared
# data directories (ha). Fails if the source no longer has the lines it
# edits.
write_xml() {
  local node=$1 topo add out
  topo=$(topology_of "$node")
  mkdir -p "$CONF_DIR"
  add=$(additions "$node")
  out="$CONF_DIR/$node.broker.xml"
  ADD="$add" awk -v name="amqpsub-$node" -v topo="$topo" -v shared="$SHARED" -v src="$SRC_XML" '
    BEGIN { nname = ncore = nhash = ndirs = 0 }
    /<name>[^<]*<\/name>/ && !nname { sub(/<name>[^<]*<\/name>/, "<name>" name "</name>"); nname++ }
    /<\/core>/ { print ENVIRON["ADD"]; ncore++ }
    topo == "ha" && /<(paging|bindings|journal|large-messages)-directory>data\// {
      sub(/>data\//, ">" shared "/"); ndirs++
    }
    { print }
    /<address-setting match="#">/ {
      nhash++
      if (topo == "cluster") {
        print "            <!-- added by integration/artemis-cluster.sh: move messages at once to a node"
        print "                 whose queue has consumers when this one has none -->"
        print "            <redistribution-delay>0</redistribution-delay>"
      }
    }
    END {
      bad = ""
      if (nname != 1) bad = bad " <name>"
      if (ncore != 1) bad = bad " </core>"
      if (nhash != 1) bad = bad " <address-setting match=\"#\">"
      if (topo == "ha" && ndirs != 4) bad = bad " the four data/ directories"
      if (bad != "") { print "cannot derive from " src ": expected exactly one of:" bad > "/dev/stderr"; exit 1 }
    }' "$SRC_XML" >"$out.tmp" || { rm -f "$out.tmp"; die "writing $out failed"; }
  mv "$out.tmp" "$out"
}

# ---- waits ----------------------------------------------------------------------

# wait_log NODE CODE WHAT: until the node's console log (rotated on each
# start) has CODE; fails if the node dies or after FORM_TIMEOUT.
wait_log() {
  local node=$1 code=$2 what=$3 f rc=0
  f=$(node_log "$node")
  wait_for "$FORM_TIMEOUT" "node_running $node" grep -q "$code" "$f" 2>/dev/null || rc=$?
  [ "$rc" = 0 ] && return 0
  tail -n 40 "$f" >&2 || true
  [ "$rc" = 1 ] && die "$node died while waiting for $what"
  die "$node: no $what ($code in $f) within ${FORM_TIMEOUT}s"
}

# ---- commands -------------------------------------------------------------------

start_node() {
  local node=$1
  if node_running "$node"; then
    art "$node" start
    return 0
  fi
  write_xml "$node"
  [ "$(topology_of "$node")" = ha ] && mkdir -p "$SHARED"
  art "$node" start
}

# Bridges connect both ways; each node logs AMQ221027 once its own is up.
wait_formed() {
  local n
  for n in "$@"; do
    node_running "$(node_peer "$n")" || continue
    wait_log "$n" AMQ221027 "cluster bridge to $(node_peer "$n")"
  done
}

cluster_start() {
  local t0=$SECONDS
  start_node c1
  start_node c2
  wait_formed c1 c2
  log "cluster up: node 1 amqp://$HOST:5721, node 2 amqp://$HOST:5722, formed in $((SECONDS - t0))s"
}

ha_start() {
  local t0=$SECONDS
  start_node primary
  start_node backup
  # A backup that already took over is live; one that waits announces
  # itself to the primary through the cluster connection.
  if ! node_open backup; then
    wait_log backup AMQ221031 "backup announcement"
  fi
  log "ha pair up: primary amqp://$HOST:5711, backup (passive) amqp://$HOST:5712 in $((SECONDS - t0))s"
}

topology_stop() { # nodes in the order to stop them
  local n rc=0
  for n in "$@"; do
    art "$n" stop || rc=1
  done
  return $rc
}

topology_status() {
  local n running=0 total=0 st
  for n in "$@"; do
    total=$((total + 1))
    if st=$(art "$n" status 2>/dev/null); then
      running=$((running + 1))
    elif node_running "$n"; then
      running=$((running + 1))
      [ "$n" = backup ] && st="running pid $(art "$n" pid) passive (amqp://$HOST:$(node_port "$n") not open until it becomes active)"
    fi
    echo "$(node_label "$n"): $st"
  done
  [ "$running" = "$total" ] && return 0
  [ "$running" = 0 ] && return 3
  return 1
}

wait_live() {
  local node=$1 secs=${2:-60} port t0 rc=0
  # The time printed is the failover's: asked for often.
  local WAIT_POLL=0.05
  port=$(node_port "$node")
  t0=$EPOCHREALTIME
  wait_port "$HOST" "$port" "$secs" "node_running $node" || rc=$?
  [ "$rc" = 1 ] && die "$node is not running"
  [ "$rc" = 2 ] && die "$node did not accept on $HOST:$port within ${secs}s"
  awk -v a="$t0" -v b="$EPOCHREALTIME" -v n="$node" -v u="amqp://$HOST:$port" 'BEGIN { printf "%s live on %s after %.2fs of waiting\n", n, u, b - a }'
}

topo=${1:-}
cmd=${2:-}
[ -n "$topo" ] && [ -n "$cmd" ] || usage
case "$topo" in cluster|ha) ;; *) usage ;; esac
nodes=$(topology_nodes "$topo")

case "$cmd" in
  start)
    with_lock
    if [ "$topo" = cluster ]; then cluster_start; else ha_start; fi ;;
  stop)
    with_lock
    # shellcheck disable=SC2046
    if [ "$topo" = cluster ]; then topology_stop c2 c1; else topology_stop backup primary; fi ;;
  reset)
    with_lock
    if [ "$topo" = cluster ]; then
      art c2 reset; art c1 reset
    else
      art backup reset; art primary reset
      rm -rf "$SHARED"
      log "deleted $SHARED"
    fi ;;
  status)
    # shellcheck disable=SC2086
    topology_status $nodes ;;
  start-node)
    node=$(node_name "$topo" "${3:-}")
    with_lock
    start_node "$node"
    [ "$topo" = cluster ] && wait_formed "$node"
    if [ "$node" = backup ] && ! node_open backup && node_running primary; then
      wait_log backup AMQ221031 "backup announcement"
    fi ;;
  stop-node)
    node=$(node_name "$topo" "${3:-}")
    with_lock
    topology_stop "$node" ;;
  kill9)
    node=$(node_name "$topo" "${3:-}")
    with_lock
    art "$node" kill9 ;;
  url)
    node=$(node_name "$topo" "${3:-}")
    echo "amqp://$HOST:$(node_port "$node")" ;;
  pid)
    node=$(node_name "$topo" "${3:-}")
    art "$node" pid ;;
  log)
    node=$(node_name "$topo" "${3:-}")
    node_log "$node" ;;
  wait-live)
    node=$(node_name "$topo" "${3:-}")
    wait_live "$node" "${4:-60}" ;;
  cli)
    node=$(node_name "$topo" "${3:-}")
    shift 3
    art "$node" cli "$@" ;;
  *) usage ;;
esac
