"""Publishes a run: config, one epoch_start, then a batch_end every millisecond; prints its
endpoints, then {"published": 100} once the 100th batch_end is out. Arguments: the seconds
it publishes (30), and `capped` for subscriptions capped as a run with keys has them."""

import json
import sys
import time

from offloop.bus import Publisher

pub = Publisher("late-join-run", heartbeat_interval=0.2, cap_subscriptions="capped" in sys.argv[2:])
endpoints = pub.start()
pub.set_config({"model": "mlp", "lr": 0.01, "max_duration": "1ep"})
pub.publish("epoch_start", (0, 0, 0, 0, 0), {"note": "sent once, long before anyone joins"})
print(json.dumps(endpoints), flush=True)
limit = float(sys.argv[1]) if len(sys.argv) > 1 else 30.0
start, batch = time.monotonic(), 0
while time.monotonic() - start < limit:
    batch += 1
    pub.publish("batch_end", (0, batch, batch, batch * 32, 0), {"loss": 1.0 / batch})
    if batch == 100:
        print(json.dumps({"published": batch}), flush=True)
    time.sleep(0.001)
pub.close()
