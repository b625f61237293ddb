"""Writes a file whole, then starts writing it again and stops half-way, to be killed there.

argv: kind ("run_info" or "checkpoint"), directory. Prints {"first": path} once the first
version is written, then {"inside": path} once half of the second version's bytes have
reached the disk (under whatever name the writer writes them), and waits to be killed
(60 s at most, then exits 3). The writer is the product's own; only the serializer it
calls is replaced by one that stops half-way, as a SIGKILL or power cut would.
"""

import io
import json
import os
import sys
import time
from pathlib import Path

import torch

from offloop.bus import RunInfo, discovery
from offloop.trainer import checkpoint


def half_then_wait(data: bytes | str, out) -> None:
    out.write(data[: len(data) // 2])
    out.flush()
    os.fsync(out.fileno())
    print(json.dumps({"inside": os.readlink(f"/proc/self/fd/{out.fileno()}")}), flush=True)
    time.sleep(60)
    sys.exit(3)


def run_info(version: int) -> RunInfo:
    return RunInfo(run_id="id-crash", run_name="crash", pid=os.getpid(), started=float(version),
                   endpoints={"events": "tcp://127.0.0.1:1", "state": "tcp://127.0.0.1:2",
                              "control": "tcp://127.0.0.1:3"})


if __name__ == "__main__":
    kind, folder = sys.argv[1], Path(sys.argv[2])
    if kind == "run_info":
        path = discovery.write_run_info(folder, run_info(1))
        print(json.dumps({"first": str(path)}), flush=True)
        discovery.json.dump = lambda obj, out, **kw: half_then_wait(json.dumps(obj, **kw), out)
        discovery.write_run_info(folder, run_info(2))
    else:
        path = checkpoint.save_checkpoint(folder / "ep1-ba10.pt", {"version": torch.tensor(1)})
        print(json.dumps({"first": str(path)}), flush=True)

        real_save = torch.save

        def partial_save(obj, out, **kw):
            whole = io.BytesIO()
            real_save(obj, whole)
            half_then_wait(whole.getvalue(), out)

        checkpoint.torch.save = partial_save
        checkpoint.save_checkpoint(path, {"version": torch.tensor(2), "more": torch.zeros(4096)})
    sys.exit(4)  # the write returned: it should have been killed inside it
