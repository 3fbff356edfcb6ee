#!/usr/bin/python3
"""sbpeer: a scripted AMQP 1.0 peer that plays Azure Service Bus for tests.

Run it with Debian's /usr/bin/python3 (python3-qpid-proton 0.37):

    /usr/bin/python3 integration/sbpeer/peer.py [--port 5673]
        [--control-port 5674] [--key-name RootManageSharedAccessKey]
        [--key KEY] [--entities FILE.json] [--verbose]

It listens on 127.0.0.1 only: AMQP on --port, a JSON control API (HTTP) on
--control-port. README.md next to this file describes what it reproduces,
the control API and where it departs from the real service.

Threading: every piece of AMQP and broker state lives on the proton reactor
thread. HTTP control requests run on the http.server threads; each is handed
to the reactor through an EventInjector and the HTTP thread waits for the
reactor's answer. No lock protects broker state because only one thread
touches it.
"""

import argparse
import base64
import ctypes
import hashlib
import heapq
import hmac
import http.server
import itertools
import json
import logging
import os
import signal
import struct
import sys
import threading
import time
import urllib.parse
import uuid

from proton import (Array, Condition, Data, Delivery, Described, Endpoint,
                    Link, Message, Terminus, int32, symbol, timestamp, ulong,
                    UNDESCRIBED)
from proton.reactor import ApplicationEvent, Container, EventInjector

log = logging.getLogger("sbpeer")

# ---------------------------------------------------------------------------
# Wire constants: what the service and its clients send (sources in README.md)

SESSION_FILTER = symbol("com.microsoft:session-filter")
# The peer's own choice (no client or document found uses it), in the form
# of the 0x00000137... rule descriptors of Learn's request-response page.
# azservicebus sends 0x137000000C (a digit short); .NET sends the filter bare,
# with no descriptor (AmqpConnectionScope.cs). The peer matches the filter by
# its key and echoes the client's descriptor, or this one for a bare value
# (go-amqp reads every filter value as a described type).
SESSION_FILTER_CODE = ulong(0x000001370000000C)
LOCKED_UNTIL_UTC = symbol("com.microsoft:locked-until-utc")
TIMEOUT_PROP = symbol("com.microsoft:timeout")
X_LOCKED_UNTIL = symbol("x-opt-locked-until")
X_SEQUENCE = symbol("x-opt-sequence-number")
X_ENQUEUE_SEQUENCE = symbol("x-opt-enqueue-sequence-number")
X_ENQUEUED_TIME = symbol("x-opt-enqueued-time")
EPOCH_TICKS = 621355968000000000

COND_UNAUTHORIZED = "amqp:unauthorized-access"
COND_NOT_FOUND = "amqp:not-found"
COND_NOT_ALLOWED = "amqp:not-allowed"
COND_DETACH_FORCED = "amqp:link:detach-forced"
COND_DEAD_LETTER = "com.microsoft:dead-letter"
COND_LOCK_LOST = "com.microsoft:message-lock-lost"
COND_SESSION_LOCK_LOST = "com.microsoft:session-lock-lost"
COND_SESSION_CANNOT_BE_LOCKED = "com.microsoft:session-cannot-be-locked"
COND_TIMEOUT = "com.microsoft:timeout"

LOCK_LOST_TEXT = ("The lock supplied is invalid. Either the lock expired, or the "
                  "message has already been removed from the queue.")
SESSION_LOCK_LOST_TEXT = ("The session lock has expired on the MessageSession. "
                          "Accept a new MessageSession.")

DLQ_SUFFIX = "/$deadletterqueue"
MGMT_SUFFIX = "/$management"
SUBS_INFIX = "/subscriptions/"

SASTOKEN = "servicebus.windows.net:sastoken"
JWT_TYPES = ("jwt", "amqp:jwt")

# A batch made by azservicebus's MessageBatch is one transfer of format
# 0x80013700 whose data sections each hold an encoded message. Proton 0.37
# does not expose the message format, so a body whose data section starts
# with a message-section descriptor (0x00 0x53 0x70..0x78) is taken as a batch.
SECTION_CODES = set(range(0x70, 0x79))


def now_s():
    return time.time()


def now_ms():
    return int(time.time() * 1000)


def ticks(ms):
    """Unix milliseconds -> .NET ticks (100 ns since 0001-01-01)."""
    return ms * 10000 + EPOCH_TICKS


# ---------------------------------------------------------------------------
# Delivery tags. Proton 0.37's Python binding takes a str tag and puts its
# UTF-8 bytes on the wire, so it cannot send arbitrary bytes. pn_delivery()
# itself takes a (size, pointer) pair; calling it through ctypes gives real
# 16-byte binary tags (.NET GUID layout, as the service sends). If that is
# unavailable the peer falls back to 16 random 7-bit bytes (ASCII-safe).

class _PnBytes(ctypes.Structure):
    _fields_ = [("size", ctypes.c_size_t), ("start", ctypes.c_char_p)]


def _load_pn_delivery():
    try:
        lib = ctypes.CDLL("libqpid-proton-core.so.10")
        fn = lib.pn_delivery
        fn.restype = ctypes.c_void_p
        fn.argtypes = [ctypes.c_void_p, _PnBytes]
        return fn
    except (OSError, AttributeError):
        return None


_PN_DELIVERY = _load_pn_delivery()
TAG_MODE = "binary" if _PN_DELIVERY else "ascii7"


def new_tag():
    b = os.urandom(16)
    if TAG_MODE != "binary":
        b = bytes(x & 0x7F for x in b)
    return b


def make_delivery(link, tag):
    """Creates the link's next delivery with the 16 tag bytes."""
    if _PN_DELIVERY is not None:
        _PN_DELIVERY(int(link._impl), _PnBytes(len(tag), tag))
        return link.current
    return link.delivery(tag.decode("ascii"))


def lock_uuid(tag):
    """Delivery tag (.NET Guid layout) -> RFC 4122 UUID, as clients do.
    (A tag of another length, sent on purpose, is padded or cut to 16.)"""
    return uuid.UUID(bytes_le=bytes(tag).ljust(16, b"\0")[:16])


# ---------------------------------------------------------------------------
# Encoding a delivery. Proton's Message.encode costs more than the rest of a
# delivery together, so each stored message is encoded once ("bare": its
# properties, application properties, body and footer) and every delivery
# only writes a header and message-annotations section in front of it.

def _sym(name):
    b = name.encode("ascii")
    return b"\xa3" + bytes([len(b)]) + b


_ANN_KEYS = {str(k): _sym(str(k)) for k in (
    X_SEQUENCE, X_ENQUEUE_SEQUENCE, X_ENQUEUED_TIME, X_LOCKED_UNTIL)}
_OURS = set(_ANN_KEYS)
_LONG = struct.Struct(">Bq")


def _skip_header(raw):
    """Length of a leading header section (0x00 0x53 0x70 list) in raw."""
    if raw[:3] != b"\x00Sp":
        return 0
    c = raw[3]
    if c == 0x45:
        return 4
    if c == 0xC0:
        return 5 + raw[4]
    if c == 0xD0:
        return 8 + struct.unpack(">I", raw[4:8])[0]
    raise ValueError("unexpected header encoding 0x%02x" % c)


def prepare(m):
    """Caches m's bare encoding, header fields and foreign annotations."""
    pm = m.pm
    foreign = {k: v for k, v in (pm.annotations or {}).items() if str(k) not in _OURS}
    entries, count = b"", 0
    if foreign:
        d = Data()
        d.put_object({symbol(str(k)): v for k, v in foreign.items()})
        raw = d.encode()
        if raw[0] == 0xC1:
            count, entries = raw[2], raw[3:]
        else:
            count, entries = struct.unpack(">I", raw[5:9])[0], raw[9:]
    saved = (pm.annotations, pm.instructions, pm.delivery_count)
    pm.annotations, pm.instructions, pm.delivery_count = None, None, 0
    raw = pm.encode()
    pm.annotations, pm.instructions, pm.delivery_count = saved
    m.bare = raw[_skip_header(raw):]
    ttl = int(round((pm.ttl or 0) * 1000))
    m.hdr = (bool(pm.durable), int(pm.priority), ttl, bool(pm.first_acquirer))
    m.ann = (entries, count)


def prepare_raw(m, raw):
    """Like prepare(), from the bytes the sender sent: the bare message is
    what follows its header, delivery- and message-annotations sections.
    Returns False (nothing cached) when raw holds something unexpected."""
    pm = m.pm
    if pm.annotations and any(str(k) in _OURS for k in pm.annotations):
        return False
    off, n = 0, len(raw)
    entries, count = b"", 0
    try:
        while off + 4 <= n and raw[off] == 0 and raw[off + 1] == 0x53 and raw[off + 2] in (0x70, 0x71, 0x72):
            code, c = raw[off + 2], raw[off + 3]
            if c in (0x40, 0x45):
                ln = 1
            elif c in (0xC0, 0xC1):
                ln = 2 + raw[off + 4]
            elif c in (0xD0, 0xD1):
                ln = 5 + struct.unpack(">I", raw[off + 4:off + 8])[0]
            else:
                return False
            if code == 0x72 and c == 0xC1:
                count, entries = raw[off + 5], raw[off + 6:off + 3 + ln]
            elif code == 0x72 and c == 0xD1:
                count, entries = struct.unpack(">I", raw[off + 8:off + 12])[0], raw[off + 12:off + 3 + ln]
            off += 3 + ln
    except (IndexError, struct.error):
        return False
    if off >= n:
        return False
    m.bare = bytes(raw[off:])
    ttl = int(round((pm.ttl or 0) * 1000))
    m.hdr = (bool(pm.durable), int(pm.priority), ttl, bool(pm.first_acquirer))
    m.ann = (bytes(entries), count)
    return True


def encode_delivery(m, locked_until_ms, omit=()):
    if m.bare is None:
        prepare(m)
    durable, priority, ttl, first = m.hdr
    h = (b"\x41" if durable else b"\x42") + b"\x50" + bytes([priority & 0xFF]) + \
        (struct.pack(">BI", 0x70, ttl) if ttl else b"\x40") + \
        (b"\x41" if first else b"\x42") + struct.pack(">BI", 0x70, m.delivery_count)
    header = b"\x00\x53\x70\xc0" + bytes([len(h) + 1, 5]) + h
    fields = [(str(X_SEQUENCE), _LONG.pack(0x81, m.seq)),
              (str(X_ENQUEUE_SEQUENCE), _LONG.pack(0x81, m.seq)),
              (str(X_ENQUEUED_TIME), _LONG.pack(0x83, m.enqueued_ms))]
    if locked_until_ms is not None:
        fields.append((str(X_LOCKED_UNTIL), _LONG.pack(0x83, locked_until_ms)))
    body = b"".join(_ANN_KEYS[k] + v for k, v in fields if k not in omit)
    n = 2 * sum(1 for k, _ in fields if k not in omit)
    entries, count = m.ann
    body += entries
    n += count
    ann = b"\x00\x53\x72\xd1" + struct.pack(">II", len(body) + 4, n) + body
    return header + ann + m.bare


# ---------------------------------------------------------------------------
# Small helpers

def jsonable(v):
    if v is None or isinstance(v, (bool, int, float, str)):
        if isinstance(v, (symbol,)):
            return str(v)
        return v
    if isinstance(v, (bytes, bytearray, memoryview)):
        b = bytes(v)
        try:
            return b.decode("utf-8")
        except UnicodeDecodeError:
            return {"base64": base64.b64encode(b).decode()}
    if isinstance(v, uuid.UUID):
        return str(v)
    if isinstance(v, dict):
        return {str(k): jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [jsonable(x) for x in v]
    if isinstance(v, Array):
        return [jsonable(x) for x in v.elements]
    if isinstance(v, Described):
        return {"descriptor": jsonable(v.descriptor), "value": jsonable(v.value)}
    return str(v)


def data_object(d):
    """The first value in a proton Data (a terminus filter), or None."""
    if d is None:
        return None
    d.rewind()
    if d.next() is None:
        return None
    return d.get_object()


def elements(v):
    if v is None:
        return []
    if isinstance(v, Array):
        return list(v.elements)
    if isinstance(v, (list, tuple)):
        return list(v)
    return [v]


def aud_path(uri):
    """'amqp://host:port/Path/x' -> 'path/x' (lower case, no slashes around)."""
    s = uri.strip()
    i = s.find("://")
    if i >= 0:
        s = s[i + 3:]
        j = s.find("/")
        s = "" if j < 0 else s[j + 1:]
    return s.strip("/").lower()


def covers(claim_path, address):
    """A claim for a path covers that path and everything below it."""
    a = address.strip("/").lower()
    return claim_path == "" or a == claim_path or a.startswith(claim_path + "/")


def to_seconds(v):
    """The put-token 'expiration' property: string or number of Unix
    seconds, or a timestamp (ms)."""
    if v is None:
        return None
    if isinstance(v, timestamp):
        return int(v) / 1000.0
    if isinstance(v, (int, float)):
        return float(v)
    try:
        return float(str(v))
    except ValueError:
        return None


def jwt_exp(token):
    parts = token.split(".")
    if len(parts) != 3:
        return None
    try:
        pad = "=" * (-len(parts[1]) % 4)
        claims = json.loads(base64.urlsafe_b64decode(parts[1] + pad))
        exp = claims.get("exp")
        return float(exp) if exp is not None else None
    except (ValueError, TypeError, AttributeError):
        return None


# ---------------------------------------------------------------------------
# Timers: one heap, one proton task armed for its earliest entry.

class Timers(object):
    def __init__(self):
        self.heap = []
        self.seq = itertools.count()
        self.container = None
        self.armed = float("inf")

    def add(self, due, fn, *args):
        heapq.heappush(self.heap, (due, next(self.seq), fn, args))
        if due < self.armed - 0.0005 and self.container is not None:
            self._arm(due)

    def _arm(self, due):
        self.armed = due
        self.container.schedule(max(0.0, due - now_s()), self)

    def on_timer_task(self, event):
        self.armed = float("inf")
        t = now_s() + 0.0005
        while self.heap and self.heap[0][0] <= t:
            _, _, fn, args = heapq.heappop(self.heap)
            try:
                fn(*args)
            except Exception:  # a bug in one timer must not stop the peer
                log.exception("timer callback %s failed", fn.__name__)
        if self.heap:
            self._arm(self.heap[0][0])


# ---------------------------------------------------------------------------
# Broker model

class Msg(object):
    __slots__ = ("uid", "seq", "pm", "message_id", "session_id",
                 "delivery_count", "enqueued_ms", "state", "entity", "lock",
                 "bare", "hdr", "ann")

    def __init__(self, uid, seq, pm, enqueued_ms):
        self.uid = uid
        self.seq = seq
        self.pm = pm
        self.message_id = pm.id
        self.session_id = pm.group_id
        self.delivery_count = 0
        self.enqueued_ms = enqueued_ms
        self.state = "available"  # available | locked | deferred | gone
        self.entity = None
        self.lock = None
        self.bare = None  # see prepare(); None after pm changed
        self.hdr = None
        self.ann = None


class Lock(object):
    __slots__ = ("tag", "uuid", "msg", "ls", "locked_until", "state",
                 "session")

    def __init__(self, tag, msg, ls, locked_until, session):
        self.tag = tag
        self.uuid = lock_uuid(tag)
        self.msg = msg
        self.ls = ls
        self.locked_until = locked_until  # seconds since the epoch
        self.state = "held"  # held | settling | done | lost
        self.session = session


class SbSession(object):
    def __init__(self, sid, entity):
        self.sid = sid
        self.entity = entity
        self.heap = []
        self.locked_by = None  # LinkState
        self.lock_until = 0.0
        self.state = None  # bytes or None


class Entity(object):
    def __init__(self, name, kind, lock_ms, max_dc, requires_session):
        self.name = name
        self.key = name.lower()
        self.kind = kind  # queue | topic | subscription | dlq
        self.lock_ms = lock_ms
        self.max_dc = max_dc
        self.requires_session = requires_session
        self.heap = []
        self.sessions = {}
        self.deferred = {}
        self.receivers = []  # LinkStates delivering from this entity
        self.refuse_until = 0.0  # receiver attaches refused until then (POST /faults/detach refuse_attach_ms)
        self.waiters = []  # LinkStates waiting for a session
        self.subscriptions = []  # topics only
        self.parent = None  # subscription -> topic, dlq -> entity
        self.dlq = None
        self.next_seq = 1
        self.rr = 0
        self.stats = {"enqueued": 0, "delivered": 0, "completed": 0,
                      "abandoned": 0, "released": 0, "dead_lettered": 0,
                      "lock_expired": 0, "deferred": 0,
                      "update_disposition_requests": 0, "update_disposition_tokens": 0,
                      "disposition_faults": 0}
        # The connections that asked to attach a receiver, or the
        # $management pair, to this entity, less those that sent to it
        # (azservicebus's sender attaches a $management pair too): a test reads how many
        # connections a subscriber opened for it alone, while other tests
        # open theirs on the same peer.
        self.conn_ids = set()
        self.sender_conn_ids = set()  # connections that sent to it: a sender's own $management pair is not counted

    def available_count(self):
        return len(self.heap) + sum(len(s.heap) for s in self.sessions.values())

    def settings(self):
        return {"name": self.name, "kind": self.kind,
                "lock_duration_ms": self.lock_ms,
                "max_delivery_count": self.max_dc,
                "requires_session": self.requires_session}


class ConnState(object):
    def __init__(self, cid, conn, remote):
        self.cid = cid
        self.conn = conn
        self.remote = remote
        self.claims = {}  # path -> expiry (seconds)
        self.had_token = False
        self.links = set()
        self.closed = False
        self.opened = now_s()


GONE = ConnState(0, None, "")  # what a closed connection's state points to
GONE.closed = True


class LinkState(object):
    def __init__(self, lid, link, cs, session_key):
        self.lid = lid
        self.link = link
        self.cs = cs
        self.session_key = session_key
        self.name = link.name
        self.sending = link.is_sender  # we send (client receives)
        self.node = None  # cbs | mgmt | entity
        self.address = ""
        self.entity = None
        self.sb_session = None
        self.presettled = False
        self.locks = {}  # tag -> Lock, held (unsettled) deliveries we sent
        self.dlvs = {}  # tag -> Delivery we sent and have not settled
        self.closed = False
        self.opened = False
        self.pending = False  # waiting for a session
        self.filter_descriptor = SESSION_FILTER_CODE
        self.last_active = now_s()  # last transfer, flow or disposition (idle detach)


# ---------------------------------------------------------------------------

class ControlError(Exception):
    def __init__(self, status, text):
        Exception.__init__(self, text)
        self.status = status


class Peer(object):
    """The proton handler: AMQP events, timers and control requests."""

    def __init__(self, args):
        self.args = args
        self.container = None
        self.listening = False
        self.timers = Timers()
        self.injector = EventInjector()
        self.ids = itertools.count(1)
        self.uids = itertools.count(1)
        self.entities = {}
        self.locks = {}  # RFC uuid -> Lock (held or settling)
        self.conns = {}
        self.keys = {args.key_name: args.key}
        self.jwt_tokens = set()
        self.max_token_lifetime_s = None
        self.cbs_deadline_s = args.cbs_deadline
        self.require_claims = True
        self.session_timeout_ms = args.session_timeout_ms
        self.settle_delay_ms = 0
        self.conn_loss_locks = args.connection_loss_locks  # see conn_gone
        self.outstanding = 0  # link dispositions taken and not yet answered
        self.idle_ms = args.idle_detach_ms or 0
        self.idle_senders = False
        self.idle_gen = 0  # bumped when the idle setting changes: stale timers stop
        self.idle_since = now_s()
        self.renew_rules = []
        self.delivery_faults = []
        self.disposition_faults = {}  # entity key or "*" -> fault (POST /faults/disposition)
        self.counters = {}
        self.reset_counters()

    # -- plumbing --------------------------------------------------------

    def count(self, name, n=1):
        self.counters[name] = self.counters.get(name, 0) + n

    def reset_counters(self):
        self.counters = {k: 0 for k in (
            "connections_opened", "connections_closed",
            "connections_closed_no_token", "put_tokens", "put_token_ok",
            "put_token_failed", "links_attached", "links_refused",
            "links_detached_token_expired", "links_detached_forced",
            "messages_enqueued", "messages_sent", "deliveries",
            "redeliveries", "dispositions_accepted", "dispositions_modified",
            "dispositions_rejected", "dispositions_released",
            "dispositions_presettled", "completed", "abandoned", "released",
            "deferred", "dead_lettered", "dead_lettered_max_delivery",
            "lock_lost_answers", "lock_expirations",
            "redeliveries_lock_expired", "redeliveries_link_closed",
            "renew_lock_requests", "renew_lock_tokens",
            "renew_lock_failed_requests", "renew_lock_unanswered",
            "renew_session_lock_requests", "session_accepts",
            "session_accept_timeouts", "session_cannot_be_locked",
            "session_lock_lost", "get_session_state", "set_session_state",
            "update_disposition_requests", "peek_requests",
            "mgmt_requests", "settle_delayed", "faulty_deliveries",
            "locks_orphaned", "update_disposition_tokens",
            "update_disposition_lock_lost", "links_detached_idle",
            "associated_link_activity", "disposition_faults", "dispositions_after_detach",
            "locks_dropped_connection_lost")}
        # A high-water mark, not a sum: it restarts from what is in flight.
        self.counters["settlements_outstanding_max"] = self.outstanding

    def on_reactor_init(self, event):
        self.container = event.container
        self.timers.container = event.container
        event.container.selectable(self.injector)
        url = "%s:%d" % (self.args.host, self.args.port)
        event.container.listen(url)
        self.listening = True
        log.info("AMQP listening on %s (delivery tags: %s)", url, TAG_MODE)

    def on_sbstop(self, event):
        log.info("stopping")
        self.injector.close()
        self.container.stop()

    def on_sbctl(self, event):
        req = event.subject
        try:
            req.result = self.control(req.method, req.path, req.query, req.body)
            req.status = 200
        except ControlError as e:
            req.status, req.result = e.status, {"error": str(e)}
        except Exception as e:  # report bugs to the caller, keep running
            log.exception("control %s %s failed", req.method, req.path)
            req.status, req.result = 500, {"error": "%s: %s" % (type(e).__name__, e)}
        req.done.set()

    # -- connections and sessions ---------------------------------------

    def conn_state(self, conn):
        """The connection's state (a closed stand-in once it is gone).
        Proton keeps these attributes in the C object's record and the
        wrapper they hold keeps the C object alive: conn_gone and link_gone
        break that cycle, or every connection and link would leak."""
        cs = getattr(conn, "sbstate", None)
        if cs is None:
            cid = next(self.ids)
            remote = ""
            try:
                remote = str(conn.url) if conn.url else ""
            except AttributeError:
                pass
            cs = ConnState(cid, conn, remote)
            conn.sbstate = cs
            self.conns[cid] = cs
        return cs

    def on_connection_remote_open(self, event):
        conn = event.connection
        cs = self.conn_state(conn)
        if conn.state & Endpoint.LOCAL_UNINIT:
            conn.open()
        self.count("connections_opened")
        log.info("conn %d open from %s (container %s)", cs.cid, cs.remote,
                 conn.remote_container)
        if self.cbs_deadline_s and self.cbs_deadline_s > 0:
            self.timers.add(now_s() + self.cbs_deadline_s, self.cbs_deadline, cs)

    def cbs_deadline(self, cs):
        if cs.closed or cs.had_token:
            return
        log.info("conn %d: no token within %ss, closing", cs.cid, self.cbs_deadline_s)
        self.count("connections_closed_no_token")
        cs.conn.condition = Condition(
            COND_UNAUTHORIZED,
            "No CBS token was put within %s seconds of opening the connection."
            % self.cbs_deadline_s)
        cs.conn.close()
        self.conn_gone(cs)

    def on_connection_remote_close(self, event):
        conn = event.connection
        if not (conn.state & Endpoint.LOCAL_CLOSED):
            conn.close()
        self.conn_gone(self.conn_state(conn))

    def on_transport_closed(self, event):
        if event.connection is not None:
            self.conn_gone(self.conn_state(event.connection))

    def on_transport_error(self, event):
        cond = event.transport.condition
        if cond and "No protocol header" in (cond.description or ""):
            log.debug("transport error: %s: %s", cond.name, cond.description)
        elif cond:
            log.info("transport error: %s: %s", cond.name, cond.description)

    def conn_gone(self, cs):
        if cs.closed:
            return
        cs.closed = True
        self.count("connections_closed")
        if self.conn_loss_locks == "drop":
            self.drop_connection_locks(cs)
        for ls in list(cs.links):
            self.link_gone(ls)
        self.conns.pop(cs.cid, None)
        cs.conn.sbstate = GONE
        cs.conn = None
        log.info("conn %d closed", cs.cid)

    def drop_connection_locks(self, cs):
        """The reading "locks dropped" of a lost connection (POST /settings
        {"connection_loss_locks": "drop"}). Microsoft Learn, "Message
        transfers, locks, and settlement": "If the reason is a broken
        network connection, the lock is dropped since Service Bus doesn't
        support recovery of existing AMQP links on a different
        connection." Every lock the connection's receive links held (not
        a session's: those go with the session link anyway) is dropped at
        once and its message comes back, its delivery count raised; a
        renew-lock or update-disposition for it is answered 410.

        The other reading, "locks survive" (the default), keeps them until
        they expire, renewable and settleable from any connection: the
        JavaScript SDK settles such messages through $management after it
        "recovers from a broken link or connection" (azure-sdk-for-js PR
        8406), and a Service Bus engineer says lock renewals keep
        succeeding after a reconnect (azure-sdk-for-net #37676)."""
        touched = set()
        for ls in list(cs.links):
            if ls.node != "entity" or ls.sb_session is not None or not ls.sending:
                continue
            for lock in list(ls.locks.values()):
                if lock.state != "held":
                    continue
                self.drop_lock(lock)
                ls.locks.pop(lock.tag, None)
                self.count("locks_dropped_connection_lost")
                if lock.msg is not None and lock.msg.entity is not None:
                    touched.add(lock.msg.entity)
                    self.return_msg(lock.msg, True, "connection lost")
        for ent in touched:
            self.pump(ent)

    def on_session_remote_open(self, event):
        ssn = event.session
        if ssn.state & Endpoint.LOCAL_UNINIT:
            ssn.sbkey = next(self.ids)
            ssn.open()

    def on_session_remote_close(self, event):
        ssn = event.session
        if not (ssn.state & Endpoint.LOCAL_CLOSED):
            ssn.close()
        key = getattr(ssn, "sbkey", None)
        cs = self.conn_state(event.connection)
        for ls in list(cs.links):
            if ls.session_key == key:
                self.link_gone(ls)

    # -- links -----------------------------------------------------------

    def on_link_remote_open(self, event):
        link = event.link
        if not (link.state & Endpoint.LOCAL_UNINIT):
            return
        cs = self.conn_state(event.connection)
        if cs.closed:
            return
        ls = LinkState(next(self.ids), link, cs, getattr(link.session, "sbkey", None))
        link.sbstate = ls
        cs.links.add(ls)
        link.snd_settle_mode = link.remote_snd_settle_mode
        link.rcv_settle_mode = link.remote_rcv_settle_mode
        term = link.remote_source if link.is_sender else link.remote_target
        ls.address = term.address or ""
        addr = ls.address.strip("/")
        low = addr.lower()
        if link.is_sender:
            # The client receives: from $cbs, <entity>/$management or an entity.
            if low == "$cbs":
                ls.node = "cbs"
                return self.open_link(ls)
            if low.endswith(MGMT_SUFFIX):
                ent = self.entities.get(low[:-len(MGMT_SUFFIX)])
                if not self.authorized(cs, addr):
                    return self.refuse(ls, COND_UNAUTHORIZED, "Unauthorized access. 'Listen' claim(s) are required to perform this operation. Resource: '%s'." % addr)
                if ent is None:
                    return self.refuse(ls, COND_NOT_FOUND, "The messaging entity '%s' could not be found." % addr)
                ls.node, ls.entity = "mgmt", ent
                ent.conn_ids.add(cs.cid)
                return self.open_link(ls)
            ent = self.entities.get(low)
            if not self.authorized(cs, addr):
                return self.refuse(ls, COND_UNAUTHORIZED, "Unauthorized access. 'Listen' claim(s) are required to perform this operation. Resource: '%s'." % addr)
            if ent is None:
                return self.refuse(ls, COND_NOT_FOUND, "The messaging entity '%s' could not be found." % addr)
            if ent.kind == "topic":
                return self.refuse(ls, COND_NOT_ALLOWED, "Cannot receive from topic '%s'; receive from a subscription." % addr)
            ls.node, ls.entity = "entity", ent
            ent.conn_ids.add(cs.cid)  # a receiver's, even one waiting for a session
            ls.presettled = link.remote_snd_settle_mode == Link.SND_SETTLED
            return self.attach_receiver(ls)
        # The client sends: to $cbs, <entity>/$management or a queue/topic.
        if low == "$cbs":
            ls.node = "cbs"
        elif low.endswith(MGMT_SUFFIX):
            ent = self.entities.get(low[:-len(MGMT_SUFFIX)])
            if not self.authorized(cs, addr):
                return self.refuse(ls, COND_UNAUTHORIZED, "Unauthorized access. 'Send' claim(s) are required to perform this operation. Resource: '%s'." % addr)
            if ent is None:
                return self.refuse(ls, COND_NOT_FOUND, "The messaging entity '%s' could not be found." % addr)
            ls.node, ls.entity = "mgmt", ent
            ent.conn_ids.add(cs.cid)
        else:
            ent = self.entities.get(low)
            if not self.authorized(cs, addr):
                return self.refuse(ls, COND_UNAUTHORIZED, "Unauthorized access. 'Send' claim(s) are required to perform this operation. Resource: '%s'." % addr)
            if ent is None:
                return self.refuse(ls, COND_NOT_FOUND, "The messaging entity '%s' could not be found." % addr)
            if ent.kind not in ("queue", "topic"):
                return self.refuse(ls, COND_NOT_ALLOWED, "Cannot send to '%s'." % addr)
            ls.node, ls.entity = "entity", ent
            ent.sender_conn_ids.add(cs.cid)
        self.open_link(ls)
        link.flow(1000)

    def open_link(self, ls, source_filter=None, properties=None):
        link = ls.link
        if link.is_sender:
            link.source.copy(link.remote_source)
            if source_filter is not None:
                f = link.source.filter
                f.clear()
                f.put_object(source_filter)
            link.target.copy(link.remote_target)
        else:
            link.source.copy(link.remote_source)
            link.target.copy(link.remote_target)
        if properties:
            link.properties = properties
        if ls.node == "entity" and self.args.max_message_size:
            link.max_message_size = self.args.max_message_size
        link.open()
        ls.opened = True
        ls.last_active = now_s()
        self.arm_idle(ls)
        self.count("links_attached")
        log.debug("conn %d link %s %s %r attached", ls.cs.cid, ls.name,
                  "out" if ls.sending else "in", ls.address)

    def refuse(self, ls, cond, desc):
        """Attach with a null terminus, then detach with the error: the way
        a peer refuses a link (go-amqp returns the detach error)."""
        link = ls.link
        if link.is_sender:
            link.source.type = Terminus.UNSPECIFIED  # encoded as a null source
            link.target.copy(link.remote_target)
        else:
            link.source.copy(link.remote_source)
            link.target.type = Terminus.UNSPECIFIED
        link.open()
        link.condition = Condition(cond, desc)
        link.close()
        self.count("links_refused")
        log.info("conn %d link %s %r refused: %s", ls.cs.cid, ls.name, ls.address, cond)
        self.link_gone(ls)

    def detach(self, ls, cond, desc):
        if ls.closed:
            return
        link = ls.link
        if not (link.state & Endpoint.LOCAL_CLOSED):
            link.condition = Condition(cond, desc)
            link.close()
        log.info("conn %d link %s %r detached: %s", ls.cs.cid, ls.name, ls.address, cond)
        self.link_gone(ls)

    # -- idle detach ----------------------------------------------------------

    def idle_watched(self, ls):
        return self.idle_ms > 0 and ls.node == "entity" and ls.opened and \
            not ls.closed and (ls.sending or self.idle_senders)

    def arm_idle(self, ls):
        if self.idle_watched(ls):
            due = max(ls.last_active, self.idle_since) + self.idle_ms / 1000.0
            self.timers.add(due, self.idle_check, ls, self.idle_gen)

    def idle_check(self, ls, gen):
        if gen != self.idle_gen or not self.idle_watched(ls):
            return  # setting changed (a newer timer runs) or link gone
        due = max(ls.last_active, self.idle_since) + self.idle_ms / 1000.0
        if due > now_s() + 0.001:
            self.timers.add(due, self.idle_check, ls, gen)
            return
        self.count("links_detached_idle")
        secs = self.idle_ms / 1000.0
        self.detach(ls, COND_DETACH_FORCED,
                    # The service's text (Learn service-bus-amqp-troubleshoot;
                    # azure-sdk-for-python tests quote the consumer form).
                    "The link '%s' is force detached. Code: %s(link%d). Details: "
                    "%s.IdleTimerExpired: Idle timeout: %02d:%02d:%02d." %
                    (ls.name, "consumer" if ls.sending else "publisher", ls.lid,
                     "AmqpMessageConsumer" if ls.sending else "AmqpMessagePublisher",
                     int(secs // 3600), int(secs % 3600 // 60), int(secs % 60)))

    def set_idle(self, idle_ms, senders=None):
        self.idle_ms = max(0, int(idle_ms or 0))
        if senders is not None:
            self.idle_senders = bool(senders)
        self.idle_gen += 1
        self.idle_since = now_s()
        for cs in self.conns.values():
            for ls in cs.links:
                self.arm_idle(ls)

    @staticmethod
    def touch(ls):
        if ls is not None:
            ls.last_active = now_s()

    def on_link_remote_close(self, event):
        link = event.link
        ls = getattr(link, "sbstate", None)
        if not (link.state & Endpoint.LOCAL_CLOSED):
            link.close()
        if ls is not None:
            self.link_gone(ls)

    def link_gone(self, ls, lost=False):
        """The link is no longer usable: give back what it held."""
        if ls.closed:
            return
        ls.closed = True
        ls.cs.links.discard(ls)
        ent = ls.entity
        if ls.pending and ent is not None and ls in ent.waiters:
            ent.waiters.remove(ls)
        ls.pending = False
        if ent is not None and ls in ent.receivers:
            ent.receivers.remove(ls)
        sess = ls.sb_session
        touched = False
        if sess is None:
            # A non-session message lock belongs to the entity, not to the
            # link: it stays in self.locks until it expires or is settled
            # through $management (update-disposition) and can be renewed
            # from any connection. Its expiry timer is already armed.
            for lock in ls.locks.values():
                if lock.state in ("held", "settling"):
                    self.count("locks_orphaned")
        else:
            # A session message's lock is the session's: losing the session
            # link ends it. A session the client closed gives its messages
            # back without raising the count; an expired session lock
            # (lost=True) raises it.
            for lock in list(ls.locks.values()):
                if lock.state == "held":
                    self.drop_lock(lock)
                    self.count("redeliveries_link_closed")
                    self.return_msg(lock.msg, lost, "session link closed")
                    touched = True
        ls.locks.clear()
        for dlv in ls.dlvs.values():
            dlv.sblock = None  # break delivery record -> lock -> link state -> link
            dlv.sbgone = True  # see on_outcome
        ls.dlvs.clear()
        if sess is not None and sess.locked_by is ls:
            sess.locked_by = None
            self.maybe_drop_session(sess)
            touched = True
        ls.link.sbstate = None
        if touched and ent is not None:
            self.pump(ent)

    # -- authorization (CBS) --------------------------------------------

    def authorized(self, cs, address):
        if not self.require_claims:
            return True
        t = now_s()
        for path, exp in cs.claims.items():
            if exp > t and covers(path, address):
                return True
        return False

    def handle_cbs(self, ls, msg):
        props = msg.properties or {}
        op = props.get("operation")
        self.count("put_tokens")
        if op != "put-token":
            return self.reply(ls, msg, 400, "Unsupported CBS operation %r." % (op,), status_keys="cbs")
        ttype = str(props.get("type") or "")
        name = str(props.get("name") or "")
        token = msg.body
        if isinstance(token, bytes):
            token = token.decode("utf-8", "replace")
        token = str(token or "")
        t = now_s()
        if ttype == SASTOKEN:
            ok, why, exp = self.verify_sas(token, name, t)
        elif ttype in JWT_TYPES:
            if token in self.jwt_tokens:
                exp = jwt_exp(token) or to_seconds(props.get("expiration")) or (t + 3600)
                ok, why = exp > t, "The token has expired."
            else:
                ok, why, exp = False, "InvalidIssuer: the JWT is not one the peer was given.", 0
        else:
            ok, why, exp = False, "Unsupported token type %r." % ttype, 0
        if not ok:
            self.count("put_token_failed")
            log.info("conn %d put-token for %s refused: %s", ls.cs.cid, name, why)
            return self.reply(ls, msg, 401, why, status_keys="cbs")
        if self.max_token_lifetime_s is not None:
            exp = min(exp, t + self.max_token_lifetime_s)
        path = aud_path(name)
        cs = ls.cs
        cs.claims[path] = exp
        cs.had_token = True
        self.count("put_token_ok")
        log.info("conn %d put-token %s for %r ok, expires in %.1fs", cs.cid, ttype, path, exp - t)
        self.timers.add(exp, self.claim_expiry, cs, path)
        self.reply(ls, msg, 202, "Accepted", status_keys="cbs")

    def verify_sas(self, token, name, t):
        prefix = "SharedAccessSignature "
        if not token.startswith(prefix):
            return False, "The token is not a SharedAccessSignature.", 0
        fields = {}
        for part in token[len(prefix):].split("&"):
            k, _, v = part.partition("=")
            fields[k.strip().lower()] = v.strip()
        sr, sig, se, skn = (fields.get(k) for k in ("sr", "sig", "se", "skn"))
        if not (sr and sig and se and skn):
            return False, "The SharedAccessSignature lacks sr, sig, se or skn.", 0
        key = self.keys.get(urllib.parse.unquote(skn))
        if key is None:
            return False, "InvalidSignature: The token has an invalid signature (unknown key name).", 0
        mac = hmac.new(key.encode("utf-8"), (sr + "\n" + se).encode("utf-8"), hashlib.sha256)
        want = base64.b64encode(mac.digest()).decode()
        if not hmac.compare_digest(want, urllib.parse.unquote(sig)):
            return False, "InvalidSignature: The token has an invalid signature.", 0
        try:
            exp = float(se)
        except ValueError:
            return False, "The token's se is not a number.", 0
        if exp <= t:
            return False, "ExpiredToken: The token is expired.", 0
        if not covers(aud_path(urllib.parse.unquote(sr)), aud_path(name)):
            return False, "InvalidAudience: The token's audience does not cover %r." % name, 0
        return True, "", exp

    def claim_expiry(self, cs, path):
        if cs.closed:
            return
        exp = cs.claims.get(path)
        if exp is None or exp > now_s() + 0.001:
            return  # refreshed, or gone
        del cs.claims[path]
        log.info("conn %d token for %r expired", cs.cid, path)
        for ls in list(cs.links):
            if ls.node in ("entity", "mgmt") and not self.authorized(cs, ls.address):
                self.count("links_detached_token_expired")
                self.detach(ls, COND_UNAUTHORIZED,
                            "The token for '%s' has expired; the link is closed. Put a new token on $cbs before it expires." % ls.address)

    # -- request/response replies ---------------------------------------

    def reply(self, ls, req, code, desc, body=None, status_keys="mgmt", cond=None):
        if status_keys == "cbs":
            props = {"status-code": int32(code), "status-description": desc}
        else:
            props = {"statusCode": int32(code), "statusDescription": desc}
            if cond:
                props["errorCondition"] = symbol(cond)
        resp = Message(correlation_id=req.id, properties=props, body=body)
        reply_to = req.reply_to
        out = None
        for other in ls.cs.links:
            if other.sending and other.opened and not other.closed and \
                    other.link.target.address == reply_to:
                out = other
                break
        if out is None:
            log.info("conn %d: no link with target %r for a reply", ls.cs.cid, reply_to)
            return
        dlv = make_delivery(out.link, new_tag())
        out.link.stream(resp.encode())
        out.link.advance()
        dlv.settle()

    # -- incoming transfers ---------------------------------------------

    def on_delivery(self, event):
        dlv = event.delivery
        link = event.link
        self.touch(getattr(link, "sbstate", None))
        if link.is_sender:
            self.on_outcome(dlv)
            return
        if not dlv.readable or dlv.partial:
            return
        data = link.recv(dlv.pending)
        link.advance()
        ls = getattr(link, "sbstate", None)
        if ls is None or ls.closed:
            dlv.settle()
            return
        msg = Message()
        try:
            msg.decode(data)
        except Exception as e:
            dlv.local.condition = Condition("amqp:decode-error", str(e))
            dlv.update(Delivery.REJECTED)
            dlv.settle()
            return
        if link.credit < 500:
            link.flow(1000 - link.credit)
        if ls.node == "cbs":
            self.handle_cbs(ls, msg)
            outcome = Delivery.ACCEPTED
        elif ls.node == "mgmt":
            self.handle_mgmt(ls, msg)
            outcome = Delivery.ACCEPTED
        else:
            outcome, cond = self.enqueue_transfer(ls.entity, msg, data)
            if cond is not None:
                dlv.local.condition = cond
        if not dlv.settled:
            dlv.update(outcome)
        dlv.settle()

    def enqueue_transfer(self, ent, msg, raw):
        msgs = [(msg, raw)]
        body = msg.body
        if isinstance(body, bytes) and len(body) > 3 and body[0] == 0 and \
                body[1] == 0x53 and body[2] in SECTION_CODES:
            inner = self.split_batch(raw)
            if inner:
                msgs = inner
        if ent.requires_session or any(s.requires_session for s in ent.subscriptions):
            for m, _ in msgs:
                if not m.group_id:
                    if ent.requires_session:
                        return Delivery.REJECTED, Condition(
                            COND_NOT_ALLOWED,
                            "The SessionId was not set on a message, and it cannot be sent to the entity. Entities that have session support enabled can only receive messages that have the SessionId set to a valid value.")
        for m, r in msgs:
            self.enqueue(ent, m, raw=r)
        self.count("messages_sent", len(msgs))
        return Delivery.ACCEPTED, None

    @staticmethod
    def split_batch(raw):
        """Data sections of an azservicebus batch envelope, decoded."""
        out = []
        off = 0
        n = len(raw)
        while off < n:
            d = Data()
            used = d.decode(raw[off:])
            if used <= 0:
                return None
            d.rewind()
            if d.next() == Data.DESCRIBED:
                d.enter()
                d.next()
                code = d.get_object()
                d.next()
                if code == 0x75:
                    inner = Message()
                    raw_inner = d.get_binary()
                    try:
                        inner.decode(raw_inner)
                    except Exception:
                        return None
                    out.append((inner, raw_inner))
                d.exit()
            off += used
        return out

    # -- queues -----------------------------------------------------------

    def enqueue(self, ent, pm, pump=True, raw=None):
        t = now_ms()
        if ent.kind == "topic":
            seq = ent.next_seq
            ent.next_seq += 1
            for sub in ent.subscriptions:
                if sub.requires_session and not pm.group_id:
                    log.info("message %r without session id not copied to session subscription %s", pm.id, sub.name)
                    continue
                if raw is None:
                    raw = pm.encode()
                copy = Message()
                copy.decode(raw)
                sub.stats["enqueued"] += 1
                m = Msg(next(self.uids), seq, copy, t)
                prepare_raw(m, raw)
                self.put(sub, m, pump)
            ent.stats["enqueued"] += 1
            self.count("messages_enqueued")
            return
        seq = ent.next_seq
        ent.next_seq += 1
        ent.stats["enqueued"] += 1
        m = Msg(next(self.uids), seq, pm, t)
        if raw is not None:
            prepare_raw(m, raw)
        self.put(ent, m, pump)
        self.count("messages_enqueued")

    def put(self, ent, m, pump=True):
        """Makes m available on ent (first enqueue or return)."""
        m.entity = ent
        m.state = "available"
        m.lock = None
        if ent.requires_session:
            sid = m.session_id or ""
            sess = ent.sessions.get(sid)
            if sess is None:
                sess = ent.sessions[sid] = SbSession(sid, ent)
            heapq.heappush(sess.heap, (m.seq, m.uid, m))
        else:
            heapq.heappush(ent.heap, (m.seq, m.uid, m))
        if pump:
            self.pump(ent)

    def return_msg(self, m, bump, why):
        ent = m.entity
        m.lock = None
        if ent is None or m.state == "gone":
            return
        if bump:
            m.delivery_count += 1
            if ent.max_dc and ent.kind != "dlq" and m.delivery_count >= ent.max_dc:
                self.dead_letter(m, "MaxDeliveryCountExceeded",
                                 "Message could not be consumed after %d delivery attempts." % ent.max_dc,
                                 None, max_delivery=True)
                return
        self.put(ent, m, pump=False)

    def dead_letter(self, m, reason, desc, extra, max_delivery=False):
        ent = m.entity
        props = dict(m.pm.properties or {})
        if extra:
            for k, v in extra.items():
                props[str(k)] = v
        if reason is not None:
            props["DeadLetterReason"] = reason
        if desc is not None:
            props["DeadLetterErrorDescription"] = desc
        m.pm.properties = props
        m.bare = None
        ent.stats["dead_lettered"] += 1
        self.count("dead_lettered")
        if max_delivery:
            self.count("dead_lettered_max_delivery")
        if ent.dlq is None:  # dead-lettering a DLQ message: it stays
            self.put(ent, m, pump=False)
            return
        self.put(ent.dlq, m, pump=True)

    def drop_lock(self, lock):
        self.locks.pop(lock.uuid, None)
        if lock.state in ("held", "settling"):
            lock.state = "lost"

    # -- delivering ---------------------------------------------------------

    def attach_receiver(self, ls):
        ent = ls.entity
        link = ls.link
        if now_s() < ent.refuse_until:
            self.count("links_refused")
            return self.refuse(ls, COND_DETACH_FORCED, "The entity is refusing receivers for a while (sbpeer fault).")
        filt = data_object(link.remote_source.filter)
        sfilter = None
        if isinstance(filt, dict):
            for k, v in filt.items():
                if str(k) == str(SESSION_FILTER):
                    sfilter = v if isinstance(v, Described) else Described(SESSION_FILTER_CODE, v)
        if sfilter is None:
            if ent.requires_session:
                return self.refuse(ls, COND_NOT_ALLOWED,
                                   "It is not possible for an entity that requires sessions to create a non-sessionful message receiver. Entity: %s" % ent.name)
            self.open_link(ls)
            ent.receivers.append(ls)
            self.pump_link(ls)
            return
        if not ent.requires_session:
            return self.refuse(ls, COND_NOT_ALLOWED,
                               "It is not possible for an entity that does not require sessions to create a sessionful message receiver. Entity: %s" % ent.name)
        ls.filter_descriptor = sfilter.descriptor
        sid = sfilter.value
        if sid is not None:
            sid = str(sid)
            sess = ent.sessions.get(sid)
            if sess is not None and sess.locked_by is not None:
                self.count("session_cannot_be_locked")
                return self.refuse(ls, COND_SESSION_CANNOT_BE_LOCKED,
                                   "The requested session '%s' cannot be accepted. It may be locked by another receiver." % sid)
            if sess is None:
                sess = ent.sessions[sid] = SbSession(sid, ent)
            return self.grant_session(ls, sess)
        sess = self.next_session(ent)
        if sess is not None:
            return self.grant_session(ls, sess)
        props = link.remote_properties or {}
        timeout_ms = props.get(TIMEOUT_PROP)
        if timeout_ms is None:
            timeout_ms = self.session_timeout_ms
        ls.pending = True
        ent.waiters.append(ls)
        # Answer a little before the client's own deadline: 1 s early, at
        # most a tenth of the timeout. Inferred, unconfirmed: no source shows
        # the service answering early (README.md, "Where it departs").
        timeout_ms = int(timeout_ms)
        wait_ms = timeout_ms - min(1000, timeout_ms // 10)
        self.timers.add(now_s() + wait_ms / 1000.0, self.accept_timeout, ls, wait_ms)

    def next_session(self, ent):
        best = None
        for sess in ent.sessions.values():
            if sess.locked_by is None and sess.heap:
                if best is None or sess.heap[0][0] < best.heap[0][0]:
                    best = sess
        return best

    def accept_timeout(self, ls, timeout_ms):
        if not ls.pending or ls.closed:
            return
        ls.pending = False
        if ls in ls.entity.waiters:
            ls.entity.waiters.remove(ls)
        self.count("session_accept_timeouts")
        secs = timeout_ms / 1000.0
        self.refuse(ls, COND_TIMEOUT,
                    "The operation did not complete within the allotted timeout of %02d:%02d:%06.3f. No unlocked session with messages was available." %
                    (int(secs // 3600), int(secs % 3600 // 60), secs % 60))

    def serve_waiters(self, ent):
        while ent.waiters:
            sess = self.next_session(ent)
            if sess is None:
                return
            ls = ent.waiters.pop(0)
            ls.pending = False
            if ls.closed:
                continue
            self.grant_session(ls, sess)

    def grant_session(self, ls, sess):
        ent = ls.entity
        sess.locked_by = ls
        sess.lock_until = now_s() + ent.lock_ms / 1000.0
        ls.sb_session = sess
        desc = getattr(ls, "filter_descriptor", SESSION_FILTER_CODE)
        self.open_link(ls, source_filter={SESSION_FILTER: Described(desc, sess.sid)},
                       properties={LOCKED_UNTIL_UTC: ticks(int(sess.lock_until * 1000))})
        ent.receivers.append(ls)
        self.count("session_accepts")
        log.info("conn %d link %s locked session %r of %s", ls.cs.cid, ls.name, sess.sid, ent.name)
        self.timers.add(sess.lock_until, self.session_lock_check, sess, ls)
        self.pump_link(ls)

    def session_lock_check(self, sess, ls):
        if sess.locked_by is not ls or ls.closed:
            return
        if sess.lock_until > now_s() + 0.001:
            return  # renewed; a later timer checks again
        self.count("session_lock_lost")
        log.info("session %r of %s: lock expired", sess.sid, sess.entity.name)
        link = ls.link
        if not (link.state & Endpoint.LOCAL_CLOSED):
            link.condition = Condition(COND_SESSION_LOCK_LOST, SESSION_LOCK_LOST_TEXT)
            link.close()
        for lock in ls.locks.values():
            if lock.state == "held":
                self.count("lock_expirations")
        self.link_gone(ls, lost=True)

    def maybe_drop_session(self, sess):
        if sess.locked_by is None and not sess.heap and sess.state is None:
            sess.entity.sessions.pop(sess.sid, None)

    def on_link_flow(self, event):
        link = event.link
        if link.is_sender:
            ls = getattr(link, "sbstate", None)
            if ls is not None and not ls.closed and ls.node == "entity" and ls.opened:
                self.touch(ls)
                self.pump_link(ls)

    def pump_link(self, ls):
        ent = ls.entity
        link = ls.link
        if ls.sb_session is not None:
            heap = ls.sb_session.heap
            while heap and link.credit > 0:
                _, _, m = heapq.heappop(heap)
                self.deliver(ls, m)
        else:
            heap = ent.heap
            while heap and link.credit > 0:
                _, _, m = heapq.heappop(heap)
                self.deliver(ls, m)
        if link.drain_mode and link.credit > 0:
            link.drained()

    def pump(self, ent):
        """Hands available messages to the entity's receivers (round robin)."""
        if ent.requires_session:
            for ls in list(ent.receivers):
                if ls.sb_session is not None and not ls.closed:
                    self.pump_link(ls)
            self.serve_waiters(ent)
            return
        if not ent.heap:
            return
        active = [ls for ls in ent.receivers if not ls.closed and ls.link.credit > 0]
        if not active:
            return
        start = ent.rr % len(active)
        active = active[start:] + active[:start]
        ent.rr += 1
        heap = ent.heap
        while heap and active:
            for ls in list(active):
                if not heap:
                    break
                if ls.link.credit <= 0:
                    active.remove(ls)
                    continue
                _, _, m = heapq.heappop(heap)
                self.deliver(ls, m)
        for ls in ent.receivers:
            if ls.link.drain_mode and ls.link.credit > 0:
                ls.link.drained()

    def deliver(self, ls, m):
        ent = ls.entity
        link = ls.link
        t = now_s()
        sess = ls.sb_session
        if sess is not None:
            locked_until = sess.lock_until
        else:
            locked_until = t + ent.lock_ms / 1000.0
        tag = new_tag()
        omit = ()
        fault = self.delivery_fault(ent) if self.delivery_faults else None
        if fault is not None:
            omit = fault["omit"]
            if fault["tag_length"] is not None:
                tag = (tag * (fault["tag_length"] // 16 + 1))[:fault["tag_length"]]
        data = encode_delivery(m, None if ls.presettled else int(locked_until * 1000), omit)
        dlv = make_delivery(link, tag)
        link.stream(data)
        link.advance()
        ls.last_active = t
        self.count("deliveries")
        ent.stats["delivered"] += 1
        if m.delivery_count:
            self.count("redeliveries")
        if ls.presettled:  # receive-and-delete
            dlv.settle()
            m.state = "gone"
            return
        lock = Lock(tag, m, ls, locked_until, sess)
        dlv.sblock = lock
        ls.dlvs[tag] = dlv
        m.state = "locked"
        m.lock = lock
        ls.locks[tag] = lock
        self.locks[lock.uuid] = lock
        if sess is None:
            self.timers.add(locked_until, self.lock_check, lock)

    def delivery_fault(self, ent):
        for f in self.delivery_faults:
            if f["times"] > 0 and f["entity"] in (ent.key, "*"):
                f["times"] -= 1
                f["hits"] += 1
                self.count("faulty_deliveries")
                return f
        return None

    def lock_check(self, lock):
        if lock.state != "held" or lock.locked_until > now_s() + 0.001:
            return
        self.expire_lock(lock)

    def expire_lock(self, lock):
        """The lock ran out: the message goes back with its count raised."""
        self.drop_lock(lock)
        lock.ls.locks.pop(lock.tag, None)
        self.count("lock_expirations")
        self.count("redeliveries_lock_expired")
        ent = lock.msg.entity
        if ent is not None:
            ent.stats["lock_expired"] += 1
        self.return_msg(lock.msg, True, "lock expired")
        if ent is not None:
            self.pump(ent)

    # -- outcomes -------------------------------------------------------------

    @staticmethod
    def lock_live(lock):
        """A lock that may still be settled or renewed: held and unexpired;
        a session message's lock also needs its session still locked by the
        link that received it (the lock is the session's)."""
        t = now_s()
        if lock.state != "held":
            return False
        if lock.session is not None:
            return lock.session.locked_by is lock.ls and not lock.ls.closed and \
                lock.session.lock_until > t
        return lock.locked_until > t

    def on_outcome(self, dlv):
        lock = getattr(dlv, "sblock", None)
        if lock is None:
            if getattr(dlv, "sbgone", False):
                # A disposition the client sent on a link this peer had
                # already detached, read in the same pass as the detach:
                # dropped, never settled. Settling it here would go out
                # ahead of the detach (proton writes dispositions before
                # detaches) and tell the client its outcome was taken
                # when it was not: the message would come back at lock
                # expiry. The client hears of the detach and settles by
                # lock token instead, as it does after any detach.
                self.count("dispositions_after_detach")
                return
            if dlv.remote_state and not dlv.settled:
                dlv.settle()  # e.g. a reply, or a pre-settled delivery
            return
        state = dlv.remote_state
        if not state or lock.state in ("settling", "done", "answered"):
            return
        remote_settled = dlv.settled
        name = {Delivery.ACCEPTED: "accepted", Delivery.MODIFIED: "modified",
                Delivery.REJECTED: "rejected", Delivery.RELEASED: "released"}.get(state)
        if name is None:
            return
        if remote_settled:
            self.count("dispositions_presettled")
        self.count("dispositions_" + name)
        remote = dlv.remote
        valid = self.lock_live(lock)
        if not valid:
            if lock.state == "held":
                # The lock ran out before its timer said so: expire it now.
                if lock.session is None:
                    self.expire_lock(lock)
                else:
                    self.session_lock_check(lock.session, lock.ls)
            lock.state = "answered"
            if lock.ls.closed:
                return  # the session lock was lost: the link is gone
            self.count("lock_lost_answers")
            if remote_settled:
                self.settle_ours(dlv, lock)
                return
            self.answer(dlv, lock, Delivery.REJECTED, Condition(COND_LOCK_LOST, LOCK_LOST_TEXT))
            return
        if not remote_settled and self.disposition_fault_hit(lock):
            return
        lock.state = "settling"
        ann = remote.annotations
        info = None
        cond_name = None
        failed = undeliverable = False
        if state == Delivery.REJECTED and remote.condition is not None:
            cond_name = remote.condition.name
            info = remote.condition.info
        if state == Delivery.MODIFIED:
            failed, undeliverable = remote.failed, remote.undeliverable
        outcome = (state, cond_name, info, dict(ann) if ann else None, failed, undeliverable)
        reply = "settle" if remote_settled else "answer"
        if reply == "answer":
            # Counted until finish_outcome answers it: the most in flight at
            # once shows how many settlements the client keeps outstanding.
            self.outstanding += 1
            if self.outstanding > self.counters["settlements_outstanding_max"]:
                self.counters["settlements_outstanding_max"] = self.outstanding
        if self.settle_delay_ms > 0 and not remote_settled:
            self.count("settle_delayed")
            self.timers.add(now_s() + self.settle_delay_ms / 1000.0, self.finish_outcome, dlv, lock, outcome, reply)
        else:
            self.finish_outcome(dlv, lock, outcome, reply)

    def finish_outcome(self, dlv, lock, outcome, reply):
        """Applies a settlement; reply: 'answer' (send the settling
        disposition), 'settle' (the client settled already) or 'none'
        (settled through $management: the link delivery stays open)."""
        state, cond_name, info, ann, failed, undeliverable = outcome
        if reply == "answer":
            self.outstanding -= 1
        m = lock.msg
        ent = m.entity
        ls = lock.ls
        self.locks.pop(lock.uuid, None)
        ls.locks.pop(lock.tag, None)
        lock.state = "done"
        if m.state == "gone" or ent is None:
            pass
        elif state == Delivery.ACCEPTED:
            m.state = "gone"
            m.lock = None
            ent.stats["completed"] += 1
            self.count("completed")
        elif state == Delivery.MODIFIED and undeliverable:
            m.state = "deferred"
            m.lock = None
            self.apply_props(m, ann)
            ent.deferred[m.seq] = m
            ent.stats["deferred"] += 1
            self.count("deferred")
        elif state == Delivery.MODIFIED:
            self.apply_props(m, ann)
            ent.stats["abandoned"] += 1
            self.count("abandoned")
            self.return_msg(m, True, "abandoned")
        elif state == Delivery.RELEASED:
            ent.stats["released"] += 1
            self.count("released")
            self.return_msg(m, False, "released")
        else:  # rejected: dead-letter
            reason = desc = None
            extra = {}
            if isinstance(info, dict):
                for k, v in info.items():
                    k = str(k)
                    if k == "DeadLetterReason":
                        reason = v
                    elif k == "DeadLetterErrorDescription":
                        desc = v
                    else:
                        extra[k] = v
            elif cond_name and cond_name != COND_DEAD_LETTER:
                reason = cond_name
            m.lock = None
            self.dead_letter(m, reason, desc, extra)
        if reply == "answer" and not ls.closed:
            self.answer(dlv, lock, state, None)
        elif reply == "settle":
            self.settle_ours(dlv, lock)
        if ent is not None:
            self.pump(ent)
            if ent.requires_session and lock.session is not None:
                self.maybe_drop_session(lock.session)
        lock.msg = None  # settled: let the message go (its lock timer may be pending)

    # The answers POST /faults/disposition gives a link disposition in place
    # of applying it. Either ends the delivery on the link, as go-amqp takes
    # any disposition the peer sends (receiver.go: the in-flight settlement
    # is removed and the message marked settled, error or not), while the
    # message stays locked: it is settled only by lock token
    # (update-disposition) or comes back when its lock expires.
    # Conditions: com.microsoft:server-busy and com.microsoft:timeout, which
    # azservicebus retries (internal/errors.go: RecoveryKindNone for both;
    # isMicrosoftTimeoutError reads the service's timeout by that condition).
    DISPOSITION_FAULTS = {
        "server-busy": ("com.microsoft:server-busy",
                        "Injected by sbpeer: the request was terminated because the entity is being throttled."),
        "timeout": (COND_TIMEOUT, "Injected by sbpeer: the operation did not complete within the allotted timeout."),
    }

    def disposition_fault_hit(self, lock):
        """Answers the disposition of lock's delivery with the fault armed
        for its entity (or for any), if one is left; reports whether it did."""
        ent = lock.msg.entity if lock.msg is not None else None
        if ent is None:
            return False
        f = self.disposition_faults.get(ent.key)
        if f is None or f["remaining"] <= 0:
            f = self.disposition_faults.get("*")
        if f is None or f["remaining"] <= 0:
            return False
        dlv = lock.ls.dlvs.get(lock.tag)
        if dlv is None or lock.ls.closed:
            return False
        f["remaining"] -= 1
        f["hits"] += 1
        self.count("disposition_faults")
        ent.stats["disposition_faults"] += 1
        cond, text = self.DISPOSITION_FAULTS[f["mode"]]
        self.answer(dlv, lock, Delivery.REJECTED, Condition(cond, text))
        return True

    def disposition_fault_info(self, key):
        f = self.disposition_faults.get(key) or {"mode": None, "entity": key, "remaining": 0, "hits": 0}
        ent = self.entities.get(key)
        src = ent.stats if ent is not None else self.counters
        return dict(f, update_disposition_requests=src.get("update_disposition_requests", 0),
                    update_disposition_tokens=src.get("update_disposition_tokens", 0))

    @staticmethod
    def apply_props(m, ann):
        if ann:
            props = dict(m.pm.properties or {})
            for k, v in ann.items():
                props[str(k)] = v
            m.pm.properties = props
            m.bare = None

    def answer(self, dlv, lock, state, cond):
        if cond is not None:
            dlv.local.condition = cond
        dlv.update(state)
        self.settle_ours(dlv, lock)

    @staticmethod
    def settle_ours(dlv, lock):
        dlv.sblock = None
        lock.ls.dlvs.pop(lock.tag, None)
        dlv.settle()

    # -- $management ----------------------------------------------------------

    def handle_mgmt(self, ls, msg):
        props = msg.properties or {}
        op = str(props.get("operation") or "")
        body = msg.body if isinstance(msg.body, dict) else {}
        self.count("mgmt_requests")
        ent = ls.entity
        assoc = props.get("associated-link-name")
        if assoc is not None:
            # azservicebus sets it "so management link activity ... can
            # prevent it from idling out" (internal/mgmt.go): the named link
            # of this connection counts as active.
            for other in ls.cs.links:
                if other.node == "entity" and other.name == str(assoc) and not other.closed:
                    self.touch(other)
                    self.count("associated_link_activity")
                    break
        if op == "com.microsoft:renew-lock":
            return self.mgmt_renew_lock(ls, msg, ent, body)
        if op == "com.microsoft:renew-session-lock":
            self.count("renew_session_lock_requests")
            sess = self.locked_session(ent, body)
            if sess is None:
                return self.reply(ls, msg, 410, SESSION_LOCK_LOST_TEXT, cond=COND_SESSION_LOCK_LOST)
            sess.lock_until = now_s() + ent.lock_ms / 1000.0
            for lock in sess.locked_by.locks.values():
                lock.locked_until = sess.lock_until
            self.timers.add(sess.lock_until, self.session_lock_check, sess, sess.locked_by)
            return self.reply(ls, msg, 200, "OK", body={"expiration": timestamp(int(sess.lock_until * 1000))})
        if op == "com.microsoft:get-session-state":
            self.count("get_session_state")
            sess = self.locked_session(ent, body)
            if sess is None:
                return self.reply(ls, msg, 410, SESSION_LOCK_LOST_TEXT, cond=COND_SESSION_LOCK_LOST)
            return self.reply(ls, msg, 200, "OK", body={"session-state": sess.state})
        if op == "com.microsoft:set-session-state":
            self.count("set_session_state")
            sess = self.locked_session(ent, body)
            if sess is None:
                return self.reply(ls, msg, 410, SESSION_LOCK_LOST_TEXT, cond=COND_SESSION_LOCK_LOST)
            st = body.get("session-state")
            sess.state = bytes(st) if st is not None else None
            return self.reply(ls, msg, 200, "OK", body={})
        if op == "com.microsoft:update-disposition":
            return self.mgmt_update_disposition(ls, msg, ent, body)
        if op == "com.microsoft:peek-message":
            return self.mgmt_peek(ls, msg, ent, body)
        return self.reply(ls, msg, 501, "sbpeer does not implement operation %r." % op,
                          cond="com.microsoft:not-implemented")

    def locked_session(self, ent, body):
        sid = body.get("session-id")
        sess = ent.sessions.get(str(sid)) if sid is not None else None
        if sess is None or sess.locked_by is None or sess.lock_until <= now_s():
            return None
        return sess

    def renew_fault(self, locks):
        for rule in self.renew_rules:
            if rule["times"] is not None and rule["times"] <= 0:
                continue
            hit = rule["all"]
            if not hit:
                for lock in locks:
                    if lock is None:
                        continue
                    if lock.msg.message_id is not None and str(lock.msg.message_id) in rule["message_ids"]:
                        hit = True
                    elif lock.msg.seq in rule["sequence_numbers"]:
                        hit = True
            if hit:
                if rule["times"] is not None:
                    rule["times"] -= 1
                rule["hits"] += 1
                return rule
        return None

    # How a renew-lock request of several tokens, one or more of them lost,
    # is answered (POST /faults/renew-batch). No official client sends more
    # than one token a request, so which the service does is unknown:
    #   reject-all-410  the whole request gets 410 (the default);
    #   reject-all-400  the whole request gets 400;
    #   partial-200     the live locks are renewed and the answer holds
    #                   their expirations only, fewer than the tokens.
    # A request of one lost token gets 410 in every mode.
    RENEW_BATCH_MODES = ("reject-all-410", "reject-all-400", "partial-200")

    def mgmt_renew_lock(self, ls, msg, ent, body):
        self.count("renew_lock_requests")
        tokens = elements(body.get("lock-tokens"))
        self.count("renew_lock_tokens_asked", len(tokens))
        locks = []
        for tok in tokens:
            if isinstance(tok, (bytes, bytearray)) and len(tok) == 16:
                tok = uuid.UUID(bytes=bytes(tok))
            locks.append(self.locks.get(tok) if isinstance(tok, uuid.UUID) else None)
        rule = self.renew_fault(locks)
        if rule is not None:
            self.count("renew_lock_failed_requests")
            if rule["mode"] == "timeout":
                self.count("renew_lock_unanswered")
                return
            if rule["mode"] == "lost":
                for lock in locks:
                    if lock is not None and lock.state == "held" and (
                            rule["all"] or str(lock.msg.message_id) in rule["message_ids"]
                            or lock.msg.seq in rule["sequence_numbers"]):
                        self.expire_lock(lock)
                return self.reply(ls, msg, 410, LOCK_LOST_TEXT, cond=COND_LOCK_LOST)
            return self.reply(ls, msg, rule["status"], rule.get("description") or "Injected failure.")
        t = now_s()
        live = []
        for lock in locks:
            # A lock is known only to the $management node of the entity it
            # came from, and a dead-letter queue is an entity of its own:
            # its locks are renewed and settled at
            # <entity>/$DeadLetterQueue/$management, and refused (410) at the
            # parent's node. Microsoft Learn, "AMQP 1.0 in Azure Service Bus:
            # request-response-based operations": every operation "is scoped
            # to an entity" and attaches to "<entity address>/$management";
            # azservicebus attaches a dead-letter receiver's node and claims
            # at its own path (receiver.go, internal/amqpLinks.go).
            if lock is None or lock.state != "held" or lock.locked_until <= t or \
                    lock.msg.entity is not ent:
                mode = getattr(self, "renew_batch_mode", "reject-all-410")
                if len(locks) > 1 and mode != "reject-all-410":
                    self.count("renew_lock_mixed_batches")
                    if mode == "reject-all-400":
                        self.count("renew_lock_failed_requests")
                        return self.reply(ls, msg, 400, "The request holds a lock token that is not valid.")
                    continue  # partial-200: left out of the answer
                self.count("renew_lock_failed_requests")
                return self.reply(ls, msg, 410, LOCK_LOST_TEXT, cond=COND_LOCK_LOST)
            if lock.session is not None:
                self.count("renew_lock_failed_requests")
                return self.reply(ls, msg, 400, "Message locks of session messages are renewed with the session lock (com.microsoft:renew-session-lock).")
            live.append(lock)
        exps = []
        for lock in live:
            lock.locked_until = t + ent.lock_ms / 1000.0
            self.timers.add(lock.locked_until, self.lock_check, lock)
            exps.append(timestamp(int(lock.locked_until * 1000)))
        self.count("renew_lock_tokens", len(live))
        self.reply(ls, msg, 200, "OK", body={"expirations": Array(UNDESCRIBED, Data.TIMESTAMP, *exps)})

    def mgmt_update_disposition(self, ls, msg, ent, body):
        """com.microsoft:update-disposition: what azservicebus sends when a
        settlement on the receive link fails with a link error
        (messageSettler.go, internal/mgmt.go SettleOnMgmtLink):
        disposition-status completed | abandoned | suspended | defered,
        lock-tokens (array of uuid), optional deadletter-reason,
        deadletter-description, properties-to-modify; .NET adds session-id
        for session messages. Every token must name a live lock of this
        entity (a dead-letter queue's locks are its own node's: see
        mgmt_renew_lock), else 410 for the whole request."""
        self.count("update_disposition_requests")
        ent.stats["update_disposition_requests"] += 1
        status = str(body.get("disposition-status") or "")
        if status not in ("completed", "abandoned", "suspended", "defered", "deferred"):
            return self.reply(ls, msg, 400, "Unknown disposition-status %r." % status,
                              cond="amqp:invalid-field")
        tokens = elements(body.get("lock-tokens"))
        if not tokens:
            return self.reply(ls, msg, 400, "lock-tokens is missing or empty.",
                              cond="amqp:invalid-field")
        sid = body.get("session-id")
        locks = []
        for tok in tokens:
            if isinstance(tok, (bytes, bytearray)) and len(tok) == 16:
                tok = uuid.UUID(bytes=bytes(tok))
            lock = self.locks.get(tok) if isinstance(tok, uuid.UUID) else None
            if lock is None or not self.lock_live(lock) or lock.msg.entity is not ent or \
                    (sid is not None and (lock.session is None or lock.session.sid != str(sid))):
                self.count("update_disposition_lock_lost")
                return self.reply(ls, msg, 410, LOCK_LOST_TEXT, cond=COND_LOCK_LOST)
            locks.append(lock)
        props = body.get("properties-to-modify")
        if status == "completed":
            outcome = (Delivery.ACCEPTED, None, None, None, False, False)
        elif status == "abandoned":
            outcome = (Delivery.MODIFIED, None, None, props, False, False)
        elif status in ("defered", "deferred"):
            outcome = (Delivery.MODIFIED, None, None, props, False, True)
        else:  # suspended: dead-letter
            info = dict(props or {})
            if body.get("deadletter-reason") is not None:
                info["DeadLetterReason"] = body.get("deadletter-reason")
            if body.get("deadletter-description") is not None:
                info["DeadLetterErrorDescription"] = body.get("deadletter-description")
            outcome = (Delivery.REJECTED, COND_DEAD_LETTER, info, None, False, False)
        for lock in locks:
            # If its receive link is still up, the delivery there stays
            # unsettled; a later disposition on it is answered lock-lost.
            self.finish_outcome(None, lock, outcome, "none")
            lock.state = "lost"
        self.count("update_disposition_tokens", len(locks))
        ent.stats["update_disposition_tokens"] += len(locks)
        self.reply(ls, msg, 200, "OK", body={})

    def mgmt_peek(self, ls, msg, ent, body):
        self.count("peek_requests")
        start = int(body.get("from-sequence-number") or 0)
        count = int(body.get("message-count") or 1)
        msgs = sorted((m for m in self.all_messages(ent) if m.seq >= start), key=lambda m: m.seq)[:count]
        if not msgs:
            return self.reply(ls, msg, 204, "No Content")
        out = []
        for m in msgs:
            pm = m.pm
            ann = dict(pm.annotations or {})
            ann[X_SEQUENCE] = m.seq
            ann[X_ENQUEUED_TIME] = timestamp(m.enqueued_ms)
            pm.annotations = ann
            pm.delivery_count = m.delivery_count
            out.append({"message": pm.encode()})
        self.reply(ls, msg, 200, "OK", body={"messages": out})

    # -- control API (runs on the reactor thread) -----------------------------

    def locked_count(self, ent):
        return sum(1 for lock in self.locks.values() if lock.msg.entity is ent)

    def all_messages(self, ent):
        out = [e[2] for e in ent.heap]
        for s in ent.sessions.values():
            out.extend(e[2] for e in s.heap)
        for lock in self.locks.values():
            if lock.msg.entity is ent and lock.state in ("held", "settling"):
                out.append(lock.msg)
        out.extend(ent.deferred.values())
        return out

    def entity(self, name):
        if not name:
            raise ControlError(400, "name is required")
        ent = self.entities.get(str(name).strip("/").lower())
        if ent is None:
            raise ControlError(404, "no entity %r" % name)
        return ent

    def create_entity(self, spec):
        name = str(spec.get("name") or "").strip("/")
        if not name:
            raise ControlError(400, "name is required")
        low = name.lower()
        if low.endswith(DLQ_SUFFIX) or low.endswith(MGMT_SUFFIX) or low == "$cbs":
            raise ControlError(400, "%r is not an entity name one can create" % name)
        kind = spec.get("kind")
        if SUBS_INFIX in low:
            topic_name = name[:low.index(SUBS_INFIX)]
            kind = "subscription"
        elif kind is None:
            kind = "queue"
        if kind not in ("queue", "topic", "subscription"):
            raise ControlError(400, "kind must be queue, topic or subscription")
        lock_ms = int(spec.get("lock_duration_ms", 60000))
        max_dc = int(spec.get("max_delivery_count", 10))
        rs = bool(spec.get("requires_session", False))
        if lock_ms <= 0 or max_dc < 1:
            raise ControlError(400, "lock_duration_ms must be > 0 and max_delivery_count >= 1")
        ent = self.entities.get(low)
        if ent is not None:
            if ent.kind != kind:
                raise ControlError(409, "%r exists as a %s" % (name, ent.kind))
            if spec.get("reset"):
                self.purge(ent)
            ent.lock_ms, ent.max_dc = lock_ms, max_dc
            if ent.requires_session != rs:
                if ent.available_count() or self.locked_count(ent) or ent.receivers:
                    raise ControlError(409, "cannot change requires_session of %r while it has messages or receivers" % name)
                ent.requires_session = rs
            if ent.dlq is not None:
                ent.dlq.lock_ms = lock_ms
            return ent
        if kind == "subscription":
            topic = self.entities.get(topic_name.lower())
            if topic is None:
                topic = self.create_entity({"name": topic_name, "kind": "topic"})
            if topic.kind != "topic":
                raise ControlError(409, "%r is not a topic" % topic_name)
        ent = Entity(name, kind, lock_ms, max_dc, rs)
        self.entities[low] = ent
        if kind == "subscription":
            ent.parent = topic
            topic.subscriptions.append(ent)
        if kind != "topic":
            dlq = Entity(name + "/$DeadLetterQueue", "dlq", lock_ms, max_dc, False)
            dlq.parent = ent
            ent.dlq = dlq
            self.entities[dlq.key] = dlq
        log.info("entity %s (%s) lock %d ms, max delivery %d, sessions %s",
                 name, kind, lock_ms, max_dc, rs)
        return ent

    def purge(self, ent):
        for lock in list(self.locks.values()):
            if lock.msg.entity is ent:
                self.drop_lock(lock)
                lock.msg.state = "gone"
                lock.ls.locks.pop(lock.tag, None)
        for e in ent.heap:
            e[2].state = "gone"
        ent.heap = []
        for sid, sess in list(ent.sessions.items()):
            for e in sess.heap:
                e[2].state = "gone"
            sess.heap = []
            sess.state = None
            if sess.locked_by is None:
                del ent.sessions[sid]
        ent.deferred = {}

    def delete_entity(self, ent):
        for sub in list(ent.subscriptions):
            self.delete_entity(sub)
        for cs in list(self.conns.values()):
            for ls in list(cs.links):
                if ls.entity is ent or (ent.dlq is not None and ls.entity is ent.dlq):
                    self.detach(ls, COND_NOT_FOUND, "The messaging entity '%s' was deleted." % ent.name)
        self.purge(ent)
        if ent.dlq is not None:
            self.purge(ent.dlq)
            self.entities.pop(ent.dlq.key, None)
        if ent.parent is not None and ent in ent.parent.subscriptions:
            ent.parent.subscriptions.remove(ent)
        self.entities.pop(ent.key, None)

    def entity_info(self, ent):
        info = ent.settings()
        info.update({"available": ent.available_count(), "locked": self.locked_count(ent),
                     "deferred": len(ent.deferred), "receivers": len(ent.receivers),
                     "waiting_session_receivers": len(ent.waiters),
                     "next_sequence_number": ent.next_seq,
                     "stats": dict(ent.stats, connections=len(ent.conn_ids - ent.sender_conn_ids))})
        if ent.requires_session:
            info["sessions"] = {
                s.sid: {"available": len(s.heap), "locked": s.locked_by is not None,
                        "locked_until_ms": int(s.lock_until * 1000) if s.locked_by else None,
                        "state_len": None if s.state is None else len(s.state)}
                for s in ent.sessions.values()}
        if ent.dlq is not None:
            info["dead_letter"] = ent.dlq.available_count() + self.locked_count(ent.dlq)
        if ent.kind == "topic":
            info["subscriptions"] = [s.name for s in ent.subscriptions]
        return info

    def msg_info(self, m):
        pm = m.pm
        body = pm.body
        info = {"sequence_number": m.seq, "message_id": jsonable(m.message_id),
                "session_id": m.session_id, "delivery_count": m.delivery_count,
                "state": m.state, "enqueued_time_ms": m.enqueued_ms,
                "application_properties": jsonable(pm.properties or {}),
                "body": jsonable(body)}
        if m.lock is not None and m.state == "locked":
            info["locked_until_ms"] = int(m.lock.locked_until * 1000)
            info["lock_token"] = str(m.lock.uuid)
        return info

    def new_rule(self, b):
        mode = b.get("mode", "lost")
        if mode not in ("lost", "timeout", "status"):
            raise ControlError(400, "mode must be lost, timeout or status")
        times = b.get("times")
        rule = {"id": next(self.ids), "all": bool(b.get("all", False)),
                "message_ids": set(str(x) for x in b.get("message_ids", [])),
                "sequence_numbers": set(int(x) for x in b.get("sequence_numbers", [])),
                "mode": mode, "status": int(b.get("status", 410 if mode == "lost" else 500)),
                "description": b.get("description"),
                "times": None if times is None else int(times), "hits": 0}
        if not (rule["all"] or rule["message_ids"] or rule["sequence_numbers"]):
            raise ControlError(400, "give all=true, message_ids or sequence_numbers")
        return rule

    def rule_info(self, r):
        return {"id": r["id"], "all": r["all"], "message_ids": sorted(r["message_ids"]),
                "sequence_numbers": sorted(r["sequence_numbers"]), "mode": r["mode"],
                "status": r["status"], "times": r["times"], "hits": r["hits"]}

    def control(self, method, path, q, b):
        if method == "GET" and path == "/health":
            return {"ok": True, "listening": self.listening, "tag_mode": TAG_MODE,
                    "amqp_port": self.args.port, "cpu_seconds": round(time.process_time(), 3),
                    "timers": len(self.timers.heap), "locks": len(self.locks),
                    "settlements_outstanding": self.outstanding,
                    "connections": len(self.conns)}
        if method == "GET" and path == "/counters":
            out = dict(self.counters)
            out["settlements_outstanding"] = self.outstanding  # a gauge
            return out
        if method == "POST" and path == "/counters/reset":
            self.reset_counters()
            return {"ok": True}
        if method == "GET" and path == "/entities":
            return {"entities": [self.entity_info(e) for e in self.entities.values()]}
        if method == "GET" and path == "/entity":
            return self.entity_info(self.entity(q.get("name")))
        if method == "POST" and path == "/entities":
            specs = b.get("entities") if isinstance(b.get("entities"), list) else [b]
            out = [self.entity_info(self.create_entity(s)) for s in specs]
            return out[0] if len(out) == 1 and "entities" not in b else {"entities": out}
        if method == "POST" and path == "/entities/delete":
            ent = self.entities.get(str(b.get("name") or "").strip("/").lower())
            if ent is not None:
                if ent.kind == "dlq":
                    raise ControlError(400, "delete the parent entity")
                self.delete_entity(ent)
            return {"ok": True, "existed": ent is not None}
        if method == "POST" and path == "/entities/purge":
            ent = self.entity(b.get("name"))
            self.purge(ent)
            if ent.dlq is not None and b.get("dlq", True):
                self.purge(ent.dlq)
            return self.entity_info(ent)
        if method == "GET" and path == "/messages":
            ent = self.entity(q.get("entity") or q.get("name"))
            limit = int(q.get("limit", 10000))
            msgs = sorted(self.all_messages(ent), key=lambda m: m.seq)
            return {"entity": ent.name, "count": len(msgs),
                    "messages": [self.msg_info(m) for m in msgs[:limit]]}
        if method == "POST" and path == "/messages":
            return self.control_send(b)
        if method == "GET" and path == "/auth":
            return self.auth_info()
        if method == "POST" and path == "/auth":
            return self.control_auth(b)
        if method == "GET" and path == "/settings":
            return self.settings_info()
        if method == "POST" and path == "/settings":
            if "settle_delay_ms" in b:
                self.settle_delay_ms = max(0, int(b["settle_delay_ms"]))
            if "session_timeout_ms" in b:
                self.session_timeout_ms = max(1, int(b["session_timeout_ms"]))
            if "idle_detach_ms" in b:
                self.set_idle(b["idle_detach_ms"], b.get("idle_detach_senders"))
            if "connection_loss_locks" in b:
                v = str(b["connection_loss_locks"])
                if v not in ("survive", "drop"):
                    raise ControlError(400, "connection_loss_locks: survive or drop")
                self.conn_loss_locks = v
            return self.settings_info()
        if method == "POST" and path == "/faults/idle-detach":
            self.set_idle(b.get("idle_ms"), b.get("senders"))
            return self.settings_info()
        if method == "POST" and path == "/faults/settle-delay":
            self.settle_delay_ms = max(0, int(b.get("ms", 0)))
            return self.settings_info()
        if method == "POST" and path == "/faults/renew":
            rule = self.new_rule(b)
            self.renew_rules.append(rule)
            return self.rule_info(rule)
        if method == "GET" and path == "/faults/renew":
            return {"rules": [self.rule_info(r) for r in self.renew_rules]}
        if method == "POST" and path == "/faults/renew/clear":
            self.renew_rules = []
            return {"ok": True}
        if method == "POST" and path == "/faults/renew-batch":
            mode = str(b.get("mode") or "reject-all-410")
            if mode not in self.RENEW_BATCH_MODES:
                raise ControlError(400, "mode must be one of %s" % ", ".join(self.RENEW_BATCH_MODES))
            self.renew_batch_mode = mode
            expired = 0
            ids = set(str(x) for x in b.get("expire_message_ids", []))
            for lock in list(self.locks.values()):
                if lock.state == "held" and lock.session is None and str(lock.msg.message_id) in ids:
                    self.expire_lock(lock)
                    expired += 1
            return {"mode": mode, "expired": expired}
        if method == "POST" and path == "/faults/delivery":
            tl = b.get("tag_length")
            f = {"id": next(self.ids),
                 "entity": "*" if b.get("entity") in (None, "*") else self.entity(b.get("entity")).key,
                 "tag_length": None if tl is None else int(tl),
                 "omit": [str(x) for x in b.get("omit_annotations", [])],
                 "times": int(b.get("times", 1)), "hits": 0}
            if f["tag_length"] is not None and not 0 <= f["tag_length"] <= 32:
                raise ControlError(400, "tag_length must be 0..32")
            self.delivery_faults.append(f)
            return f
        if method == "GET" and path == "/faults/delivery":
            return {"faults": self.delivery_faults}
        if method == "POST" and path == "/faults/delivery/clear":
            self.delivery_faults = []
            return {"ok": True}
        if method == "POST" and path == "/faults/disposition":
            mode = str(b.get("mode") or "server-busy")
            if mode not in self.DISPOSITION_FAULTS:
                raise ControlError(400, "mode must be one of %s" % ", ".join(sorted(self.DISPOSITION_FAULTS)))
            count = int(b.get("count", 1))
            if count < 0:
                raise ControlError(400, "count must be >= 0")
            key = "*" if b.get("entity") in (None, "*") else self.entity(b.get("entity")).key
            self.disposition_faults[key] = {"mode": mode, "entity": key, "remaining": count, "hits": 0}
            return self.disposition_fault_info(key)
        if method == "GET" and path == "/faults/disposition":
            key = "*" if q.get("entity") in (None, "*") else self.entity(q.get("entity")).key
            return self.disposition_fault_info(key)
        if method == "POST" and path == "/faults/disposition/clear":
            if b.get("entity") in (None, "*"):
                self.disposition_faults = {}
            else:
                self.disposition_faults.pop(self.entity(b.get("entity")).key, None)
            return {"ok": True}
        if method == "POST" and path == "/faults/detach":
            return self.control_detach(b)
        if method == "GET" and path == "/connections":
            return {"connections": [self.conn_info(cs) for cs in self.conns.values()]}
        if method == "POST" and path == "/reset":
            for ent in list(self.entities.values()):
                if ent.kind != "dlq" and ent.key in self.entities and ent.kind != "subscription":
                    self.delete_entity(ent)
            self.keys = {self.args.key_name: self.args.key}
            self.jwt_tokens = set()
            self.max_token_lifetime_s = None
            self.cbs_deadline_s = self.args.cbs_deadline
            self.require_claims = True
            self.session_timeout_ms = self.args.session_timeout_ms
            self.settle_delay_ms = 0
            self.conn_loss_locks = self.args.connection_loss_locks
            self.set_idle(self.args.idle_detach_ms, False)
            self.renew_rules = []
            self.renew_batch_mode = "reject-all-410"
            self.delivery_faults = []
            self.disposition_faults = {}
            self.reset_counters()
            return {"ok": True}
        raise ControlError(404, "no such endpoint: %s %s" % (method, path))

    def settings_info(self):
        return {"settle_delay_ms": self.settle_delay_ms,
                "idle_detach_ms": self.idle_ms,
                "idle_detach_senders": self.idle_senders,
                "session_timeout_ms": self.session_timeout_ms,
                "cbs_deadline_s": self.cbs_deadline_s,
                "max_token_lifetime_s": self.max_token_lifetime_s,
                "require_claims": self.require_claims,
                "connection_loss_locks": self.conn_loss_locks}

    def auth_info(self):
        return {"key_names": sorted(self.keys), "jwt_tokens": len(self.jwt_tokens),
                "max_token_lifetime_s": self.max_token_lifetime_s,
                "cbs_deadline_s": self.cbs_deadline_s,
                "require_claims": self.require_claims}

    def control_auth(self, b):
        if "keys" in b:
            keys = {str(k): str(v) for k, v in (b["keys"] or {}).items()}
            if b.get("replace_keys", False):
                self.keys = keys
            else:
                self.keys.update(keys)
        for k in b.get("remove_keys", []):
            self.keys.pop(str(k), None)
        if "jwt_tokens" in b:
            self.jwt_tokens = set(str(x) for x in (b["jwt_tokens"] or []))
        if "max_token_lifetime_s" in b:
            v = b["max_token_lifetime_s"]
            self.max_token_lifetime_s = None if v is None else float(v)
        if "cbs_deadline_s" in b:
            v = b["cbs_deadline_s"]
            self.cbs_deadline_s = None if v is None else float(v)
        if "require_claims" in b:
            self.require_claims = bool(b["require_claims"])
        return self.auth_info()

    def control_send(self, b):
        ent = self.entity(b.get("entity"))
        if ent.kind not in ("queue", "topic"):
            raise ControlError(400, "send to a queue or topic")
        msgs = list(b.get("messages") or [])
        n = int(b.get("count", 0))
        prefix = str(b.get("message_id_prefix", "m"))
        sessions = list(b.get("sessions") or [])
        per = {}
        for i in range(n):
            sid = sessions[i % len(sessions)] if sessions else None
            k = per.get(sid, 0)
            per[sid] = k + 1
            body = "%s/%d" % (sid, k) if sid is not None else "%d" % i
            msgs.append({"message_id": "%s-%d" % (prefix, i), "session_id": sid, "body": body,
                         "application_properties": dict(b.get("application_properties") or {}, seq=k)})
        for spec in msgs:
            body = spec.get("body", "")
            if isinstance(body, str):
                body = body.encode("utf-8")
            pm = Message(body=body, inferred=True)
            if spec.get("message_id") is not None:
                pm.id = str(spec["message_id"])
            if spec.get("session_id") is not None:
                pm.group_id = str(spec["session_id"])
            elif ent.requires_session:
                raise ControlError(400, "%s requires a session_id on each message" % ent.name)
            props = spec.get("application_properties")
            if props:
                pm.properties = {str(k): v for k, v in props.items()}
            self.enqueue(ent, pm, pump=False)
        if ent.kind == "topic":
            for sub in ent.subscriptions:
                self.pump(sub)
        else:
            self.pump(ent)
        return {"ok": True, "sent": len(msgs)}

    def control_detach(self, b):
        ent = self.entity(b.get("entity"))
        cond = str(b.get("condition") or COND_DETACH_FORCED)
        desc = str(b.get("description") or "Detached by the sbpeer control API.")
        senders = bool(b.get("senders", False))
        mgmt = bool(b.get("management", False))
        # Sessions: only the receiver link holding this session (waiting
        # accepts are left alone).
        sid = b.get("session_id")
        # Chosen first: a detached session link hands its session to a
        # waiting accept, which is not to be detached in the same request.
        chosen = []
        for cs in list(self.conns.values()):
            for ls in list(cs.links):
                if ls.entity is not ent or ls.closed:
                    continue
                if sid is not None and (ls.sb_session is None or ls.sb_session.sid != str(sid)):
                    continue
                if ls.node == "mgmt" and not mgmt:
                    continue
                if ls.node == "entity" and not ls.sending and not senders:
                    continue
                chosen.append(ls)
        if b.get("refuse_attach_ms"):
            # The receivers that attach again are refused for that long.
            ent.refuse_until = now_s() + float(b["refuse_attach_ms"]) / 1000.0
        if b.get("revoke_claims"):
            # As when the token expired or was revoked (the service then
            # detaches with amqp:unauthorized-access): the claims that cover
            # a chosen link go, so that attaching again on that connection
            # needs a new put-token first.
            for ls in chosen:
                for path in [p for p in ls.cs.claims if covers(p, ls.address)]:
                    del ls.cs.claims[path]
        n = 0
        for ls in chosen:
            if ls.closed:
                continue
            if ls.pending:
                ls.pending = False
                if ls in ent.waiters:
                    ent.waiters.remove(ls)
                self.refuse(ls, cond, desc)
            else:
                self.detach(ls, cond, desc)
            n += 1
        self.count("links_detached_forced", n)
        return {"ok": True, "detached": n}

    def conn_info(self, cs):
        t = now_s()
        return {"id": cs.cid, "remote": cs.remote,
                "claims": {p: round(e - t, 3) for p, e in cs.claims.items()},
                "links": [{"name": ls.name, "address": ls.address, "node": ls.node,
                           "role": "sender" if ls.sending else "receiver",
                           "credit": ls.link.credit, "unsettled": len(ls.locks),
                           "session_id": ls.sb_session.sid if ls.sb_session else None,
                           "session_filter_descriptor": descriptor_json(ls.filter_descriptor) if ls.sb_session else None,
                           "pending": ls.pending}
                          for ls in cs.links]}


def descriptor_json(d):
    """A session filter's descriptor as the client sent it: a number
    (ulong) or a string (symbol)."""
    return int(d) if isinstance(d, int) else str(d)


# ---------------------------------------------------------------------------
# HTTP control server

class CtlRequest(object):
    def __init__(self, method, path, query, body):
        self.method = method
        self.path = path
        self.query = query
        self.body = body
        self.done = threading.Event()
        self.status = 500
        self.result = None


def make_http_handler(peer):
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt, *a):
            log.debug("control: " + fmt, *a)

        def handle_any(self, method):
            u = urllib.parse.urlsplit(self.path)
            q = dict(urllib.parse.parse_qsl(u.query))
            body = {}
            n = int(self.headers.get("Content-Length") or 0)
            if n:
                raw = self.rfile.read(n)
                try:
                    body = json.loads(raw.decode("utf-8")) if raw.strip() else {}
                except ValueError as e:
                    return self.send(400, {"error": "bad JSON: %s" % e})
                if not isinstance(body, dict):
                    return self.send(400, {"error": "the body must be a JSON object"})
            req = CtlRequest(method, u.path.rstrip("/") or "/", q, body)
            peer.injector.trigger(ApplicationEvent("sbctl", subject=req))
            if not req.done.wait(30):
                return self.send(503, {"error": "the reactor did not answer within 30 s"})
            self.send(req.status, req.result)

        def send(self, status, obj):
            data = (json.dumps(obj, sort_keys=True) + "\n").encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            self.handle_any("GET")

        def do_POST(self):
            self.handle_any("POST")

    return Handler


class CtlServer(http.server.ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 64


def main():
    p = argparse.ArgumentParser(description="Service Bus-flavoured AMQP 1.0 test peer")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=5673)
    p.add_argument("--control-port", type=int, default=5674)
    p.add_argument("--key-name", default="RootManageSharedAccessKey")
    p.add_argument("--key", default=os.environ.get("AMQPSUB_SBPEER_KEY", "c2JwZWVyLXRlc3Qta2V5LW5vdC1hLXNlY3JldA=="))
    p.add_argument("--cbs-deadline", type=float, default=20.0,
                   help="seconds after open within which a token must be put (0: never)")
    p.add_argument("--session-timeout-ms", type=int, default=60000,
                   help="accept-next-session wait when the client sets no com.microsoft:timeout")
    p.add_argument("--max-message-size", type=int, default=262144,
                   help="max-message-size on entity links (Standard tier: 256 KiB; 0: none)")
    p.add_argument("--idle-detach-ms", type=int, default=0,
                   help="detach an entity receive link idle this long (the service: 600000; 0: never)")
    p.add_argument("--connection-loss-locks", choices=("survive", "drop"), default="survive",
                   help="what a lost connection does to its receive links' message locks (see Peer.drop_connection_locks)")
    p.add_argument("--entities", help="JSON file: a list of entity specs as POST /entities takes")
    p.add_argument("--verbose", action="store_true")
    args = p.parse_args()
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s.%(msecs)03d %(levelname)s %(message)s",
                        datefmt="%H:%M:%S", stream=sys.stderr)
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        p.error("sbpeer listens on the loopback interface only")

    peer = Peer(args)
    if args.entities:
        with open(args.entities) as f:
            for spec in json.load(f):
                peer.create_entity(spec)
    httpd = CtlServer((args.host, args.control_port), make_http_handler(peer))
    th = threading.Thread(target=httpd.serve_forever, name="control", daemon=True)
    th.start()
    log.info("control API on http://%s:%d", args.host, args.control_port)

    def on_signal(signum, frame):
        peer.injector.trigger(ApplicationEvent("sbstop"))

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    container = Container(peer)
    container.run()
    httpd.shutdown()
    log.info("stopped")


if __name__ == "__main__":
    main()
