"""A control server told when to act by files in a directory (argv: port, directory).

It binds once `bind` exists (the test makes it after a client's first attempt was lost
with its socket), polls only once a retry of a request has arrived while that request
waited (so the retries queue up and are counted as duplicates), and reports once `stop`
exists. Every wait has a deadline, so a test that never signals fails instead of hanging."""

import json
import sys
import time
from pathlib import Path

from helpers.waiting import wait_until

from offloop.bus import ControlServer

port, signals = int(sys.argv[1]), Path(sys.argv[2])

wait_until((signals / "bind").exists, 60, "the bind signal")
server = ControlServer(port=port)
server.start()
print(json.dumps({"bound": server.endpoint}), flush=True)
wait_until(lambda: server.stats.duplicates >= 1, 60, "a retry queued behind its request")
applied = []
deadline = time.monotonic() + 60
while not (signals / "stop").exists() and time.monotonic() < deadline:
    for request in server.poll():
        applied.append([request.client, request.req, request.op])
        request.ack(step=42, path=f"/ckpt/{len(applied)}.pt")
    time.sleep(0.01)
print(json.dumps({"applied": applied, "duplicates": server.stats.duplicates,
                  "malformed": server.stats.malformed}), flush=True)
server.close()
