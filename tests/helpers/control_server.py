"""A control server that binds after a delay and polls only after another delay."""

import json
import sys
import time

from offloop.bus import ControlServer

port, bind_delay, poll_delay, run_for = int(sys.argv[1]), *map(float, sys.argv[2:5])
time.sleep(bind_delay)
server = ControlServer(port=port)
server.start()
print(json.dumps({"bound": server.endpoint}), flush=True)
time.sleep(poll_delay)  # requests queue up; retries of them are duplicates
applied = []
deadline = time.monotonic() + run_for
while time.monotonic() < deadline:
    for request in server.poll():
        applied.append([request.client, request.req, request.op])
        request.ack(step=42, path=f"/ckpt/{len(applied)}.pt")
    time.sleep(0.01)
print(json.dumps({"applied": applied, "duplicates": server.stats.duplicates,
                  "malformed": server.stats.malformed}), flush=True)
server.close()
