"""A subscriber that stops reading: it takes the first event, then reads nothing until the
file `go` exists (the test makes it once every publish() has returned), says how many it
had taken by then, drains what reached it, hears one more heartbeat (the publisher's drops
are final by then) and reports what it counted."""

import json
import os
import sys
import time

from offloop.bus import Subscriber

events, state, total, go = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
sub = Subscriber(events, state, topics=["batch_end"], rcvhwm=4, heartbeat_timeout=60)
sub.connect(join_timeout=20)
print(json.dumps({"joined": True}), flush=True)
first = sub.recv(timeout=20)
print(json.dumps({"first": None if first is None else first.tseq}), flush=True)
deadline = time.monotonic() + 60
while not os.path.exists(go) and time.monotonic() < deadline:  # no recv(): its queues fill
    time.sleep(0.005)
print(json.dumps({"received": sub.stats.received}), flush=True)
last = first.tseq if first is not None else 0
deadline = time.monotonic() + 60
while sub.stats.received + sub.stats.gaps < total and time.monotonic() < deadline:
    msg = sub.recv(timeout=0.2)
    if msg is not None:
        last = msg.tseq
# the last event read may have left before the last drop was counted, and the heartbeats
# sent while the queue was full were dropped: one heard from now on left after every event
beats, deadline = sub.stats.heartbeats, time.monotonic() + 10
while sub.stats.heartbeats == beats and time.monotonic() < deadline:
    sub.recv(timeout=0.2)
print(json.dumps({"received": sub.stats.received, "gaps": sub.stats.gaps, "last": last,
                  "duplicates": sub.stats.duplicates, "publisher_drops": sub.publisher_drops}),
      flush=True)
