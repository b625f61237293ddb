"""torchrun on two nodes, one rank each: two network namespaces joined by veth links
(tests/helpers/netns.py), c10d rendezvous on node 0's address, gloo over the links.

Events come from both ranks, each rank publishing on its own node's address (CURVE keys);
a halt and a checkpoint asked of rank 0 take effect at the same step on both nodes; the
checkpoint resumes on two nodes and ends bit for bit where an uninterrupted two-node run
ends.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from helpers.netns import Network
from helpers.ranks import drain, torchrun_command, wait_for_run
from programs.ddp_train import weights_digest

from offloop.bus import ControlClient, Subscriber
from offloop.bus.security import load_client_keys

ROOT = Path(__file__).resolve().parents[2]
HELPER = ROOT / "tests" / "programs" / "ddp_train.py"
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}
BLOCK_AT = 10  # rank 0 is held before loading batch 10 until both requests are queued
STEP = BLOCK_AT + 1
DURATION = "3ep"  # 24 batches
TOPICS = ["batch_end", "control_request", "checkpoint_saved", "fit_end"]
NODES = ["node0", "node1"]

_CANNOT = Network.skip_reason()
pytestmark = pytest.mark.skipif(_CANNOT is not None, reason=_CANNOT or "")


class TwoNodes:
    """One torchrun per node; JSON lines from each node's rank, read with deadlines."""

    def __init__(self, net: Network, tmp: Path, name: str, keys: Path, port: int, *args: str,
                 host: str | None = None) -> None:
        self.run_dir = tmp / name
        self.procs, self.lines, self.stderr_paths = [], [], []
        self._buffers = [b"", b""]
        for rank, node in enumerate(NODES):
            err = tmp / f"{name}-{node}.stderr"
            cmd = [*torchrun_command(), "--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(rank),
                   "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{net.addr['node0']}:{port}",
                   "--rdzv-id", name, "--local-addr", net.addr[node],
                   # the rendezvous store's host is node 0: its hostname names no address of a namespace
                   "--rdzv-conf", f"is_host={int(rank == 0)},join_timeout=60",
                   str(HELPER), "--run-dir", str(self.run_dir), "--host", host or net.addr[node],
                   "--keys", str(keys), *args]
            with err.open("wb") as out:
                self.procs.append(net.popen(node, ["env", "GLOO_SOCKET_IFNAME=eth0", *cmd], env=ENV,
                                            stdout=subprocess.PIPE, stderr=out, stdin=subprocess.DEVNULL))
            self.stderr_paths.append(err)

    def stderr(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in self.stderr_paths)

    def _read(self, deadline: float) -> bool:
        open_pipes = [p.stdout for p in self.procs if not p.stdout.closed]
        left = deadline - time.monotonic()
        if not open_pipes or left <= 0:
            return False
        ready, _, _ = select.select(open_pipes, [], [], left)
        for pipe in ready:
            node = next(i for i, p in enumerate(self.procs) if p.stdout is pipe)
            chunk = os.read(pipe.fileno(), 65536)
            if not chunk:
                pipe.close()
                continue
            self._buffers[node] += chunk
            *whole, self._buffers[node] = self._buffers[node].split(b"\n")
            for raw in whole:
                try:
                    line = json.loads(raw)
                except ValueError:
                    continue
                if isinstance(line, dict):
                    self.lines.append(line)
        return True

    def wait_line(self, match, timeout: float = 60.0) -> dict:
        deadline = time.monotonic() + timeout
        while (found := next((line for line in self.lines if match(line)), None)) is None:
            if not self._read(deadline):
                raise AssertionError(f"no such line within {timeout}s; lines {self.lines}\n{self.stderr()}")
        return found

    def finish(self, timeout: float = 90.0) -> list[int]:
        """Both nodes' exit statuses; fails if either has not exited in time."""
        deadline = time.monotonic() + timeout
        while self._read(deadline):
            pass
        try:
            return [p.wait(timeout=max(0.1, deadline - time.monotonic())) for p in self.procs]
        except subprocess.TimeoutExpired:
            raise AssertionError(f"a node did not exit within {timeout}s: a rank hung\n{self.stderr()}") from None

    def finals(self) -> dict[int, dict]:
        return {line["rank"]: line for line in self.lines if line.get("final")}


def ask(endpoint: str, curve, op: str, args: dict, out: dict) -> threading.Thread:
    def run():
        with ControlClient(endpoint, curve=curve) as client:
            out[op] = client.request(op, args, timeout=60)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


@pytest.mark.timeout(420)
def test_two_nodes_publish_agree_on_a_halt_and_checkpoint_and_resume_bit_for_bit(tmp_path):
    keys = tmp_path / "keys"
    for client, role in (("client", "control"), ("observer", "monitor")):
        subprocess.run([sys.executable, "-m", "offloop.cli", "keys", str(keys), "--client", client, "--role", role],
                       env=ENV, check=True, capture_output=True, timeout=60)
    observer = load_client_keys(keys, "observer")
    with Network(NODES) as net:
        started = time.monotonic()
        reference = TwoNodes(net, tmp_path, "reference", keys, 29411, "--max-duration", DURATION)
        # bound to every interface: run.json still names each rank at its own node's address
        halted = TwoNodes(net, tmp_path, "halted", keys, 29412, "--max-duration", DURATION,
                          "--block-at", str(BLOCK_AT), "--wait-requests", "2", host="0.0.0.0")
        info = wait_for_run(halted.run_dir, 60.0, stderr=halted.stderr)
        halted.wait_line(lambda line: line.get("blocked") == BLOCK_AT)
        assert [eps["events"].split("//")[1].split(":")[0] for eps in info.ranks] == [net.addr[n] for n in NODES]
        subs = {rank: Subscriber(eps["events"], eps["state"], topics=TOPICS, curve=observer, heartbeat_timeout=30)
                for rank, eps in enumerate(info.ranks)}
        for sub in subs.values():
            sub.connect(join_timeout=30)
        acks: dict = {}
        control = load_client_keys(keys, "client")
        threads = [ask(info.endpoints["control"], control, "checkpoint", {"tag": "resume"}, acks),
                   ask(info.endpoints["control"], control, "halt", {"reason": "test"}, acks)]
        try:
            events = drain(subs, 60.0)
        finally:
            for sub in subs.values():
                sub.close()
        assert halted.finish() == [0, 0], halted.stderr()
        for thread in threads:
            thread.join(30)
        halted_s = time.monotonic() - started

        # events from both ranks, each from its own node, every message with its rank
        for rank in (0, 1):
            assert events[rank] and {m.rank for m in events[rank]} == {rank}
            assert [m.ts[1] for m in events[rank] if m.topic == "fit_end"] == [STEP]
            saved = [m for m in events[rank] if m.topic == "checkpoint_saved"]
            assert [(m.ts[1], m.data["step"], m.data["tag"]) for m in saved] == [(STEP, STEP, "resume")]
        assert [m.topic for m in events[0]].count("control_request") == 2
        assert not any(m.topic == "control_request" for m in events[1])
        # the halt and the checkpoint agreed at the same step on both nodes
        assert acks["halt"].ok and acks["halt"].result["step"] == STEP
        assert acks["checkpoint"].ok and acks["checkpoint"].result["step"] == STEP
        finals = halted.finals()
        assert sorted(finals) == [0, 1], halted.lines
        assert [(f["epoch"], f["batch"]) for f in finals.values()] == [(1, STEP)] * 2
        assert finals[0]["weights"] == finals[1]["weights"]
        path = Path(acks["checkpoint"].result["path"])
        assert sorted(p.name for p in path.parent.iterdir()) == [path.name]
        state = torch.load(path, map_location="cpu", weights_only=True)
        assert state["timestamp"]["batch"] == STEP and len(state["rng"]) == 2
        assert weights_digest(state["model"]) == finals[0]["weights"]

        # resumed on two nodes, it ends where the uninterrupted two-node run ends, bit for bit
        resumed = TwoNodes(net, tmp_path, "resumed", keys, 29413, "--max-duration", DURATION,
                           "--load-path", str(path))
        assert resumed.finish() == [0, 0], resumed.stderr()
        assert reference.finish() == [0, 0], reference.stderr()
        total_s = time.monotonic() - started
    assert [line["resumed_at"] for line in resumed.lines if "started" in line] == [STEP, STEP]
    got, want = resumed.finals(), reference.finals()
    assert sorted(got) == sorted(want) == [0, 1], (resumed.lines, reference.lines)
    assert all(f["batch"] == 24 for f in [*got.values(), *want.values()])
    assert finals[0]["weights"] != want[0]["weights"]  # the halt cut training short
    assert got[0]["weights"] == got[1]["weights"] == want[0]["weights"] == want[1]["weights"]
    print(json.dumps({"case": "two nodes", "events": {r: len(e) for r, e in events.items()},
                      "step": STEP, "halted_run_s": round(halted_s, 1), "all_runs_s": round(total_s, 1)}))
