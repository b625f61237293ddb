"""A subscriber that sleeps on every message, then reports what it counted."""

import json
import sys
import time

from offloop.bus import Subscriber

events, state, total, sleep = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
sub = Subscriber(events, state, topics=["batch_end"], rcvhwm=50, heartbeat_timeout=20)
sub.connect(join_timeout=10)
print(json.dumps({"joined": True}), flush=True)
deadline = time.monotonic() + 60
while sub.stats.received + sub.stats.gaps < total and time.monotonic() < deadline:
    if sub.recv(timeout=0.2) is not None:
        time.sleep(sleep)
print(json.dumps({"received": sub.stats.received, "gaps": sub.stats.gaps,
                  "duplicates": sub.stats.duplicates}), flush=True)
