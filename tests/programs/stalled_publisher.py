"""A publisher process for the stalled-subscriber test: publishes on cue, then waits.

argv: events, payload_bytes, control folder. Prints {"pid", "endpoints"} once bound;
publishes `events` batch_end events of `payload_bytes` padding each once the file
<folder>/go exists, prints what it did, and closes once <folder>/stop exists.
"""

import json
import os
import sys
import time
from pathlib import Path

from helpers.waiting import wait_for_file

from offloop.bus import Publisher

if __name__ == "__main__":
    events, size, folder = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    pub = Publisher("stalled", heartbeat_interval=0.2)
    endpoints = pub.start()
    print(json.dumps({"pid": os.getpid(), "endpoints": endpoints}), flush=True)
    wait_for_file(folder / "go", 60)
    pad = b"x" * size
    sent = 0
    start = time.perf_counter()
    for i in range(events):
        sent += pub.publish("batch_end", (0, i + 1, i + 1, 8 * (i + 1), 0), {"pad": pad, "i": i})
    print(json.dumps({"published": events, "sent": sent, "drops": pub.stats.drops,
                      "tseq": pub.topic_seq("batch_end"),
                      "seconds": round(time.perf_counter() - start, 3)}), flush=True)
    wait_for_file(folder / "stop", 120)
    pub.close(linger=0.2)
    print(json.dumps({"closed": True}), flush=True)
