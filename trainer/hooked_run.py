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
from offloop.trainer import arguments, checkpoint, distributed
from offloop.trainer.control import Control
from offloop.trainer.decisions import Decisions
from offloop.trainer.errors import CheckpointError, ConfigError
from offloop.trainer.readings import StepReadings
from offloop.trainer.snapshot import Emitter
from offloop.trainer.startup import RunSockets, check_keys, name_run, run_config
from offloop.trainer.supervisor import CallbackWorkers

__all__ = ["HookedRun"]

#: save(path) writes the host trainer's checkpoint at `path`, on every rank, and returns
#: the path it wrote; None for a trainer that saves later itself (Hugging Face's: the
#: integration takes the agreed requests with due_requests() and answers them with saved())
Save = Callable[[Path], Path] | None


class HookedRun:
    """Everything a foreign training loop needs to publish as offloop's Trainer does.

    Built with the callbacks and the run's settings (checked at once, nothing started);
    `start()` once the host trainer has its model, optimizers and process group; then
    one call per hook; `close()` at the end (it is idempotent, and registered with atexit).
    """

    def __init__(self, callbacks: list | None = None, *, loggers: list | None = None,
                 run_name: str | None = None, run_dir: str | os.PathLike | None = None,
                 save_folder: str | os.PathLike | None = None, checkpoint_suffix: str = ".ckpt",
                 host: str = "127.0.0.1", keys: str | os.PathLike | None = None, insecure: bool = False,
                 heartbeat_interval: float = 0.5, burst_interval: float = 0.005,
                 worker_shutdown_timeout: float = 60.0, worker_nice: int = 10,
                 decision_timeout: float = 30.0, hparams: dict | None = None) -> None:
        arguments.check_settings(precision="fp32", grad_accum=1, contiguous_grads="auto", publish_samples=0,
                                 burst_interval=burst_interval, worker_nice=worker_nice,
                                 decision_timeout=decision_timeout)
        arguments.check_run(callbacks, True, None, loggers)
        self.callbacks, self.loggers = list(callbacks or []), loggers
        self._names = (run_name, run_dir, save_folder)
        self.checkpoint_suffix = checkpoint_suffix
        self.host, self.keys, self.insecure = host, keys, insecure
        self.heartbeat_interval, self.burst_interval = heartbeat_interval, float(burst_interval)
        self.worker_shutdown_timeout, self.worker_nice = worker_shutdown_timeout, worker_nice
        self.decision_timeout = float(decision_timeout)
        self.hparams = dict(hparams or {})
        self.timestamp = Timestamp()
        self.started = self.closed = False
        self.checkpoints: list[str] = []
        self.publisher: Publisher | None = None

    # ------------------------------------------------------------------ start

    def start(self, model: torch.nn.Module, optimizers: list, device: torch.device, save: Save, *,
              max_duration: Any = None, train_dataloader: Any = None, seed: int | None = None,
              precision: str = "fp32", grad_accum: int = 1, extra_config: dict | None = None) -> None:
        """Sockets, run.json and the workers (rank 0), then init and before_load. The host
        trainer's process group, if any, is up: every rank calls this at the same point."""
        if self.started:
            return
        self.rank, self.world_size = distributed.rank(), distributed.world_size()
        self._agreement = distributed.ControlAgreement()
        self.device, self.optimizers, self._save = device, list(optimizers), save
        self.run_id, self.run_name, self.run_dir, self.save_folder = name_run(*self._names)
        server_keys = check_keys(self.keys, self.host, self.insecure)
        self.config = run_config(model, run_name=self.run_name, run_id=self.run_id, seed=seed,
                                 max_duration=max_duration, train_dataloader=train_dataloader,
                                 eval_intervals={}, eval_dataloaders={}, world_size=self.world_size,
                                 device=device, precision=precision, grad_accum=grad_accum,
                                 optimizers=self.optimizers, hparams=self.hparams) | dict(extra_config or {})
        self.workers = CallbackWorkers(self.callbacks, str(self.run_dir), loggers=self.loggers,
                                       keys=server_keys.client_keys("workers") if server_keys else None,
                                       heartbeat_timeout=max(3.0, 10 * self.heartbeat_interval),
                                       nice=self.worker_nice)
        self._sockets = RunSockets(self.run_id, server_keys, rank=self.rank, host=self.host,
                                   heartbeat_interval=self.heartbeat_interval)
        self._sockets.start(self._agreement, self.run_dir, self.run_name, self.world_size, self.config)
        self.publisher = self._sockets.publisher
        self.emitter = Emitter(self.publisher, device, self.burst_interval)
        self.controller = Control(self._sockets.control, self._agreement, self.emitter.emit,
                                  checkpoint_on_sigterm=False,  # the host trainer owns its signals
                                  saves_after_fit=self.rank == 0 and self.world_size == 1,
                                  write=self._write, now=lambda: self.timestamp, release=self.emitter.release)
        self._decisions = Decisions(self.workers.decision_schedule if self.world_size == 1 else {},
                                    self.decision_timeout, self.emitter, self.workers, self._sockets.control,
                                    self._serve)
        self._readings = StepReadings(device, self.optimizers, self.emitter.host, per_param_grad_norms=False,
                                      publish_samples=0, flops_fn=None)
        self.started = True  # from here close() has everything it closes
        try:
            if self.rank == 0:
                self.workers.start()  # every worker listens before init is published
        except BaseException:
            self.close(wait_for_workers=False)
            raise
        atexit.register(self.close)
        self.emit(Topic.INIT, {"config": self.config})
        self.emit(Topic.BEFORE_LOAD)
        self.emitter.release()

    # --------------------------------------------------------------- publishing

    @property
    def host_value(self) -> Callable[[torch.Tensor], Any]:
        """What a snapshot holds for a tensor (a number on the CPU; staged on CUDA)."""
        return self.emitter.host

    def wants(self, topic: str) -> bool:
        """Whether a subscriber or worker wants `topic`: build nothing for it otherwise."""
        return self.started and not self.closed and self.emitter.wants(topic)

    def emit(self, topic: str, data: dict | None = None) -> None:
        """Publish `topic` with plain values (no tensors) at the current timestamp."""
        if self.started and not self.closed:
            self.emitter.emit(topic, self.timestamp.as_tuple(), data)

    def snapshot(self, topic: str, data: dict) -> None:
        """Publish `topic` with values that may hold tensors (staged, never synchronised)."""
        if self.wants(topic):
            self.emitter.snapshot(topic, self.timestamp.as_tuple(), data)

    def fire(self, topic: str, data: dict | None = None) -> None:
        """Publish a boundary event; where a worker decides on it, wait for its decision
        (an EarlyStopper's halt lands at the eval it judged, as in Composer)."""
        if self.started and not self.closed:
            self._decisions.fire(topic, self.timestamp, data)

    def set_timestamp(self, epoch: int, batch: int) -> None:
        """Start counting from the host trainer's own counters (a resumed run)."""
        if (epoch, batch) != (self.timestamp.epoch, self.timestamp.batch):
            self.timestamp = Timestamp(epoch=epoch, batch=batch)

    def fit_start(self) -> None:
        self.controller.begin_fit()
        self.emit(Topic.FIT_START, {"config": self.config})

    def epoch_start(self) -> None:
        if self.timestamp.epoch_in_iteration == 0 and self.timestamp.batch_in_epoch == 0:
            self.emit(Topic.ITERATION_START)
        self.emit(Topic.EPOCH_START)

    def batch_end(self, loss: Any, size: int, tokens: int = 0, batch: Any = None) -> bool:
        """One optimizer step done: batch_end, the control poll (a halt or checkpoint
        agreed by every rank), batch_checkpoint. Whether the run must stop after it."""
        self.timestamp = self.timestamp.to_next_batch(size, tokens)
        if self.wants(Topic.BATCH_END):
            self.snapshot(Topic.BATCH_END, self._readings.batch_end(loss, size, self.timestamp.batch, batch,
                                                                    None, None))
        controller = self.controller
        controller.poll(self.timestamp)
        self.emitter.release_due()
        self._decisions.fire(Topic.BATCH_CHECKPOINT, self.timestamp)
        if controller.due and self._save is not None:
            controller.save("batch_checkpoint", controller.take_due())
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

    def _serve(self, where: str) -> None:
        """While the loop waits at a decision: a halt is applied; a checkpoint written now, or
        left for due_requests() where the host trainer saves later."""
        if self._save is not None:
            self.controller.serve(where)
        else:
            self.controller.poll(self.timestamp)

    def _write(self, requests: list) -> tuple[Path, str]:
        """A checkpoint of this step through the host trainer, on every rank (rank 0's name)."""
        if self._save is None:  # only after the fit (answer_late): the host trainer no longer saves
            raise CheckpointError("the run has finished: this trainer saves only while it trains")
        tag, filename = checkpoint.requested_name(requests)
        name = filename or checkpoint.step_name(self.timestamp, tag, self.checkpoint_suffix)
        taken = ""  # as offloop's Trainer: never written over, rank 0's name for every rank
        if self.rank == 0:
            name, taken = checkpoint.unused_name(self.save_folder, name, explicit=filename is not None)
        if self._agreement.active:
            name, tag, taken = self._agreement.gather((name, tag, taken))[0]
        checkpoint.check_filename(name)
        if taken:
            raise CheckpointError(taken)
        try:
            path = self._save(self.save_folder / name)
        except Exception as exc:  # a full disk, a refused path: refused, training goes on
            raise CheckpointError(f"checkpoint {name} could not be written: {exc}") from exc
        self.checkpoints.append(str(path))
        return Path(path), tag

    def due_requests(self) -> tuple[bool, list]:
        """(whether a checkpoint is due, the requests it answers), agreed since the last
        call, for a trainer that saves later itself: it saves once for all of them, on
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
        self.checkpoints.append(str(path))
        self.controller.checkpoint_saved(requests, Path(path), "", where, self.timestamp)
        self.emitter.release()

    # ------------------------------------------------------------------ ending

    def fit_end(self) -> None:
        """fit_end (with who stopped the run and the checkpoints written), sent at once."""
        if not self.started or self.closed or self.controller.fit_ended:
            return
        controller = self.controller
        controller.refuse_pending(self.timestamp)
        controller.in_fit = False
        self.workers.fits += 1
        self.emitter.emit(Topic.FIT_END, self.timestamp.as_tuple(),
                          {"stopped_by": controller.stopped_by, "checkpoints": self.checkpoints,
                           "fit": self.workers.fits})
        self.emitter.flush()
        controller.fit_ended = True

    def close(self, wait_for_workers: bool = True) -> None:
        """Let every worker see fit_end, close the stream, mark run.json finished."""
        if not self.started or self.closed:
            return
        self.closed = True
        atexit.unregister(self.close)
        controller, workers = self.controller, self.workers
        workers.closing = True
        if workers.workers and wait_for_workers and controller.fit_ended:
            workers.wait_for_fit_end(self.worker_shutdown_timeout, controller.answer_late, self.timestamp.batch)
        controller.answer_late()
        ts = self.timestamp
        self._sockets.close(workers.stop, stopped_by=controller.stopped_by, checkpoints=self.checkpoints,
                            progress={"epoch": ts.epoch, "batch": ts.batch, "sample": ts.sample, "token": ts.token})


def check_callbacks(callbacks: Any) -> list:
    """The offloop callbacks an integration was given, as a list (ConfigError otherwise)."""
    if callbacks is None:
        return []
    if not isinstance(callbacks, (list, tuple)):
        raise ConfigError(f"callbacks must be a list of offloop callbacks, got {type(callbacks).__name__}")
    return list(callbacks)
