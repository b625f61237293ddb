"""A run driven by another trainer's hooks (Lightning's, Hugging Face's): the same
sockets, workers, snapshots and control path as our Trainer, called from outside.

The integrations (`offloop.integrations`) map their framework's hooks to the calls
here; this module knows no framework. It publishes with the Trainer's rules: nothing
is built for an event no one wants, a step's loss is staged (never read with `.item()`
on a GPU), events leave in bursts, halts and checkpoints are agreed by every rank at the
same batch and answered once.
"""

from __future__ import annotations

import atexit
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from offloop.bus import Publisher, Timestamp, Topic
from offloop.trainer import arguments, distributed
from offloop.trainer.checkpoint import HostCheckpointer
from offloop.trainer.errors import ConfigError
from offloop.trainer.readings import StepReadings
from offloop.trainer.services import RunServices, ServiceSettings
from offloop.trainer.startup import name_run, run_config

__all__ = ["HookedRun"]


def _nothing(*args: Any) -> None:
    pass


_WANTS_NOTHING = frozenset().__contains__

#: save(path) writes the host trainer's checkpoint at `path`, on every rank, and returns
#: the path it wrote; None for a trainer that saves later itself (Hugging Face's: the
#: integration takes the agreed requests with due_requests() and answers them with saved())
Save = Callable[[Path], Path] | None


class HookedRun:
    """Everything a foreign training loop needs to publish as offloop's Trainer does.

    Built with the callbacks and the run's settings (checked at once, nothing started);
    `start()` once the host trainer has its model, optimizers and process group; then
    one call per hook; `close()` at the end (it is idempotent, and registered with atexit).
    After `start()`, `services` holds the run's services (RunServices, as the Trainer's),
    `controller` its Control and `control` its ControlServer (rank 0).
    """

    def __init__(self, callbacks: list | None = None, *, loggers: list | None = None,
                 run_name: str | None = None, run_dir: str | os.PathLike | None = None,
                 save_folder: str | os.PathLike | None = None, checkpoint_suffix: str = ".ckpt",
                 host: str = "127.0.0.1", keys: str | os.PathLike | None = None,
                 insecure: bool = False, heartbeat_interval: float = 0.5,
                 burst_interval: float = 0.005, worker_shutdown_timeout: float = 60.0,
                 worker_nice: int = 10, decision_timeout: float = 30.0,
                 hparams: dict | None = None) -> None:
        arguments.check_settings(precision="fp32", grad_accum=1, contiguous_grads="auto",
                                 publish_samples=0, burst_interval=burst_interval,
                                 worker_nice=worker_nice, decision_timeout=decision_timeout)
        arguments.check_run(callbacks, True, None, loggers)
        self.callbacks, self.loggers = list(callbacks or []), loggers
        self._names = (run_name, run_dir, save_folder)
        self.checkpoint_suffix = checkpoint_suffix
        # the host trainer owns its signals: no checkpoint on SIGTERM, no handler
        self.settings = ServiceSettings(
            host=host, keys=keys, insecure=insecure, heartbeat_interval=heartbeat_interval,
            burst_interval=float(burst_interval), worker_shutdown_timeout=worker_shutdown_timeout,
            worker_nice=worker_nice, decision_timeout=float(decision_timeout))
        self.hparams = dict(hparams or {})
        self.timestamp = Timestamp()
        self.started = False
        self.publisher: Publisher | None = None
        self._publishing(False)

    def _publishing(self, live: bool) -> None:
        """Bind the per-hook calls: the emitter's own while the run is live (the cheapest
        path, a host trainer calls them at every hook), nothing before start and after close."""
        if live:  # the emitter's snapshot checks what is wanted itself
            self._emit, self._snapshot, self.wants = \
                self.emitter.emit, self.emitter.snapshot, self.emitter.wants
        else:
            self._emit, self._snapshot, self.wants = _nothing, _nothing, _WANTS_NOTHING

    @property
    def timestamp(self) -> Timestamp:
        return self._timestamp

    @timestamp.setter
    def timestamp(self, ts: Timestamp) -> None:
        self._timestamp, self._now = ts, ts.wire  # the tuple every event carries

    # ------------------------------------------------------------------ start

    def start(self, model: torch.nn.Module, optimizers: list, device: torch.device, save: Save,
              *, max_duration: Any = None, train_dataloader: Any = None,
              seed: int | None = None, precision: str = "fp32", grad_accum: int = 1,
              extra_config: dict | None = None) -> None:
        """Sockets, run.json and the workers (rank 0), then init and before_load. The host
        trainer's process group, if any, is up: every rank calls this at the same point.
        Once the run has closed, a new start begins a new run (a host trainer's second fit:
        its run id, workers and sockets are new; run.json and its folder the same)."""
        if self.started:
            if not self.services.closed:
                return
            self.started, self.publisher, self.timestamp = False, None, Timestamp()
        self.rank, self.world_size = distributed.rank(), distributed.world_size()
        agreement = distributed.ControlAgreement()
        self.device, self.optimizers = device, list(optimizers)
        self.run_id, self.run_name, self.run_dir, self.save_folder = name_run(*self._names)
        self.config = run_config(
            model, run_name=self.run_name, run_id=self.run_id, seed=seed,
            max_duration=max_duration, train_dataloader=train_dataloader, eval_intervals={},
            eval_dataloaders={}, world_size=self.world_size, device=device, precision=precision,
            grad_accum=grad_accum, optimizers=self.optimizers,
            hparams=self.hparams) | dict(extra_config or {})
        checkpointer = HostCheckpointer(save, agreement, self.save_folder, rank=self.rank,
                                        suffix=self.checkpoint_suffix)
        self.services = services = RunServices(
            self.settings, callbacks=self.callbacks, loggers=self.loggers, builtins=None,
            run_id=self.run_id, run_name=self.run_name, run_dir=self.run_dir, config=self.config,
            rank=self.rank, world_size=self.world_size, agreement=agreement, device=device,
            checkpointer=checkpointer)
        self.publisher, self.control = services.publisher, services.server
        self.emitter, self.controller = services.emitter, services.control
        self._decisions = services.decisions
        self._readings = StepReadings(device, self.optimizers, self.emitter.host,
                                      per_param_grad_norms=False, publish_samples=0, flops_fn=None)
        self._readings.user_metrics.open()
        self.started = True  # from here close() has everything it closes
        try:
            services.start(handle_sigterm=False)
        except BaseException:
            self.close(wait_for_workers=False)
            raise
        self._publishing(True)
        atexit.register(self.close)
        self.emit(Topic.INIT, {"config": self.config})
        self.emit(Topic.BEFORE_LOAD)
        self.emitter.release()

    @property
    def closed(self) -> bool:
        return self.started and self.services.closed

    @property
    def checkpoints(self) -> list[str]:
        """Every checkpoint written for this run, in order."""
        return self.services.checkpoints if self.started else []

    # --------------------------------------------------------------- publishing

    @property
    def host_value(self) -> Callable[[torch.Tensor], Any]:
        """What a snapshot holds for a tensor (a number on the CPU; staged on CUDA)."""
        return self.emitter.host

    #: wants(topic): whether a subscriber or worker wants `topic` (build nothing for it
    #: otherwise); the emitter's own while the run is live (_publishing), else always False
    wants: Callable[[str], bool]

    def emit(self, topic: str, data: dict | None = None) -> None:
        """Publish `topic` with plain values (no tensors) at the current timestamp."""
        self._emit(topic, self._now, data)

    def snapshot(self, topic: str, data: dict) -> None:
        """Publish `topic` with values that may hold tensors (staged, never synchronised)."""
        self._snapshot(topic, self._now, data)

    def fire(self, topic: str, data: dict | None = None) -> None:
        """Publish a boundary event; where a worker decides on it, wait for its decision
        (an EarlyStopper's halt lands at the eval it judged, as in Composer)."""
        if self.started and not self.services.closed:
            self._decisions.fire(topic, self.timestamp, data)

    def set_timestamp(self, epoch: int, batch: int) -> None:
        """Start counting from the host trainer's own counters (a resumed run)."""
        if (epoch, batch) != (self.timestamp.epoch, self.timestamp.batch):
            self.timestamp = Timestamp(epoch=epoch, batch=batch)

    def fit_start(self) -> None:
        self.services.begin_fit()
        self.emit(Topic.FIT_START, {"config": self.config})

    def epoch_start(self) -> None:
        if self.timestamp.epoch_in_iteration == 0 and self.timestamp.batch_in_epoch == 0:
            self.emit(Topic.ITERATION_START)
        self.emit(Topic.EPOCH_START)

    def batch_end(self, loss: Any, size: int, tokens: int = 0, batch: Any = None) -> bool:
        """One optimizer step done: batch_end, the control poll (a halt or checkpoint
        agreed by every rank), batch_checkpoint. Whether the run must stop after it."""
        self.timestamp = ts = self._timestamp.to_next_batch(size, tokens)
        if self.wants(Topic.BATCH_END):
            self._snapshot(Topic.BATCH_END, self._now,
                           self._readings.batch_end(loss, size, ts.batch, batch, None, None))
        controller = self.controller
        controller.poll(ts)
        self.emitter.release_due()
        self._decisions.fire(Topic.BATCH_CHECKPOINT, ts)
        controller.save_due(Topic.BATCH_CHECKPOINT, ts)  # none where the host trainer saves later
        if self.emitter.cuda:
            self.emitter.poll()
        return controller.stop

    def epoch_end(self) -> bool:
        """The epoch's batches are done: epoch_end (a worker may decide on it); whether the
        run must stop. The epoch's evaluation, if any, comes next, then epoch_checkpoint()."""
        self.timestamp = self.timestamp.to_next_epoch()
        self.fire(Topic.EPOCH_END)
        return self.controller.stop

    def epoch_checkpoint(self) -> bool:
        """epoch_checkpoint (a CheckpointSaver decides on it); whether the run must stop."""
        self.fire(Topic.EPOCH_CHECKPOINT)
        return self.controller.stop

    def eval_end(self, label: str, metrics: dict[str, Any]) -> bool:
        """eval_end and eval_after_all with the host trainer's logged eval metrics (tensors
        staged); whether the run must stop (an EarlyStopper decides here)."""
        self.fire(Topic.EVAL_END, {"dataloader_label": label, "metrics": metrics})
        self.fire(Topic.EVAL_AFTER_ALL, {"metrics": {label: metrics}})
        self.emitter.release()
        return self.controller.stop

    @property
    def stop(self) -> bool:
        return self.started and self.controller.stop

    @property
    def stopped_by(self) -> dict[str, Any] | None:
        return self.controller.stopped_by if self.started else None

    def request_halt(self, reason: str) -> None:
        """In-process twin of a halt request (stop after the current batch)."""
        self.controller.request_halt(reason)

    # ------------------------------------------------------------ checkpoints

    def due_requests(self) -> tuple[bool, list]:
        """(whether a checkpoint is due, the requests it answers), agreed since the last
        call; for a trainer that saves later itself: it saves once for all of them, on
        every rank (on ranks but 0 one is due with no request), then saved() answers them."""
        controller = self.controller
        if not (controller.due or controller.checkpoints):
            return False, []
        return True, [request for group in controller.take_due() for request in group]

    def log_metrics(self, metrics: dict[str, Any]) -> None:
        """Values the host trainer logged (numbers or 0-d tensors): they go with the next
        batch_end as its metrics, as `offloop.log_metrics` does in offloop's Trainer."""
        self._readings.user_metrics.log(metrics)

    def saved(self, requests: list, path: Path, where: str) -> None:
        """Answer `requests` with the checkpoint the host trainer wrote at `path`."""
        self.services.checkpoints.append(str(path))
        self.controller.checkpoint_saved(requests, Path(path), "", where, self.timestamp)
        self.emitter.release()

    # ------------------------------------------------------------------ ending

    def fit_end(self) -> None:
        """fit_end (with who stopped the run and the checkpoints written), sent at once."""
        if not self.started or self.services.closed or self.services.fit_ended:
            return
        self.services.end_fit(self.timestamp)

    def close(self, wait_for_workers: bool = True) -> None:
        """Let every worker see fit_end, close the stream, mark run.json finished."""
        if not self.started or self.services.closed:
            return
        atexit.unregister(self.close)
        self._publishing(False)
        self.services.close(self.timestamp, wait_for_workers)


def check_callbacks(callbacks: Any) -> list:
    """The offloop callbacks an integration was given, as a list (ConfigError otherwise)."""
    if callbacks is None:
        return []
    if not isinstance(callbacks, (list, tuple)):
        raise ConfigError("callbacks must be a list of offloop callbacks, "
                          f"got {type(callbacks).__name__}")
    return list(callbacks)
