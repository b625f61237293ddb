"""The Trainer: Composer's training loop, publishing a snapshot at every event.

Read `_train_batch` for what happens in one batch and `_fit_loop` for the order of the
events around it; every event is fired where it happens, in Composer's order.
"""

from __future__ import annotations

import atexit
import os
import random
import signal
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from offloop.bus import GRAD_NORMS, Time, Timestamp, TimeUnit, Topic
from offloop.trainer import arguments, batches, checkpoint, distributed
from offloop.trainer.algorithms.engine import EVENT_TOPICS, Engine, LoopState, check_algorithms
from offloop.trainer.errors import ConfigError, TrainerError
from offloop.trainer.grads import GradBuffer
from offloop.trainer.readings import StepReadings
from offloop.trainer.services import RunServices, ServiceSettings
from offloop.trainer.snapshot import host_for
from offloop.trainer.startup import name_run, run_config

__all__ = ["Trainer"]

class Trainer:
    """Composer-shaped trainer; callbacks run in worker processes, not in this loop.

    Args mirror `composer.Trainer`: `model` either follows Composer's protocol
    (`outputs = model(batch)`, `loss = model.loss(outputs, batch)`) or is any
    `nn.Module` used with `loss_fn=` on `(input, target)` batches. Durations are
    Composer time strings ('3ep', '500ba', '10000sp', '1000tok').
    """

    def __init__(
        self,
        model: nn.Module,
        train_dataloader: Iterable | None = None,
        max_duration: str | Time | None = None,
        *,
        optimizers: torch.optim.Optimizer | list | None = None,
        schedulers: Any = None,
        eval_dataloader: Iterable | Mapping[str, Iterable] | None = None,
        eval_interval: str | int | Time | Mapping[str, str | int | Time] = 1,
        eval_metrics: Any = None, loss_fn: Callable | None = None,
        callbacks: list | None = None, loggers: list | None = None, algorithms: list | None = None,
        run_name: str | None = None, run_dir: str | os.PathLike | None = None,
        device: str | torch.device = "auto",
        precision: str = "fp32",
        grad_accum: int = 1, device_train_microbatch_size: int | str | None = None,
        load_path: str | os.PathLike | None = None, save_folder: str | os.PathLike | None = None,
        save_filename: str | None = "ep{epoch}-ba{batch}-rank{rank}.pt",
        save_latest_filename: str | None = "latest-rank{rank}.pt",
        save_interval: str | int | Time | None = "1ep",
        save_num_checkpoints_to_keep: int = -1, autoresume: bool = False,
        seed: int | None = None, iteration_length: int | None = None,
        progress_bar: bool = True, log_to_console: bool = False, console_stream: str = "stderr",
        num_tokens_fn: Callable[[Any], int] | None = None,
        publish: bool = True, publish_eval_outputs: bool = False, publish_samples: int = 0,
        per_param_grad_norms: bool = False, contiguous_grads: bool | str = "auto",
        hparams: Mapping[str, Any] | None = None,
        host: str = "127.0.0.1", keys: str | os.PathLike | None = None, insecure: bool = False,
        heartbeat_interval: float = 0.5, burst_interval: float = 0.005,
        checkpoint_on_sigterm: bool = True, worker_shutdown_timeout: float = 60.0,
        worker_nice: int = 10, decision_timeout: float = 30.0,
    ) -> None:
        # what can be known now fails now, before a socket, a worker or run.json exists
        arguments.check_settings(precision=precision, grad_accum=grad_accum,
                                 contiguous_grads=contiguous_grads, publish_samples=publish_samples,
                                 burst_interval=burst_interval, worker_nice=worker_nice,
                                 decision_timeout=decision_timeout)
        self.microbatch_size = arguments.microbatch_size(device_train_microbatch_size, grad_accum)
        self.max_duration = (arguments.parse_duration("max_duration", max_duration)
                             if max_duration else None)
        arguments.check_model(model, loss_fn, self.max_duration, num_tokens_fn)
        arguments.check_run(callbacks, publish, load_path, loggers)
        self.algorithms = check_algorithms(algorithms)

        self.device = arguments.resolve_device(device, distributed.local_rank())
        self.rank = distributed.rank() if distributed.init_from_env(self.device) else 0
        self.world_size = distributed.world_size()
        agreement = distributed.ControlAgreement()  # every rank's say in control decisions
        self._device_type = self.device.type  # read per batch: torch.device.type builds a new str
        self.seed = seed if seed is not None else random.randrange(2**31)
        checkpoint.seed_everything(self.seed)
        self._set_up_training(model, train_dataloader, optimizers, schedulers, eval_dataloader,
                              eval_interval, eval_metrics, loss_fn, precision, grad_accum)
        self.iteration_length, self.num_tokens_fn = iteration_length, num_tokens_fn
        self.publish_eval_outputs = publish_eval_outputs
        self.per_param_grad_norms = per_param_grad_norms
        self.contiguous_grads, self.publish_samples = contiguous_grads, publish_samples
        self.timestamp = Timestamp()
        self.run_id, self.run_name, self.run_dir, self.save_folder = name_run(
            run_name, run_dir, save_folder)
        builtins, load_path = arguments.worker_builtins(
            save_folder, self.save_folder, save_filename, save_latest_filename, save_interval,
            save_num_checkpoints_to_keep, autoresume, run_name, load_path, publish,
            (progress_bar, log_to_console, console_stream))
        self.hparams = dict(hparams or {})
        self._checkpointer = checkpoint.Checkpointer(self._parts, agreement, self.save_folder,
                                                     rank=self.rank, seed=self.seed,
                                                     run_name=self.run_name)
        self.checkpoints = self._checkpointer.written
        self.keys = Path(keys) if keys else None
        #: what the step snapshots hold beyond the loss (StepReadings); its `user_metrics`
        #: holds what log_metrics() logged that no snapshot has taken yet
        self.readings = StepReadings(self.device, self.optimizers, host_for(self.device),
                                     per_param_grad_norms=per_param_grad_norms,
                                     publish_samples=publish_samples,
                                     flops_fn=getattr(self._bare_model, "flops_per_batch", None))
        engine = Engine(self.algorithms, LoopState(self), self.readings.user_metrics)
        self.algorithm_seconds = engine.spent  # each algorithm's time on the training thread
        settings = ServiceSettings(
            host=host, keys=keys, insecure=insecure, heartbeat_interval=heartbeat_interval,
            burst_interval=burst_interval, worker_shutdown_timeout=worker_shutdown_timeout,
            worker_nice=worker_nice, decision_timeout=decision_timeout,
            checkpoint_on_sigterm=checkpoint_on_sigterm)
        #: the run's sockets, workers, emitter, control path and decision waits (RunServices)
        self.services = services = RunServices(
            settings, callbacks=callbacks or [], loggers=loggers, builtins=builtins,
            run_id=self.run_id, run_name=self.run_name, run_dir=self.run_dir, config=self.config(),
            rank=self.rank, world_size=self.world_size, agreement=agreement, device=self.device,
            checkpointer=self._checkpointer, publish=publish,
            # in the loop on purpose: each algorithm runs before its events are published
            run_first=(engine.run, EVENT_TOPICS) if self.algorithms else None)
        self.readings.user_metrics.open()  # log_metrics() comes here from now on
        self.workers, self.publisher = services.workers, services.publisher
        self.control = services.server  # the ControlServer (rank 0; None without publish)
        self.emitter, self.controller = services.emitter, services.control
        self._decisions = services.decisions
        self.worker_shutdown_timeout = worker_shutdown_timeout
        try:
            self._start(load_path)
        except BaseException:
            # no fit will follow: end the stream and the workers now, mark the run finished
            self.close(wait_for_workers=False)
            raise

    def _set_up_training(self, model, train_dataloader, optimizers, schedulers, eval_dataloader,
                         eval_interval, eval_metrics, loss_fn, precision, grad_accum) -> None:
        """The model on its device (wrapped in DDP under torchrun), optimizers, data, metrics."""
        self.model = model.to(self.device)
        ddp = nn.parallel.DistributedDataParallel
        if self.world_size > 1 and not isinstance(model, ddp):
            self.model = ddp(self.model)
        self._bare_model = self.model.module if isinstance(self.model, ddp) else self.model
        self.optimizers = (arguments.as_list(optimizers)
                           or [torch.optim.SGD(self.model.parameters(), lr=0.1)])
        self.schedulers = arguments.as_list(schedulers)
        self.train_dataloader = train_dataloader
        self.eval_dataloaders = arguments.eval_loaders(eval_dataloader)
        self.eval_intervals = arguments.eval_intervals(eval_interval, self.eval_dataloaders)
        self._eval_every_batch = any(i.unit is TimeUnit.BATCH for i in self.eval_intervals.values())
        self.eval_metrics = arguments.eval_metrics(eval_metrics, self.device,
                                                   self._bare_model if loss_fn is None else None)
        self.loss_fn, self.precision, self.grad_accum = loss_fn, precision, grad_accum
        # each microbatch's events share one dict, never modified (published as it is)
        self._micro_data = tuple({"microbatch": i} for i in range(grad_accum))
        #: the loss scaler (amp_fp16 only: fp16 gradients underflow without it; bf16 has
        #: fp32's range), saved with every checkpoint; None otherwise
        self.scaler = torch.amp.GradScaler(self.device.type) if precision == "amp_fp16" else None
        self._parts = checkpoint.Parts(self._bare_model, self.optimizers, self.schedulers,
                                       self.scaler, self.algorithms)
        #: the gradients' contiguous buffer (grads.py) this fit adopted after its first
        #: backward; None before, where it would change what the optimizer sees, or given up
        self.grad_buffer: GradBuffer | None = None
        #: True until the fit's first step has decided whether to adopt the buffer
        self.grad_buffer_pending = False
        #: the last step's loss: its graph keeps the gradient accumulators for the next forward
        #: to reuse, as a hand-written loop's `loss` does (docs/trainer.md)
        self._last_graph: torch.Tensor | None = None

    def _start(self, load_path: str | os.PathLike | None) -> None:
        """Workers listening, then init, before_load, the checkpoint, after_load."""
        # SIGTERM: fit_end always; checkpoint_on_sigterm decides the checkpoint
        self.services.start(handle_sigterm=True)
        atexit.register(self.close)
        emit, now = self.emitter.emit, self.timestamp.as_tuple()
        emit(Topic.INIT, now, {"config": self.config()})
        # as in Composer, both fire on every run, with a checkpoint to load or not
        emit(Topic.BEFORE_LOAD, now)
        if load_path is not None:
            self.timestamp = self._checkpointer.restore(load_path)
        path = str(load_path) if load_path is not None else None
        emit(Topic.AFTER_LOAD, self.timestamp.as_tuple(), {"path": path})
        self.emitter.release()

    def config(self) -> dict[str, Any]:
        """The run config: what a late joiner and every `init`/`fit_start` carries."""
        return run_config(self._bare_model, run_name=self.run_name, run_id=self.run_id,
                          seed=self.seed, max_duration=self.max_duration,
                          train_dataloader=self.train_dataloader,
                          eval_intervals=self.eval_intervals,
                          eval_dataloaders=self.eval_dataloaders, world_size=self.world_size,
                          device=self.device, precision=self.precision,
                          grad_accum=self.grad_accum, optimizers=self.optimizers,
                          hparams=self.hparams)

    @property
    def stopped_by(self) -> dict[str, Any] | None:
        """Who halted the run (reason, client, step), or None."""
        return self.controller.stopped_by

    # --------------------------------------------------------------- fit loop

    def fit(self, *, duration: str | Time | None = None) -> None:
        """Train until max_duration (or a halt); fires FIT_START … FIT_END."""
        self._check_open("fit")
        self.max_duration = arguments.fit_duration(duration, self.max_duration,
                                                   self.train_dataloader)
        services, completed = self.services, False
        services.begin_fit()
        try:
            self._fit_loop()
            self.controller.end_loop(self.timestamp)  # a SIGTERM's checkpoint, if still owed
            completed = True
        finally:  # returns once every checkpoint taken is durable
            self._last_graph = None
            services.end_fit(self.timestamp, wait_for_progress_bars=True, completed=completed)
        if self.controller.sigterm:
            self.close()
            raise SystemExit(128 + signal.SIGTERM)

    def _fit_loop(self) -> None:
        control, max_duration, emit = self.controller, self.max_duration, self.emitter.emit
        emit(Topic.FIT_START, self.timestamp.as_tuple(), {"config": self.config()})
        self.model.train()
        self.readings.track(list(self.model.named_parameters()))
        self.grad_buffer = None
        self.grad_buffer_pending = self.contiguous_grads is True or (
            self.contiguous_grads == "auto" and GradBuffer.pays_off(self.readings.params))
        while not control.stop and not max_duration.reached(self.timestamp):
            ts = self.timestamp
            if ts.epoch_in_iteration == 0 and ts.batch_in_epoch == 0:
                emit(Topic.ITERATION_START, ts.as_tuple())
            if ts.batch_in_epoch == 0:
                emit(Topic.EPOCH_START, ts.as_tuple())
            finished_early = False
            for batch in self._epoch_batches():
                self._train_batch(batch)
                if control.stop or max_duration.reached(self.timestamp):
                    finished_early = True
                    break
            if (not finished_early or self.timestamp.batch_in_epoch
                    == batches.loader_len(self.train_dataloader)):
                self.timestamp = ts = self.timestamp.to_next_epoch()
                # each fire() waits where a callback decides
                self._decisions.fire(Topic.EPOCH_END, ts)
                self._run_evaluators(TimeUnit.EPOCH)
                self._decisions.fire(Topic.EPOCH_CHECKPOINT, ts)
                if self.iteration_length and ts.epoch_in_iteration == self.iteration_length:
                    self.timestamp = ts = ts.to_next_iteration()
                    self._decisions.fire(Topic.ITERATION_END, ts)
                    self._decisions.fire(Topic.ITERATION_CHECKPOINT, ts)

    def _epoch_batches(self):
        """The epoch's batches; on resume, the batches already trained are skipped."""
        emit = self.emitter.emit
        emit(Topic.BEFORE_DATALOADER, self.timestamp.wire)
        for batch in self._checkpointer.epoch_batches(self.train_dataloader, self.timestamp.epoch):
            emit(Topic.AFTER_DATALOADER, self.timestamp.wire)
            yield batch
            emit(Topic.BEFORE_DATALOADER, self.timestamp.wire)

    def _train_batch(self, batch: Any) -> None:
        """One optimizer step, every event of it in Composer's order (its microbatches' in
        _train_microbatches)."""
        emitter = self.emitter
        emit, snapshot, wants = emitter.emit, emitter.snapshot, emitter.wants
        if self._device_type != "cpu":
            batch = batches.to_device(batch, self.device)
        size = batches.batch_size(batch)
        now = self.timestamp.wire  # as_tuple() without its call
        accum = (self.grad_accum if self.microbatch_size is None
                 else -(-size // self.microbatch_size))
        emit(Topic.BATCH_START, now, {"batch_size": size})
        emit(Topic.BEFORE_TRAIN_BATCH, now, {"batch_size": size, "microbatches": accum})
        loss, micro, outputs = self._train_microbatches(batch, size, accum, now)
        scaler = self.scaler
        if scaler is not None:  # Composer unscales before after_train_batch: true norms
            for opt in self.optimizers:
                scaler.unscale_(opt)
        if wants(GRAD_NORMS):  # asked for by name only: a norm is a pass over every gradient
            snapshot(GRAD_NORMS, now, self.readings.grad_norms(self.grad_buffer))
        if wants(Topic.AFTER_TRAIN_BATCH):
            snapshot(Topic.AFTER_TRAIN_BATCH, now, {"loss": loss})
        for opt in self.optimizers:
            if scaler is not None:
                scaler.step(opt)  # skipped when a gradient overflowed
            else:
                opt.step()
        if scaler is not None:
            scaler.update()
        for scheduler in self.schedulers:
            scheduler.step()
        tokens = self.num_tokens_fn(batch) if self.num_tokens_fn else 0
        self.timestamp = ts = self.timestamp.to_next_batch(size, tokens)
        now = ts.wire
        if wants(Topic.BATCH_END):
            snapshot(Topic.BATCH_END, now,
                     self.readings.batch_end(loss, size, ts.batch, batch, micro, outputs))
        control = self.controller
        control.poll(ts)  # a halt applied here stops the loop after this batch
        emitter.release_due()  # this batch's events, with the last ones if the interval has passed
        if self._eval_every_batch:
            self._run_evaluators(TimeUnit.BATCH)
        self._decisions.fire(Topic.BATCH_CHECKPOINT, ts)
        if control.due:  # asked for by this batch's poll (a decision's are saved as it waits)
            control.save_due(Topic.BATCH_CHECKPOINT, ts)
        if emitter.cuda:
            emitter.poll()

    def _train_microbatches(self, batch: Any, size: int, accum: int,
                            now: tuple) -> tuple[Any, Any, Any]:
        """The gradients zeroed, then each microbatch's forward, loss and backward, its
        loss weighted by its share of the batch. Returns the step's loss as its snapshots
        hold it (None where none is wanted), and the last microbatch with its outputs."""
        emitter, scaler, grads = self.emitter, self.scaler, self.grad_buffer
        emit, snapshot, wants, host = emitter.emit, emitter.snapshot, emitter.wants, emitter.host
        if grads is not None:
            grads.zero()
        else:
            for opt in self.optimizers:
                opt.zero_grad(set_to_none=True)
        if accum > len(self._micro_data):  # a batch of more microbatches than any before it
            self._micro_data = tuple({"microbatch": i} for i in range(accum))
        micros = (batch,) if accum == 1 else batches.split(batch, accum, self.microbatch_size)
        total = read = None
        for i, micro in enumerate(micros):
            micro_data = self._micro_data[i]
            emit(Topic.BEFORE_FORWARD, now, micro_data)
            if self.precision == "fp32":
                outputs, loss = self._train_microbatch(micro, now, micro_data)
            else:  # forward and loss only: backward runs outside autocast
                with arguments.autocast(self.precision, self._device_type):
                    outputs, loss = self._train_microbatch(micro, now, micro_data)
            if wants(Topic.AFTER_LOSS):  # the microbatch's own loss, as Composer's state.loss here
                read = host(loss)
                snapshot(Topic.AFTER_LOSS, now, {"microbatch": i, "loss": read})
            if accum > 1:  # weighted by the microbatch's share, for backward and the total
                loss = loss * (batches.batch_size(micro) / size)
                total = loss.detach() if total is None else total + loss.detach()
            emit(Topic.BEFORE_BACKWARD, now, micro_data)
            (scaler.scale(loss) if scaler is not None else loss).backward()
            emit(Topic.AFTER_BACKWARD, now, micro_data)
        self._last_graph = loss
        if grads is not None:
            if not grads.settle():  # a .grad was replaced: the buffer no longer holds them
                self.grad_buffer = None
        elif self.grad_buffer_pending:  # the fit's first step: into one buffer from now on
            self.grad_buffer_pending = False
            self.grad_buffer = GradBuffer.adopt(self.model, self.readings.params, self.optimizers)
        if accum == 1 and read is not None:  # after_loss has read the step's loss already
            return read, micro, outputs
        if wants(Topic.BATCH_END) or wants(Topic.AFTER_TRAIN_BATCH):  # read once, for both
            return host(loss if accum == 1 else total), micro, outputs
        return None, micro, outputs

    def _train_microbatch(self, micro: Any, now: tuple, micro_data: dict) -> tuple[Any, Any]:
        """A training microbatch's forward pass and loss, with the events between them
        (one call a microbatch: on a small model each Python call is a share of the step)."""
        emit, loss_fn = self.emitter.emit, self.loss_fn
        if loss_fn is None:  # Composer's protocol: the model takes the batch, its loss() scores it
            inputs = micro
        else:  # an (input, target) pair; batches.pair() names what else it got (its first
            # branch inline: a call is a measurable share of a small step, trainer_overhead.py)
            inputs, targets = (micro if isinstance(micro, (tuple, list)) and len(micro) == 2
                               else batches.pair(micro))
        outputs = self.model(inputs)
        emit(Topic.AFTER_FORWARD, now, micro_data)
        emit(Topic.BEFORE_LOSS, now, micro_data)
        if loss_fn is None:
            return outputs, self._bare_model.loss(outputs, micro)
        return outputs, loss_fn(outputs, targets)

    # -------------------------------------------------------------- checkpoints

    def request_halt(self, reason: str = "") -> None:
        """In-process twin of a halt request: stop after the current batch."""
        self.controller.request_halt(reason)

    def save_checkpoint(self, tag: str = "", filename: str | None = None) -> Path:
        """Write a checkpoint now, returned once durable (rank 0 writes; every rank must call
        it at the same step); a requested one still being written is finished first."""
        return self._checkpointer.write(self.timestamp, tag, filename)[0]

    # --------------------------------------------------------------------- eval

    def _run_evaluators(self, unit: TimeUnit) -> None:
        """Evaluate every dataloader whose interval (in `unit`) is due, as Composer does:
        EVAL_BEFORE_ALL, each evaluation, EVAL_AFTER_ALL — nothing when none is due."""
        count = self.timestamp.epoch if unit is TimeUnit.EPOCH else self.timestamp.batch
        due = [label for label, interval in self.eval_intervals.items()
               if interval.unit is unit and count % interval.value == 0]
        if not due:
            return
        self.emitter.emit(Topic.EVAL_BEFORE_ALL, self.timestamp.as_tuple())
        results = {label: self._evaluate(label, self.eval_dataloaders[label]) for label in due}
        self._decisions.fire(Topic.EVAL_AFTER_ALL, self.timestamp, {"metrics": results})
        self.model.train()

    def _evaluate(self, label: str, loader: Iterable) -> dict[str, Any]:
        ts, emitter, bare = self.timestamp.as_tuple(), self.emitter, self._bare_model
        emit = emitter.emit
        for metric in self.eval_metrics.values():
            metric.reset()
        emit(Topic.EVAL_START, ts, {"dataloader_label": label})
        self.model.eval()
        loss_sum, count = None, 0
        with torch.no_grad():
            for batch in loader:
                batch = batches.to_device(batch, self.device)
                emit(Topic.EVAL_BATCH_START, ts, {"dataloader_label": label})
                emit(Topic.EVAL_BEFORE_FORWARD, ts, {"dataloader_label": label})
                with arguments.autocast(self.precision, self._device_type):
                    outputs = batches.eval_forward(self.model, bare, self.loss_fn, batch)
                emit(Topic.EVAL_AFTER_FORWARD, ts, {"dataloader_label": label})
                batch_loss, size, data = batches.eval_results(
                    bare, self.loss_fn, self.eval_metrics, batch, outputs,
                    self.publish_eval_outputs)
                loss_sum = batch_loss if loss_sum is None else loss_sum + batch_loss
                count += size
                emitter.emit_tensors(Topic.EVAL_BATCH_END, ts, {"dataloader_label": label, **data})
                emitter.release_due()
        metrics = {name: metric.compute() for name, metric in self.eval_metrics.items()}
        metrics |= self.readings.user_metrics.take()  # what the model logged while evaluating
        if loss_sum is not None:
            metrics["loss"] = loss_sum / max(count, 1)
        self._decisions.fire(Topic.EVAL_END, self.timestamp,
                             {"dataloader_label": label, "metrics": metrics})
        emitter.release()
        return metrics

    def eval(self, eval_dataloader: Iterable | Mapping[str, Iterable] | None = None) -> dict:
        """Standalone evaluation: EVAL_STANDALONE_START … EVAL_STANDALONE_END."""
        self._check_open("eval")
        loaders = (arguments.eval_loaders(eval_dataloader) if eval_dataloader is not None
                   else self.eval_dataloaders)
        if not loaders:
            raise ConfigError("eval() needs an eval_dataloader (here or in Trainer)")
        ts = self.timestamp.as_tuple()
        self.emitter.emit(Topic.EVAL_STANDALONE_START, ts)
        results = {label: self._evaluate(label, loader) for label, loader in loaders.items()}
        self.emitter.emit_tensors(Topic.EVAL_STANDALONE_END, ts, {"metrics": results})
        self.emitter.flush()
        return {label: {k: batches.scalar(v) for k, v in m.items()} for label, m in results.items()}

    def predict(self, dataloader: Iterable, return_outputs: bool = True) -> list:
        """Run the model over `dataloader`: PREDICT_START … PREDICT_END."""
        self._check_open("predict")
        ts, emit = self.timestamp.as_tuple(), self.emitter.emit
        emit(Topic.PREDICT_START, ts)
        self.model.eval()
        outputs_all = []
        with torch.no_grad():
            for batch in dataloader:
                batch = batches.to_device(batch, self.device)
                emit(Topic.PREDICT_BATCH_START, ts)
                emit(Topic.PREDICT_BEFORE_FORWARD, ts)
                paired = self.loss_fn is not None and isinstance(batch, (tuple, list))
                inputs = batches.pair(batch)[0] if paired else batch
                outputs = self.model(inputs)
                emit(Topic.PREDICT_AFTER_FORWARD, ts)
                emit(Topic.PREDICT_BATCH_END, ts, {"batch_size": batches.batch_size(batch)})
                self.emitter.release_due()
                if return_outputs:
                    outputs_all.append(outputs.detach().cpu() if isinstance(outputs, torch.Tensor)
                                       else outputs)
        metrics = self.readings.user_metrics.take()  # what the model logged while predicting
        self.emitter.emit_tensors(Topic.PREDICT_END, ts, {"metrics": metrics})
        self.emitter.flush()
        return outputs_all

    # ------------------------------------------------------------------- ending

    def close(self, wait_for_workers: bool = True) -> None:
        """Let every callback worker see fit_end, close the stream, mark the run finished."""
        if self.services.closed:
            return
        atexit.unregister(self.close)  # nothing global holds a closed Trainer (model, CUDA memory)
        self.readings.user_metrics.close()  # log_metrics() goes to an open Trainer only
        self.services.close(self.timestamp, wait_for_workers)

    def _check_open(self, what: str) -> None:
        """After close() a fit, eval or predict would run unseen by every callback: refused."""
        if self.services.closed:
            raise TrainerError.closed(what)

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

