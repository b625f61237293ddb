"""A run's name and sockets: its keys, publisher, control server and run.json, opened in
one place and closed in one place (publisher first: its final heartbeats end the stream)."""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import zmq

from offloop.bus import ControlServer, Publisher, RunInfo, mark_finished, write_run_info
from offloop.bus.security import SecurityError, check_exposure, load_server_keys
from offloop.trainer.batches import dataset_len, loader_len
from offloop.trainer.distributed import ControlAgreement, reachable
from offloop.trainer.errors import ConfigError
from offloop.trainer.readings import describe_optimizer

__all__ = ["RunSockets", "check_keys", "name_run", "run_config"]

log = logging.getLogger("offloop.trainer")


def name_run(run_name: str | None, run_dir: str | os.PathLike | None,
             save_folder: str | os.PathLike | None) -> tuple[str, str, Path, Path]:
    """(run id, run name, run directory, checkpoint folder): the name defaults to the run
    directory's, or to the time and id; the directory to $OFFLOOP_RUNS (runs/) / name; the
    checkpoint folder's `{run_name}` is filled in (Composer's save_folder)."""
    run_id = uuid.uuid4().hex[:12]
    run_name = run_name or (
        Path(run_dir).name if run_dir else f"run-{time.strftime('%Y%m%d-%H%M%S')}-{run_id[:6]}"
    )
    run_dir = Path(run_dir) if run_dir else Path(os.environ.get("OFFLOOP_RUNS", "runs")) / run_name
    folder = (
        Path(str(save_folder).replace("{run_name}", run_name))
        if save_folder
        else run_dir / "checkpoints"
    )
    return run_id, run_name, run_dir, folder.absolute()


def run_config(
    model: torch.nn.Module,
    *,
    run_name: str,
    run_id: str,
    seed: int,
    max_duration: Any,
    train_dataloader: Any,
    eval_intervals: dict,
    eval_dataloaders: dict,
    world_size: int,
    device: torch.device,
    precision: str,
    grad_accum: int,
    optimizers: list,
    hparams: dict,
) -> dict[str, Any]:
    """The run config: what run.json, a late joiner and every `init`/`fit_start` carry."""
    return {
        "run_name": run_name,
        "run_id": run_id,
        "model": type(model).__name__,
        "num_params": sum(p.numel() for p in model.parameters()),
        "max_duration": str(max_duration) if max_duration else None,
        "dataloader_len": loader_len(train_dataloader),
        # a DataLoader's own figures where it has them (MLPerf's submission logs them)
        "train_batch_size": getattr(train_dataloader, "batch_size", None),
        "train_samples": dataset_len(train_dataloader),
        "eval_samples": {k: dataset_len(v) for k, v in eval_dataloaders.items()},
        "eval_interval": {k: str(v) for k, v in eval_intervals.items()},
        "eval_dataloaders": {k: loader_len(v) for k, v in eval_dataloaders.items()},
        "world_size": world_size,
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "precision": precision,
        "grad_accum": grad_accum,
        "seed": seed,
        "optimizers": [describe_optimizer(o) for o in optimizers],
        "hparams": hparams,
    }


def check_keys(keys: str | os.PathLike | None, host: str, insecure: bool):
    """The server keys (None without `keys`), refused where `host` would expose the run
    without them (the trainer's own workers get a key pair made in memory for the run:
    `ServerKeys.client_keys`)."""
    try:
        server_keys = load_server_keys(keys) if keys else None
        check_exposure(host, server_keys, insecure)
    except SecurityError as exc:
        raise ConfigError(str(exc)) from None
    return server_keys


class RunSockets:
    """The publisher every rank has, and rank 0's control server and run.json."""

    def __init__(
        self, run_id: str, server_keys, *, rank: int, host: str, heartbeat_interval: float
    ) -> None:
        self.context = zmq.Context()
        self.keys = server_keys
        self.authenticator = server_keys.start_authenticator(self.context) if server_keys else None
        self.publisher = Publisher(
            run_id,
            rank=rank,
            host=host,
            context=self.context,
            heartbeat_interval=heartbeat_interval,
            curve=server_keys,
        )
        self.control: ControlServer | None = None
        self.rank, self.host = rank, host
        self.run_dir: Path | None = None

    def start(
        self,
        agreement: ControlAgreement,
        run_dir: Path,
        run_name: str,
        world_size: int,
        config: dict[str, Any],
    ) -> None:
        """Bind every socket; rank 0 then writes run.json naming every rank's endpoints."""
        publisher, self.run_dir = self.publisher, run_dir
        # under torchrun, named as the other nodes reach them (a rank bound to 0.0.0.0 by its
        # node's address): run.json is read from other hosts
        distributed = world_size > 1
        endpoints = {k: reachable(v) if distributed else v for k, v in publisher.start().items()}
        ranks_endpoints = agreement.gather(dict(endpoints))  # every rank, in step
        if self.rank == 0:
            self.control = ControlServer(host=self.host, context=self.context, curve=self.keys)
            publisher.count_refusals(self.control.refusals)  # heartbeats carry its counts
            control = self.control.start()
            endpoints["control"] = reachable(control) if distributed else control
            info = RunInfo(
                publisher.run_id,
                run_name,
                os.getpid(),
                time.time(),
                endpoints,
                host=socket.gethostname(),
                world_size=world_size,
                ranks=ranks_endpoints,
                extra={"config": config},
                curve_public=self.keys.public.decode() if self.keys else "",
            )
            write_run_info(run_dir, info)
            publisher.run_info = info.to_dict()
        publisher.set_config(config)

    def close(self, stop_workers: Callable[[], None], **finished: Any) -> None:
        """The publisher (its final heartbeats), then `stop_workers`, then the rest; rank 0
        marks run.json finished with `finished` (progress, stopped_by, checkpoints)."""
        self.publisher.close(linger=0.3)
        stop_workers()
        if self.control is not None:
            self.control.close()
        if self.authenticator is not None:
            self.authenticator.stop()
        self.context.term()
        if self.rank == 0 and self.run_dir is not None:
            try:
                mark_finished(self.run_dir, **finished)
            except Exception as exc:  # never fail a finished run over its run.json
                log.warning("offloop: could not mark %s finished: %s", self.run_dir, exc)
