#!/usr/bin/python3
"""Receives exactly N messages from a queue over AMQP 1.0 with Qpid Proton's
Python binding (Debian's python3-qpid-proton), the way a Python user would,
for amqpsub's benchmark (integration/bench), which compares it with its
go-amqp loop. Modelled on Proton's simple_recv.py example.

Run it with /usr/bin/python3, whose dist-packages hold proton:

    AMQPSUB_URL=amqp://127.0.0.1:5672 /usr/bin/python3 \\
        integration/bench/pyproton/receive.py --queue Q --count N \\
        [--window 256] [--stall 20]

One connection, one receiver. MessagingHandler(prefetch=WINDOW) keeps the
credit at WINDOW: Proton's FlowController tops it back up to WINDOW after
every delivery. Each message is decoded (event.message) and accepted on its
own in on_message (auto_accept off only so that the accept is ours to time;
auto_accept=True makes the same call just after on_message returns).

stdout carries one line per event, "<event> <time.monotonic_ns()> <messages
so far>": start once the connection is open, before the receiver's session
and link open (where the bench's go-amqp loop starts its clock); first at
the first message; progress every 1,000 messages; last once the last was
accepted. It exits 0 only if N messages arrived and were accepted, 1 if none
came for --stall seconds or the connection failed, 2 on a usage error.

The URL comes from $AMQPSUB_URL (which keeps a password off the command
line), else amqp://127.0.0.1:5672.
"""

import argparse
import os
import sys
import time

from proton.handlers import MessagingHandler
from proton.reactor import Container

PROGRESS_EVERY = 1000


def mark(event, n):
    sys.stdout.write("%s %d %d\n" % (event, time.monotonic_ns(), n))
    sys.stdout.flush()


class Receiver(MessagingHandler):
    def __init__(self, url, queue, count, window, stall):
        super().__init__(prefetch=window, auto_accept=False)
        self.url = url
        self.queue = queue
        self.count = count
        self.stall = stall
        self.received = 0
        self.seen = 0  # received at the last tick
        self.seen_at = time.monotonic()
        self.error = None
        self.conn = None
        self.timer = None

    def on_start(self, event):
        self.conn = event.container.connect(self.url)
        self.timer = event.container.schedule(1, self)

    def on_connection_opened(self, event):
        mark("start", 0)
        event.container.create_receiver(self.conn, self.queue)

    def on_message(self, event):
        self.accept(event.delivery)
        self.received += 1
        if self.received == 1:
            mark("first", 1)
        if self.received % PROGRESS_EVERY == 0:
            mark("progress", self.received)
        if self.received == self.count:
            mark("last", self.received)
            self.timer.cancel()
            event.receiver.close()
            event.connection.close()

    def on_timer_task(self, event):
        now = time.monotonic()
        if self.received != self.seen:
            self.seen, self.seen_at = self.received, now
        elif now - self.seen_at >= self.stall:
            self.fail("no message for %d s" % self.stall)
            return
        self.timer = event.container.schedule(1, self)

    def fail(self, why):
        if self.error is None:
            self.error = why
        if self.timer is not None:
            self.timer.cancel()
        if self.conn is not None:
            self.conn.close()

    def on_transport_error(self, event):
        cond = event.transport.condition
        self.fail("transport error: %s" % (cond.description if cond else "unknown"))

    def on_connection_error(self, event):
        cond = event.connection.remote_condition
        self.fail("connection error: %s" % (cond.description if cond else "unknown"))

    def on_link_error(self, event):
        cond = event.link.remote_condition
        self.fail("link error: %s" % (cond.description if cond else "unknown"))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--queue", required=True)
    p.add_argument("--count", type=int, required=True)
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--stall", type=int, default=20)
    args = p.parse_args()
    if args.count < 1 or args.window < 1 or args.stall < 1:
        p.error("--count, --window and --stall must be >= 1")
    url = os.environ.get("AMQPSUB_URL", "amqp://127.0.0.1:5672")
    r = Receiver(url, args.queue, args.count, args.window, args.stall)
    Container(r).run()
    if r.received < args.count or r.error is not None:
        sys.stderr.write("pyproton receive: %s after %d of %d messages\n"
                         % (r.error or "connection closed", r.received, args.count))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
