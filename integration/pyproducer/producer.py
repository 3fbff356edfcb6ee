#!/usr/bin/python3
"""Sends N messages in message groups to a queue over AMQP 1.0 with Qpid
Proton (Debian's python3-qpid-proton), for amqpsub's integration tests.

Run it with /usr/bin/python3, whose dist-packages hold proton:

    /usr/bin/python3 integration/pyproducer/producer.py --queue Q \
        [--url amqp://127.0.0.1:5672] [--count 100] [--groups 10] \
        [--kind text|bytes|map|list]

Message i (from 0) belongs to group "g%03d" with g = i mod groups; it has
the AMQP group-id of that name and group-sequence = its 1-based position in
the group, the application properties "kind" and "n" (i), and is durable.
Its body, with key = "group/seq":

    text   amqp-value string key
    bytes  one data section, the UTF-8 bytes of key
    map    amqp-value map {"key": key, "seq": seq (long)}
    list   one amqp-sequence section [key, seq (long)]

The sender attaches with target capability "queue", so Artemis auto-creates
an anycast queue. Up to the link credit is sent at once; the program exits 0
once the broker has accepted every message, 1 if it refused one or the run
took longer than --timeout seconds.
"""

import argparse
import sys
import time

from proton import Data, Message, symbol
from proton.handlers import MessagingHandler
from proton.reactor import Container, SenderOption

KINDS = ("text", "bytes", "map", "list")


class QueueCapability(SenderOption):
    """Asks for target capability "queue" (an anycast queue on Artemis)."""

    def apply(self, sender):
        caps = sender.target.capabilities
        caps.put_array(False, Data.SYMBOL)
        caps.enter()
        caps.put_symbol(symbol("queue"))
        caps.exit()


def build(kind, i, groups, seq):
    group = "g%03d" % (i % groups)
    key = "%s/%d" % (group, seq)
    if kind == "text":
        body, inferred = key, False
    elif kind == "bytes":
        body, inferred = key.encode("utf-8"), True
    elif kind == "map":
        body, inferred = {"key": key, "seq": seq}, False
    else:
        body, inferred = [key, seq], True
    return Message(
        body=body,
        inferred=inferred,
        durable=True,
        group_id=group,
        group_sequence=seq,
        properties={"kind": kind, "n": i},
    )


class Producer(MessagingHandler):
    def __init__(self, args):
        super().__init__(auto_settle=True)
        self.args = args
        self.sent = 0
        self.accepted = 0
        self.next = [0] * args.groups
        self.error = None
        self.conn = None
        self.timer = None

    def on_start(self, event):
        self.conn = event.container.connect(self.args.url)
        event.container.create_sender(self.conn, self.args.queue, options=QueueCapability())
        self.timer = event.container.schedule(self.args.timeout, self)
        if self.args.count == 0:
            self.finish()

    def on_timer_task(self, event):
        self.fail("timed out after %ss: %d sent, %d accepted" % (self.args.timeout, self.sent, self.accepted))

    def on_sendable(self, event):
        while event.sender.credit and self.sent < self.args.count:
            i = self.sent
            g = i % self.args.groups
            self.next[g] += 1
            event.sender.send(build(self.args.kind, i, self.args.groups, self.next[g]))
            self.sent += 1

    def on_accepted(self, event):
        self.accepted += 1
        if self.accepted == self.args.count:
            self.finish()

    def on_rejected(self, event):
        self.fail("the broker rejected a message: %s" % event.delivery.remote.condition)

    def on_released(self, event):
        self.fail("the broker released a message")

    def on_transport_error(self, event):
        self.fail("transport error: %s" % event.transport.condition)

    def on_connection_error(self, event):
        self.fail("connection error: %s" % event.connection.remote_condition)

    def on_link_error(self, event):
        self.fail("link error: %s" % event.link.remote_condition)

    def fail(self, why):
        if self.error is None:
            self.error = why
        self.finish()

    def finish(self):
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.conn is not None:
            self.conn.close()
            self.conn = None


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="amqp://127.0.0.1:5672")
    p.add_argument("--queue", required=True)
    p.add_argument("--count", type=int, default=100)
    p.add_argument("--groups", type=int, default=10)
    p.add_argument("--kind", choices=KINDS, default="text")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds (default 60)")
    args = p.parse_args()
    if args.count < 0 or args.groups < 1:
        p.error("--count must be >= 0 and --groups >= 1")

    start = time.monotonic()
    h = Producer(args)
    Container(h).run()
    if h.error is not None:
        print("pyproducer: %s" % h.error, file=sys.stderr)
        return 1
    print("sent %d messages in %d groups (kind %s) to %s in %d ms"
          % (args.count, args.groups, args.kind, args.queue, (time.monotonic() - start) * 1000))
    return 0


if __name__ == "__main__":
    sys.exit(main())
