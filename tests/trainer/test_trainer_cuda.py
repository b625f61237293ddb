"""On CUDA: publishing adds no host-device synchronisation, and under torchrun each rank
trains on its own GPU (skipped without a GPU)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch
from helpers.ranks import torchrun_command
from helpers.trainers import mlp

from offloop.bus import GRAD_NORMS, RUN_TOPICS, Subscriber
from offloop.trainer import Trainer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def fit_never_syncing(trainer: Trainer, topics: list[str]) -> list:
    """fit() with any host-device synchronisation raising, then close(); the live messages of
    `topics` a subscriber received meanwhile."""
    endpoints = trainer.publisher.endpoints
    sub = Subscriber(endpoints["events"], endpoints["state"], topics=topics)
    sub.connect()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        trainer.fit()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    received = []
    while (msg := sub.recv(timeout=1)) is not None:
        if not msg.from_state:
            received.append(msg)
    sub.close()
    trainer.close()
    assert sub.stats.gaps == 0
    return received


def test_training_with_every_event_published_never_syncs(tmp_path):
    device = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    batches = [(torch.randn(32, 8, generator=gen).to(device), torch.randint(0, 3, (32,), generator=gen).to(device))
               for _ in range(20)]
    trainer = Trainer(mlp().to(device), batches, "20ba", loss_fn=torch.nn.functional.cross_entropy,
                      optimizers=None, device="cuda", run_dir=tmp_path / "run",
                      per_param_grad_norms=True)
    # every event, and the gradient norms a GradMonitor asks for by name
    losses, norms = [], []
    for msg in fit_never_syncing(trainer, [*RUN_TOPICS, GRAD_NORMS]):
        if msg.topic == "batch_end":
            losses.append(msg.data["loss"])
            assert msg.data["memory"]["allocated_bytes"] > 0
        if msg.topic == GRAD_NORMS:
            norms.append(msg.data["grad_norm"])
    assert len(losses) == 20 and all(isinstance(v, float) for v in losses)
    assert len(norms) == 20 and all(v > 0 for v in norms)


class LogsOnDevice(torch.nn.Module):
    """A model whose forward logs a CUDA 0-d tensor with log_metrics()."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = mlp()

    def forward(self, x):
        from offloop import log_metrics

        out = self.inner(x)
        log_metrics({"aux/mean": out.mean()})
        return out


def test_log_metrics_of_a_cuda_tensor_never_syncs(tmp_path):
    device = torch.device("cuda")
    batches = [(torch.randn(32, 8, device=device), torch.randint(0, 3, (32,), device=device)) for _ in range(10)]
    trainer = Trainer(LogsOnDevice().to(device), batches, "10ba", loss_fn=torch.nn.functional.cross_entropy,
                      device="cuda", run_dir=tmp_path / "run")
    logged = [msg.data["metrics"]["aux/mean"] for msg in fit_never_syncing(trainer, ["batch_end"])]
    assert len(logged) == 10 and all(isinstance(v, float) for v in logged)


def test_composers_gpu_device_is_the_current_cuda_device(tmp_path):
    with Trainer(mlp(), [(torch.randn(4, 8), torch.randint(0, 3, (4,)))], "1ba",
                 loss_fn=torch.nn.functional.cross_entropy, device="gpu", run_dir=tmp_path / "run") as trainer:
        assert trainer.device == torch.device("cuda", torch.cuda.current_device())
        trainer.fit()


def test_a_tensor_in_several_snapshots_is_staged_once_and_an_in_place_change_is_seen(monkeypatch):
    """The step's loss is one tensor in three snapshots: copied off the GPU once, each
    snapshot carrying its value; the same tensor changed in place is copied again."""
    from offloop.bus import Publisher
    from offloop.trainer.snapshot import open_emitter

    publisher = Publisher("staged-once", heartbeat_interval=0.1)
    publisher.start()
    try:
        with Subscriber(publisher.endpoints["events"], publisher.endpoints["state"],
                        topics=["after_loss", "after_train_batch", "batch_end"]) as sub:
            sub.connect()
            emitter = open_emitter(publisher, torch.device("cuda"))
            loss = torch.tensor(0.5, device="cuda")
            copies = []
            real_empty = torch.empty

            def counting_empty(*args, **kwargs):
                copies.append(kwargs.get("pin_memory"))
                return real_empty(*args, **kwargs)

            monkeypatch.setattr(torch, "empty", counting_empty)
            emitter.emit_tensors("after_loss", (0, 0, 0, 0, 0), {"loss": loss})
            emitter.emit_tensors("after_train_batch", (0, 0, 0, 0, 0), {"loss": loss})
            loss.add_(1.0)  # changed in place: a new value, copied again
            emitter.emit_tensors("batch_end", (0, 1, 1, 4, 0), {"loss": loss, "other": torch.ones(2, device="cuda")})
            monkeypatch.undo()
            emitter.flush()
            got = [sub.recv(timeout=5) for _ in range(3)]
        assert copies == [True, True, True]  # the loss twice (before and after add_), the other once
        assert [msg.topic for msg in got] == ["after_loss", "after_train_batch", "batch_end"]
        assert [msg.data["loss"] for msg in got] == [0.5, 0.5, 1.5]
        assert got[2].data["other"].to_torch().tolist() == [1.0, 1.0]
    finally:
        publisher.close(linger=0.1)


@pytest.mark.skipif(torch.cuda.device_count() != 1, reason="needs a node with exactly one GPU")
def test_two_ranks_on_a_one_gpu_node_are_told_what_to_change(tmp_path):
    """Each rank trains on its own GPU (cuda:LOCAL_RANK); the rank without one gets one clear
    error, not NCCL's "invalid usage" from two ranks sharing GPU 0."""
    root = Path(__file__).resolve().parents[2]
    cmd = [*torchrun_command(), "--standalone", "--nproc_per_node=2", str(root / "tests" / "programs" / "ddp_train.py"),
           "--run-dir", str(tmp_path / "run"), "--max-duration", "2ba", "--device", "auto"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
                          env={**os.environ, "OFFLOOP_RUNS": str(tmp_path),
                               "PYTHONPATH": os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH")) if p)})
    assert done.returncode != 0
    assert ("ConfigError: device 'auto' gives each rank its own GPU, cuda:LOCAL_RANK, but this rank's LOCAL_RANK "
            "is 1 and this machine has 1 CUDA device(s)") in done.stderr, done.stderr[-4000:]
    assert "invalid usage" not in done.stderr
