"""A control server told when to act by files in a directory (argv: port, directory).

It binds once `bind` exists (the test makes it after a client's first attempt was lost
with its socket), polls only once a retry of a request has arrived while that request
waited (so the retries queue up and are counted as duplicates), and reports once `stop`
exists. Every wait has a deadline, so a test that never signals fails instead of hanging."""

import json
import sys
import time
from pathlib import Path

from offloop.bus import ControlServer

port, signals = int(sys.argv[1]), Path(sys.argv[2])


def wait_for(condition, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            print(json.dumps({"timed_out": what}), flush=True)
            sys.exit(1)
        time.sleep(0.005)


wait_for((signals / "bind").exists, "the bind signal")
server = ControlServer(port=port)
server.start()
print(json.dumps({"bound": server.endpoint}), flush=True)
wait_for(lambda: server.stats.duplicates >= 1, "a retry queued behind its request")
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
