"""The Trainer: Composer's training loop, publishing a snapshot at every event.

Read `_train_batch` for what happens in one batch and `_fit_loop` for the order of
the events around it; every event is fired visibly where it happens, in Composer's
order. Publishing never waits, never synchronises the GPU, and skips events no
worker wants. Control requests (halt, checkpoint) are read once per batch.
"""

from __future__ import annotations

import atexit
import logging
import math
import os
import random
import resource
import signal
import socket
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from contextlib import nullcontext
from itertools import chain
from operator import attrgetter, itemgetter
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
import zmq
from torch import nn

from offloop.bus import (
    CHECKPOINT_SAVED,
    CONTROL_REQUEST,
    ControlServer,
    Event,
    Publisher,
    RunInfo,
    Time,
    TimeUnit,
    mark_finished,
    write_run_info,
)
from offloop.bus.duration import DurationError
from offloop.bus.security import SecurityError, check_exposure, generate_keys, load_server_keys
from offloop.trainer import distributed
from offloop.trainer.checkpoint import load_checkpoint, rng_state, save_checkpoint, set_rng_state
from offloop.trainer.errors import CheckpointError, ConfigError, TrainerError
from offloop.trainer.grads import GradBuffer
from offloop.trainer.snapshot import Emitter
from offloop.trainer.supervisor import CallbackWorkers, check_picklable
from offloop.trainer.timestamp import Timestamp

__all__ = ["Trainer"]

log = logging.getLogger("offloop.trainer")

_LR, _PARAM_GROUPS = itemgetter("lr"), attrgetter("param_groups")  # read in C at every batch_end

PRECISIONS = ("fp32", "amp_fp16", "amp_bf16")
#: Event values as plain strings: the topics the loop publishes, looked up cheaply.
E = SimpleNamespace(**{event.name: event.value for event in Event})


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
        eval_metrics: Any = None,
        loss_fn: Callable | None = None,
        callbacks: list | None = None,
        run_name: str | None = None,
        run_dir: str | os.PathLike | None = None,
        device: str | torch.device = "auto",
        precision: str = "fp32",
        grad_accum: int = 1,
        load_path: str | os.PathLike | None = None,
        save_folder: str | os.PathLike | None = None,
        seed: int | None = None,
        iteration_length: int | None = None,
        num_tokens_fn: Callable[[Any], int] | None = None,
        publish: bool = True,
        publish_eval_outputs: bool = False,
        publish_samples: int = 0,
        per_param_grad_norms: bool = False,
        contiguous_grads: bool = True,
        hparams: Mapping[str, Any] | None = None,
        host: str = "127.0.0.1",
        keys: str | os.PathLike | None = None,
        insecure: bool = False,
        heartbeat_interval: float = 0.5,
        burst_interval: float = 0.005,
        checkpoint_on_sigterm: bool = True,
        worker_shutdown_timeout: float = 60.0,
        worker_nice: int = 10,
    ) -> None:
        self.rank = distributed.rank() if distributed.init_from_env() else 0
        self.world_size = distributed.world_size()
        self.device = _resolve_device(device)
        self._device_type = self.device.type  # read per batch: torch.device.type builds a new str
        if precision not in PRECISIONS:
            raise ConfigError(f"precision {precision!r} is not one of {', '.join(PRECISIONS)}")
        if not isinstance(grad_accum, int) or grad_accum < 1:
            raise ConfigError(f"grad_accum must be an int >= 1, got {grad_accum!r}")
        self.max_duration = _parse_duration("max_duration", max_duration) if max_duration else None
        if self.max_duration is not None and self.max_duration.unit is TimeUnit.TOKEN and not num_tokens_fn:
            raise ConfigError("max_duration in tokens needs num_tokens_fn= to count tokens per batch")
        if not hasattr(model, "loss") and loss_fn is None:
            raise ConfigError(f"model {type(model).__name__} has no loss(outputs, batch) method and "
                              "no loss_fn= was given: one of them is needed to train")
        self.seed = seed if seed is not None else random.randrange(2**31)
        _seed_everything(self.seed)
        self.precision, self.grad_accum = precision, grad_accum
        # each microbatch's events share one dict, never modified (published as it is)
        self._micro_data = tuple({"microbatch": i} for i in range(grad_accum))
        # fp16 gradients underflow without loss scaling (bf16 has fp32's range: none needed)
        self._scaler = torch.amp.GradScaler(self.device.type) if precision == "amp_fp16" else None
        self.loss_fn, self.num_tokens_fn = loss_fn, num_tokens_fn
        self.iteration_length = iteration_length
        self.publish_eval_outputs, self.per_param_grad_norms = publish_eval_outputs, per_param_grad_norms
        if not isinstance(contiguous_grads, bool):
            raise ConfigError(f"contiguous_grads must be True or False, got {contiguous_grads!r}")
        self.contiguous_grads = contiguous_grads
        self._grads: GradBuffer | None = None  # adopted after each fit's first backward
        self._adopt_grads = False
        if not isinstance(publish_samples, int) or publish_samples < 0:
            raise ConfigError(f"publish_samples must be an int >= 0, got {publish_samples!r}")
        self.publish_samples = publish_samples
        if isinstance(burst_interval, bool) or not isinstance(burst_interval, (int, float)) \
                or not 0 <= burst_interval <= 60:
            raise ConfigError(f"burst_interval must be seconds between 0 and 60, got {burst_interval!r}")
        if isinstance(worker_nice, bool) or not isinstance(worker_nice, int) or not 0 <= worker_nice <= 19:
            raise ConfigError(f"worker_nice must be an int between 0 and 19, got {worker_nice!r}")

        self.model = model.to(self.device)
        if self.world_size > 1 and not isinstance(model, nn.parallel.DistributedDataParallel):
            self.model = nn.parallel.DistributedDataParallel(self.model)
        self.optimizers = _as_list(optimizers) or [torch.optim.SGD(self.model.parameters(), lr=0.1)]
        self.schedulers = _as_list(schedulers)
        self.train_dataloader = train_dataloader
        self.eval_dataloaders = _eval_loaders(eval_dataloader)
        self.eval_intervals = _eval_intervals(eval_interval, self.eval_dataloaders)
        self._eval_every_batch = any(i.unit is TimeUnit.BATCH for i in self.eval_intervals.values())
        self.eval_metrics = _metrics(eval_metrics, self.device)
        bare = getattr(model, "module", model)
        self._flops_fn = getattr(bare, "flops_per_batch", None)  # Composer's optional model hook
        self._rss: dict[str, int] | None = None  # peak resident memory, as last read (published as is)
        self.timestamp = Timestamp()
        self.run_id = uuid.uuid4().hex[:12]
        self.run_name = run_name or (Path(run_dir).name if run_dir else
                                     f"run-{time.strftime('%Y%m%d-%H%M%S')}-{self.run_id[:6]}")
        self.run_dir = Path(run_dir) if run_dir else Path(os.environ.get("OFFLOOP_RUNS", "runs")) / self.run_name
        self.save_folder = (Path(save_folder) if save_folder else self.run_dir / "checkpoints").absolute()
        self.hparams = dict(hparams or {})
        self.stopped_by: dict[str, Any] | None = None
        self.checkpoints: list[str] = []
        self._stop = False
        self._closed = False
        self._in_fit = False
        self._epoch_rng: dict | None = None
        self._resume_batches = 0
        self._pending_ckpts: list = []
        self._pending_halts: list = []
        self._sigterm = False
        self._sigterm_saved = False
        self._fit_ended = False  # fit_end was published: close() waits for workers to see it
        # totals carried by checkpoint_saved and control_request, so a late joiner, which
        # gets only the latest of each, still knows how many there were
        self._saves = self._requests_seen = 0
        self._ckpts_due = 0
        self.checkpoint_on_sigterm = checkpoint_on_sigterm
        self._agreement = distributed.ControlAgreement()

        self.publisher: Publisher | None = None
        self.control: ControlServer | None = None
        self.keys = Path(keys) if keys else None
        self._server_keys = None
        # what can be known now fails now, before a socket, a worker or run.json exists
        if callbacks and not publish:
            raise ConfigError("callbacks run in worker processes and need publish=True")
        check_picklable(callbacks or [])
        if load_path is not None and not Path(load_path).is_file():
            raise CheckpointError(f"load_path {str(load_path)!r} does not exist or is not a file")
        if publish:
            try:
                self._server_keys = load_server_keys(keys) if keys else None
                check_exposure(host, self._server_keys, insecure)
                if keys:  # the trainer's own callback workers get a client key of their own
                    generate_keys(keys, client="workers")
            except SecurityError as exc:
                raise ConfigError(str(exc)) from None
            self._start_bus(host, heartbeat_interval)
        self.emitter = Emitter(self.publisher, self.device, float(burst_interval))
        # a worker that hears no heartbeat for 10 intervals (3 s at least) takes the
        # trainer for dead: it closes its callbacks and exits
        self.workers = CallbackWorkers(callbacks or [], str(self.run_dir),
                                       keys=str(self.keys) if self.keys else None,
                                       heartbeat_timeout=max(3.0, 10 * heartbeat_interval),
                                       nice=worker_nice)
        self.worker_shutdown_timeout = worker_shutdown_timeout
        try:
            if self.rank == 0:
                self.workers.start()  # every worker listens before init is published
            atexit.register(self.close)
            _install_sigterm(self)  # fit_end always; checkpoint_on_sigterm decides the checkpoint

            self.emitter.emit(E.INIT, self.timestamp.as_tuple(), {"config": self.config()})
            # as in Composer, both fire on every run, with a checkpoint to load or not
            self.emitter.emit(E.BEFORE_LOAD, self.timestamp.as_tuple())
            if load_path is not None:
                self._load(load_path)
            self.emitter.emit(E.AFTER_LOAD, self.timestamp.as_tuple(),
                              {"path": str(load_path) if load_path is not None else None})
            self.emitter.release()
        except BaseException:
            # no fit will follow: end the stream and the workers now, mark the run finished
            self.close(wait_for_workers=False)
            raise

    # ------------------------------------------------------------------ set-up

    def _start_bus(self, host: str, heartbeat_interval: float) -> None:
        self._context = zmq.Context()
        keys = self._server_keys
        self._authenticator = keys.start_authenticator(self._context) if keys else None
        self.publisher = Publisher(self.run_id, rank=self.rank, host=host, context=self._context,
                                   heartbeat_interval=heartbeat_interval, curve=keys)
        endpoints = self.publisher.start()
        ranks_endpoints = self._agreement.gather(dict(endpoints))
        if self.rank == 0:
            self.control = ControlServer(host=host, context=self._context, curve=keys)
            endpoints["control"] = self.control.start()
            info = RunInfo(self.run_id, self.run_name, os.getpid(), time.time(), endpoints,
                           host=socket.gethostname(), world_size=self.world_size,
                           ranks=ranks_endpoints, extra={"config": self.config()},
                           curve_public=keys.public.decode() if keys else "")
            write_run_info(self.run_dir, info)
            self.publisher.run_info = info.to_dict()
        self.publisher.set_config(self.config())

    def config(self) -> dict[str, Any]:
        """The run config: what a late joiner and every `init`/`fit_start` carries."""
        model = self.model.module if isinstance(self.model, nn.parallel.DistributedDataParallel) else self.model
        return {
            "run_name": self.run_name,
            "run_id": self.run_id,
            "model": type(model).__name__,
            "num_params": sum(p.numel() for p in model.parameters()),
            "max_duration": str(self.max_duration) if self.max_duration else None,
            "dataloader_len": _len(self.train_dataloader),
            "eval_interval": {k: str(v) for k, v in self.eval_intervals.items()},
            "eval_dataloaders": {k: _len(v) for k, v in self.eval_dataloaders.items()},
            "world_size": self.world_size,
            "device": str(self.device),
            "device_name": torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu",
            "precision": self.precision,
            "grad_accum": self.grad_accum,
            "seed": self.seed,
            "optimizers": [_describe_optimizer(o) for o in self.optimizers],
            "hparams": self.hparams,
        }

    # --------------------------------------------------------------- fit loop

    def fit(self, *, duration: str | Time | None = None) -> None:
        """Train until max_duration (or a halt); fires FIT_START … FIT_END."""
        self._check_open("fit")
        if duration is not None:
            self.max_duration = _parse_duration("duration", duration)
        if self.max_duration is None:
            raise ConfigError("no max_duration: pass max_duration= to Trainer or duration= to fit()")
        if self.train_dataloader is None:
            raise ConfigError("no train_dataloader was given")
        self._stop = False
        self._in_fit = True
        try:
            self._fit_loop()
            if self._sigterm and self.stopped_by is None:  # came after the last control poll
                self.stopped_by = {"reason": "SIGTERM", "client": "signal", "step": self.timestamp.batch}
            if self._sigterm and self.checkpoint_on_sigterm and not self._sigterm_saved \
                    and not self._agreement.active:
                # SIGTERM came after the last batch boundary (in an evaluation, say):
                # nothing saved it yet. Under torchrun the ranks agreed at a boundary.
                self._ckpts_due = 1
                self._save_requested("fit_end")
        finally:
            self._in_fit = False
            self._finish_fit()
        if self._sigterm:
            self.close()
            raise SystemExit(128 + signal.SIGTERM)

    def _fit_loop(self) -> None:
        ts = self.timestamp
        self.emitter.emit(E.FIT_START, ts.as_tuple(), {"config": self.config()})
        self.model.train()
        named = list(self.model.named_parameters())
        self._param_names = [name for name, _ in named]
        self._params = [param for _, param in named]
        self._grads, self._adopt_grads = None, self.contiguous_grads
        while not self._stop and not self.max_duration.reached(ts):
            if ts.epoch_in_iteration == 0 and ts.batch_in_epoch == 0:
                self.emitter.emit(E.ITERATION_START, ts.as_tuple())
            if ts.batch_in_epoch == 0:
                self.emitter.emit(E.EPOCH_START, ts.as_tuple())
            finished_early = False
            for batch in self._epoch_batches():
                self._train_batch(batch)
                if self._stop or self.max_duration.reached(ts):
                    finished_early = True
                    break
            if not finished_early or ts.batch_in_epoch == _len(self.train_dataloader):
                ts.next_epoch()
                self.emitter.emit(E.EPOCH_END, ts.as_tuple())
                self._run_evaluators(TimeUnit.EPOCH)
                self.emitter.emit(E.EPOCH_CHECKPOINT, ts.as_tuple())
                if self.iteration_length and ts.epoch_in_iteration == self.iteration_length:
                    ts.next_iteration()
                    self.emitter.emit(E.ITERATION_END, ts.as_tuple())
                    self.emitter.emit(E.ITERATION_CHECKPOINT, ts.as_tuple())

    def _epoch_batches(self):
        """The epoch's batches; on resume, the batches already trained are skipped."""
        sampler = getattr(self.train_dataloader, "sampler", None)
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(self.timestamp.epoch)
        if self._resume_batches and self._epoch_rng is not None:
            resume_rng = rng_state()
            set_rng_state(self._epoch_rng)
        self._epoch_rng = rng_state()  # what this epoch's data order is drawn from
        ts = self.timestamp
        self.emitter.emit(E.BEFORE_DATALOADER, ts.as_tuple())
        iterator = iter(self.train_dataloader)
        if self._resume_batches:
            for _ in range(self._resume_batches):
                next(iterator)
            set_rng_state(resume_rng)
            self._resume_batches = 0
        while True:
            try:
                batch = next(iterator)
            except StopIteration:
                return
            self.emitter.emit(E.AFTER_DATALOADER, ts.as_tuple())
            yield batch
            self.emitter.emit(E.BEFORE_DATALOADER, ts.as_tuple())

    def _train_batch(self, batch: Any) -> None:
        """One optimizer step, every event of it in Composer's order."""
        ts, emit, wants, host = self.timestamp, self.emitter.emit, self.emitter.wants, self.emitter.host
        if self._device_type != "cpu":
            batch = _to_device(batch, self.device)
        size = _batch_size(batch)
        now = ts.as_tuple()
        emit(E.BATCH_START, now, {"batch_size": size})
        emit(E.BEFORE_TRAIN_BATCH, now, {"batch_size": size, "microbatches": self.grad_accum})
        grads = self._grads
        if grads is not None:
            grads.zero()
        else:
            for opt in self.optimizers:
                opt.zero_grad(set_to_none=True)
        total_loss = loss_out = None
        accum = self.grad_accum
        for i, micro in enumerate((batch,) if accum == 1 else _split(batch, accum)):
            micro_data = self._micro_data[i]
            emit(E.BEFORE_FORWARD, now, micro_data)
            if self.precision == "fp32":
                outputs, loss = self._forward_and_loss(micro, now, micro_data)
            else:
                with self._autocast():
                    outputs, loss = self._forward_and_loss(micro, now, micro_data)
            if wants(E.AFTER_LOSS):  # the microbatch's own loss, as Composer's state.loss here
                loss_out = host(loss)
                self.emitter.snapshot(E.AFTER_LOSS, now, {"microbatch": i, "loss": loss_out})
            if accum > 1:  # weighted by the microbatch's share, for backward and the total
                loss = loss * (_batch_size(micro) / size)
                total_loss = loss.detach() if total_loss is None else total_loss + loss.detach()
            else:  # the step's loss is this one: read for the snapshots below, if at all
                total_loss = loss
            emit(E.BEFORE_BACKWARD, now, micro_data)
            (self._scaler.scale(loss) if self._scaler is not None else loss).backward()
            emit(E.AFTER_BACKWARD, now, micro_data)
        last = (micro, outputs)
        if grads is not None:
            if not grads.settle():  # a .grad was replaced: the buffer no longer holds them
                self._grads = None
        elif self._adopt_grads:  # the fit's first step: gradients into one buffer from now on
            self._adopt_grads = False
            self._grads = GradBuffer.adopt(self.model, self._params, self.optimizers)
        if self._scaler is not None:  # Composer unscales before after_train_batch: true norms
            for opt in self.optimizers:
                self._scaler.unscale_(opt)
        # the step's loss as snapshots hold it, read once (retained: batch_end is always
        # built when publishing); with one microbatch, after_loss has read it already
        if accum > 1 or loss_out is None:
            loss_out = host(total_loss) if wants(E.BATCH_END) or wants(E.AFTER_TRAIN_BATCH) else None
        if wants(E.AFTER_TRAIN_BATCH):
            grads = self._grads  # the buffer's global norm is one op: no call to _grad_snapshot
            self.emitter.snapshot(E.AFTER_TRAIN_BATCH, now,
                                  {"grad_norm": grads.norm(), "loss": loss_out}
                                  if grads is not None and not self.per_param_grad_norms
                                  else self._grad_snapshot(loss_out))
        for opt in self.optimizers:
            if self._scaler is not None:
                self._scaler.step(opt)  # skipped when a gradient overflowed
            else:
                opt.step()
        if self._scaler is not None:
            self._scaler.update()
        for scheduler in self.schedulers:
            scheduler.step()
        ts.next_batch(size, self.num_tokens_fn(batch) if self.num_tokens_fn else 0)
        now = ts.as_tuple()
        if wants(E.BATCH_END):
            self.emitter.snapshot(E.BATCH_END, now, self._batch_end_snapshot(loss_out, size, batch, last))
        self._poll_control()
        if self._eval_every_batch:
            self._run_evaluators(TimeUnit.BATCH)
        emit(E.BATCH_CHECKPOINT, now)
        self._save_requested("batch_checkpoint")
        if self.emitter.cuda:
            self.emitter.poll()

    def _forward_and_loss(self, micro: Any, now: tuple, micro_data: dict) -> tuple[Any, torch.Tensor]:
        """A training microbatch's forward pass and loss, with the events between them
        (one call a microbatch: on a small model each Python call is a share of the step)."""
        emit, loss_fn = self.emitter.emit, self.loss_fn
        if loss_fn is None:  # Composer's protocol: the model takes the batch, its loss() scores it
            inputs = micro
        else:  # an (input, target) pair; _pair names what else it got (its first branch, inline:
            # this runs every microbatch, and the call costs the step 0.3-0.5 % of its instructions, by callgrind)
            inputs, targets = micro if isinstance(micro, (tuple, list)) and len(micro) == 2 else _pair(micro)
        outputs = self.model(inputs)
        emit(E.AFTER_FORWARD, now, micro_data)
        emit(E.BEFORE_LOSS, now, micro_data)
        if loss_fn is None:
            return outputs, getattr(self.model, "module", self.model).loss(outputs, micro)
        return outputs, loss_fn(outputs, targets)

    def _forward(self, batch: Any) -> Any:
        if self.loss_fn is None:
            return self.model(batch)
        inputs, _ = _pair(batch)
        return self.model(inputs)

    def _loss(self, outputs: Any, batch: Any) -> torch.Tensor:
        if self.loss_fn is None:
            model = getattr(self.model, "module", self.model)
            return model.loss(outputs, batch)
        _, targets = _pair(batch)
        return self.loss_fn(outputs, targets)

    def _autocast(self):
        if self.precision == "fp32":
            return nullcontext()
        dtype = torch.float16 if self.precision == "amp_fp16" else torch.bfloat16
        return torch.autocast(self.device.type, dtype=dtype)

    def _grad_snapshot(self, loss: Any) -> dict[str, Any]:
        """Global gradient L2 norm from per-parameter norms, computed on the device (no
        sync): without the contiguous buffer, or when per-parameter norms are asked for
        (with the buffer and without them, _train_batch reads the buffer's one-op norm)."""
        # backward never builds a graph of the gradients here: they need no detach()
        names, grads = self._param_names, [p.grad for p in self._params]
        if any(g is None for g in grads):
            names = [n for n, g in zip(names, grads, strict=True) if g is not None]
            grads = [g for g in grads if g is not None]
            if not grads:
                return {"grad_norm": None, "loss": loss}
        norms = torch._foreach_norm(grads)  # one kernel launch for every parameter
        if self._device_type == "cpu":
            # host numbers now (no device to wait for): the per-parameter norms combined
            # in double precision on the host cost half what two more torch ops would
            values = [n.item() for n in norms] if len(norms) <= 16 else torch.stack(norms).tolist()
            snapshot: dict[str, Any] = {"grad_norm": _hypot(values), "loss": loss}
            if self.per_param_grad_norms:
                snapshot["param_grad_norms"] = dict(zip(names, values, strict=True))
            return snapshot
        snapshot = {"grad_norm": torch.linalg.vector_norm(torch.stack(norms)), "loss": loss}
        if self.per_param_grad_norms:
            snapshot["param_grad_norms"] = dict(zip(names, norms, strict=True))
        return snapshot

    def _batch_end_snapshot(self, loss: Any, size: int, batch: Any, last: tuple[Any, Any]) -> dict[str, Any]:
        """What batch_end callbacks read, built with Emitter.host() (numbers on the CPU)."""
        snapshot: dict[str, Any] = {
            "loss": loss,
            "lr": list(map(_LR, chain.from_iterable(map(_PARAM_GROUPS, self.optimizers)))),
            "batch_size": size,
        }
        if self._device_type == "cuda":
            snapshot["memory"] = _cuda_memory(self.device)
        else:
            if self._rss is None or not self.timestamp.batch % 16:  # a peak: read every 16 steps
                self._rss = {"max_rss_bytes": _max_rss()}  # a new dict: held events keep theirs
            snapshot["memory"] = self._rss
        if self._flops_fn is not None:
            flops = self._flops_fn(batch)
            snapshot["flops"] = self.emitter.host(flops) if isinstance(flops, torch.Tensor) else flops
        if self.publish_samples:
            micro, outputs = last
            inputs, targets = _pair(micro) if isinstance(micro, (tuple, list)) else (micro, None)
            n = self.publish_samples
            snapshot["samples"] = {  # tensors: frames on the wire (0-d ones become numbers)
                "inputs": self.emitter.host(inputs[:n]) if isinstance(inputs, torch.Tensor) else None,
                "targets": self.emitter.host(targets[:n]) if isinstance(targets, torch.Tensor) else None,
                "outputs": self.emitter.host(outputs[:n]) if isinstance(outputs, torch.Tensor) else None,
            }
        return snapshot

    # ------------------------------------------------------------------ control

    def _poll_control(self) -> None:
        """Read control requests once per batch; all ranks agree on what to do."""
        control = self.control
        if (self._pending_halts or self._pending_ckpts or self._sigterm or self._agreement.active
                or (control is not None and control.inbox)):
            self._ckpts_due = self._apply_requests(control)
        else:  # the usual batch: nothing asked or pending, and no other rank to agree with
            self._ckpts_due = 0
        self.emitter.release_due()  # this batch's events, with the last ones if the interval has passed

    def _apply_requests(self, control: ControlServer | None) -> int:
        """Take what arrived, agree with the other ranks, apply a halt; the checkpoints
        due at this batch's checkpoint event."""
        requests = control.poll() if control is not None else ()
        for request in requests:
            self._requests_seen += 1
            self.emitter.emit(CONTROL_REQUEST, self.timestamp.as_tuple(),
                              {"op": request.op, "client": request.client, "args": request.args,
                               "count": self._requests_seen})
            if request.op == "halt":
                self._pending_halts.append(request)
                continue
            try:  # a bad file name is refused now, alone: it never joins the requests saved together
                _check_filename(request.args.get("filename"))
            except CheckpointError as exc:
                request.refuse(str(exc), step=self.timestamp.batch)
                continue
            self._pending_ckpts.append(request)
        halt = bool(self._pending_halts) or self._sigterm
        sigterm_ckpt = int(self._sigterm and self.checkpoint_on_sigterm)
        halt, ckpts = self._agreement.agree(halt, len(self._pending_ckpts) + sigterm_ckpt)
        if halt:
            self._stop = True  # applied: no batch after this one trains, on any rank
            for request in self._pending_halts:
                request.ack(step=self.timestamp.batch, epoch=self.timestamp.epoch)
                self.stopped_by = {"reason": request.args.get("reason", ""), "client": request.client,
                                   "step": self.timestamp.batch}
            self._pending_halts = []
            if self._sigterm and self.stopped_by is None:
                self.stopped_by = {"reason": "SIGTERM", "client": "signal", "step": self.timestamp.batch}
        return ckpts

    def _save_requested(self, where: str) -> None:
        if not self._ckpts_due:
            return
        self._ckpts_due = 0
        requests, self._pending_ckpts = self._pending_ckpts, []
        # due with no request here: a SIGTERM asked for it, on this rank or (torchrun) another,
        # or (torchrun, rank > 0) a request rank 0 holds; rank 0's tag and name are used
        tags = [_safe_name(str(r.args.get("tag", ""))) for r in requests] or ["sigterm"]
        tag = "-".join(t for t in tags if t)
        filename = next((str(r.args["filename"]) for r in requests if r.args.get("filename")), None)
        try:
            path, tag = self._write_checkpoint(tag, filename)
        except CheckpointError as exc:
            for request in requests:
                request.refuse(str(exc), step=self.timestamp.batch)
            log.warning("offloop: %s; training goes on", exc)
            return
        self._sigterm_saved = self._sigterm_saved or self._sigterm
        for request in requests:
            request.ack(path=str(path), step=self.timestamp.batch, event=where)
        self._saves += 1
        self.emitter.emit(CHECKPOINT_SAVED, self.timestamp.as_tuple(),
                          {"path": str(path), "step": self.timestamp.batch, "tag": tag,
                           "event": where, "requested_by": [[r.client, r.req] for r in requests],
                           "count": self._saves})
        self.emitter.release()

    def request_halt(self, reason: str = "") -> None:
        """In-process twin of a halt request: stop after the current batch."""
        self._stop = True
        self.stopped_by = {"reason": reason, "client": "in-process"}

    # -------------------------------------------------------------- checkpoints

    def save_checkpoint(self, tag: str = "", filename: str | None = None) -> Path:
        """Write a checkpoint now (rank 0 writes; every rank must call it at the same step)."""
        return self._write_checkpoint(tag, filename)[0]

    def _write_checkpoint(self, tag: str, filename: str | None) -> tuple[Path, str]:
        """save_checkpoint(), also returning the tag rank 0 gave it (under torchrun the
        other ranks hold no request and learn the name and tag from rank 0)."""
        ts = self.timestamp
        name = filename or f"ep{ts.epoch}-ba{ts.batch}" + (f"-{tag}" if tag else "") + ".pt"
        # one collective on every rank (never inside `if rank == 0`); rank 0's name wins, and
        # every rank judges it after the gather, so all refuse a bad one alike
        states = self._agreement.gather((name, tag, rng_state(), self._epoch_rng))
        name, tag = states[0][0], states[0][1]
        _check_filename(name)
        path = self.save_folder / name
        if self.rank == 0:
            model = getattr(self.model, "module", self.model)
            save_checkpoint(path, {
                "format": "offloop-checkpoint-1",
                "model": model.state_dict(),
                "optimizers": [o.state_dict() for o in self.optimizers],
                "schedulers": [s.state_dict() for s in self.schedulers],
                "scaler": self._scaler.state_dict() if self._scaler is not None else None,
                "timestamp": ts.state_dict(),
                "rng": [rng for _, _, rng, _ in states],
                "epoch_rng": [epoch_rng for *_, epoch_rng in states],
                "seed": self.seed,
                "run_name": self.run_name,
            })
            self.checkpoints.append(str(path))
        return path, tag

    def _load(self, load_path: str | os.PathLike) -> None:
        state = load_checkpoint(load_path)
        if state.get("format") != "offloop-checkpoint-1":
            raise CheckpointError(f"load_path {str(load_path)!r} is not an offloop checkpoint")
        model = getattr(self.model, "module", self.model)
        model.load_state_dict(state["model"])
        if len(state["optimizers"]) != len(self.optimizers):
            raise CheckpointError(f"checkpoint has {len(state['optimizers'])} optimizers, "
                                  f"this trainer {len(self.optimizers)}")
        for opt, opt_state in zip(self.optimizers, state["optimizers"], strict=True):
            opt.load_state_dict(opt_state)
        for sched, sched_state in zip(self.schedulers, state["schedulers"], strict=False):
            sched.load_state_dict(sched_state)
        if self._scaler is not None and state.get("scaler"):
            self._scaler.load_state_dict(state["scaler"])
        self.timestamp.load_state_dict(state["timestamp"])
        rank = min(self.rank, len(state["rng"]) - 1)
        set_rng_state(state["rng"][rank])
        self._epoch_rng = state["epoch_rng"][rank]
        self._resume_batches = self.timestamp.batch_in_epoch

    # --------------------------------------------------------------------- eval

    def _run_evaluators(self, unit: TimeUnit) -> None:
        """Evaluate every dataloader whose interval (in `unit`) is due, as Composer does:
        EVAL_BEFORE_ALL, each evaluation, EVAL_AFTER_ALL — nothing when none is due."""
        count = self.timestamp.epoch if unit is TimeUnit.EPOCH else self.timestamp.batch
        due = [label for label, interval in self.eval_intervals.items()
               if interval.unit is unit and count % interval.value == 0]
        if not due:
            return
        ts = self.timestamp.as_tuple()
        self.emitter.emit(E.EVAL_BEFORE_ALL, ts)
        results = {label: self._evaluate(label, self.eval_dataloaders[label]) for label in due}
        self.emitter.emit_tensors(E.EVAL_AFTER_ALL, ts, {"metrics": results})
        self.model.train()

    def _evaluate(self, label: str, loader: Iterable) -> dict[str, Any]:
        ts, emit = self.timestamp.as_tuple(), self.emitter.emit
        for metric in self.eval_metrics.values():
            metric.reset()
        emit(E.EVAL_START, ts, {"dataloader_label": label})
        self.model.eval()
        loss_sum, count = None, 0
        with torch.no_grad():
            for batch in loader:
                batch = _to_device(batch, self.device)
                emit(E.EVAL_BATCH_START, ts, {"dataloader_label": label})
                emit(E.EVAL_BEFORE_FORWARD, ts, {"dataloader_label": label})
                with self._autocast():
                    outputs = self._eval_forward(batch)
                emit(E.EVAL_AFTER_FORWARD, ts, {"dataloader_label": label})
                targets = self._targets(batch)
                for metric in self.eval_metrics.values():
                    metric.update(outputs, targets)
                batch_loss = self._loss(outputs, batch).detach() * _batch_size(batch)
                loss_sum = batch_loss if loss_sum is None else loss_sum + batch_loss
                count += _batch_size(batch)
                data: dict[str, Any] = {"dataloader_label": label, "loss": batch_loss / _batch_size(batch)}
                if self.publish_eval_outputs:
                    data["outputs"], data["targets"] = outputs.detach(), targets.detach()
                    inputs = _pair(batch)[0] if isinstance(batch, (tuple, list)) and len(batch) == 2 else None
                    if isinstance(inputs, torch.Tensor):
                        data["inputs"] = inputs.detach()
                self.emitter.emit_tensors(E.EVAL_BATCH_END, ts, data)
                self.emitter.release_due()
        metrics = {name: metric.compute() for name, metric in self.eval_metrics.items()}
        if loss_sum is not None:
            metrics["loss"] = loss_sum / max(count, 1)
        self.emitter.emit_tensors(E.EVAL_END, ts, {"dataloader_label": label, "metrics": metrics})
        self.emitter.release()
        return metrics

    def _eval_forward(self, batch: Any) -> Any:
        model = getattr(self.model, "module", self.model)
        if self.loss_fn is None and hasattr(model, "eval_forward"):
            return model.eval_forward(batch)
        return self._forward(batch)

    def _targets(self, batch: Any) -> Any:
        if self.loss_fn is not None:
            return _pair(batch)[1]
        model = getattr(self.model, "module", self.model)
        if hasattr(model, "get_targets"):
            return model.get_targets(batch)
        return _pair(batch)[1]

    def eval(self, eval_dataloader: Iterable | Mapping[str, Iterable] | None = None) -> dict:
        """Standalone evaluation: EVAL_STANDALONE_START … EVAL_STANDALONE_END."""
        self._check_open("eval")
        loaders = _eval_loaders(eval_dataloader) if eval_dataloader is not None else self.eval_dataloaders
        if not loaders:
            raise ConfigError("eval() needs an eval_dataloader (here or in Trainer)")
        ts = self.timestamp.as_tuple()
        self.emitter.emit(E.EVAL_STANDALONE_START, ts)
        results = {label: self._evaluate(label, loader) for label, loader in loaders.items()}
        self.emitter.emit_tensors(E.EVAL_STANDALONE_END, ts, {"metrics": results})
        self.emitter.flush()
        return {label: {k: _scalar(v) for k, v in m.items()} for label, m in results.items()}

    def predict(self, dataloader: Iterable, return_outputs: bool = True) -> list:
        """Run the model over `dataloader`: PREDICT_START … PREDICT_END."""
        self._check_open("predict")
        ts, emit = self.timestamp.as_tuple(), self.emitter.emit
        emit(E.PREDICT_START, ts)
        self.model.eval()
        outputs_all = []
        with torch.no_grad():
            for batch in dataloader:
                batch = _to_device(batch, self.device)
                emit(E.PREDICT_BATCH_START, ts)
                emit(E.PREDICT_BEFORE_FORWARD, ts)
                inputs = _pair(batch)[0] if self.loss_fn is not None and isinstance(batch, (tuple, list)) else batch
                outputs = self.model(inputs)
                emit(E.PREDICT_AFTER_FORWARD, ts)
                emit(E.PREDICT_BATCH_END, ts, {"batch_size": _batch_size(batch)})
                self.emitter.release_due()
                if return_outputs:
                    outputs_all.append(outputs.detach().cpu() if isinstance(outputs, torch.Tensor) else outputs)
        emit(E.PREDICT_END, ts)
        self.emitter.flush()
        return outputs_all

    # ------------------------------------------------------------------- ending

    def _finish_fit(self) -> None:
        ts = self.timestamp
        for request in self._pending_halts + self._pending_ckpts:  # arrived with the last batch
            request.refuse("the run finished before this request could be applied", step=ts.batch)
        self._pending_halts, self._pending_ckpts = [], []
        self.workers.fits += 1  # its workers are stopped only once they have handled this one
        self.emitter.emit(E.FIT_END, ts.as_tuple(), {"stopped_by": self.stopped_by,
                                                     "checkpoints": self.checkpoints,
                                                     "fit": self.workers.fits})
        self.emitter.flush()
        self._fit_ended = True

    def close(self, wait_for_workers: bool = True) -> None:
        """Let every callback worker see fit_end, close the stream, mark the run finished."""
        if self._closed:
            return
        self._closed = True
        self.workers.closing = True  # from here a worker that has seen every fit_end may exit
        # with no fit (only eval() or predict()) there is no fit_end to wait for: the
        # workers take the stream's final heartbeats as the end, after every event before them
        if self.workers.workers and wait_for_workers and self._fit_ended:
            self.workers.wait_for_fit_end(self.worker_shutdown_timeout, while_waiting=self._answer_late)
        self._answer_late()
        if self.publisher is not None:
            self.publisher.close(linger=0.3)
        self.workers.stop()
        if self.control is not None:
            self.control.close()
        if getattr(self, "_authenticator", None) is not None:
            self._authenticator.stop()
        if getattr(self, "_context", None) is not None:
            self._context.term()
        if self.rank == 0 and self.publisher is not None:
            try:
                ts = self.timestamp
                mark_finished(self.run_dir, progress={"epoch": ts.epoch, "batch": ts.batch,
                                                      "sample": ts.sample, "token": ts.token},
                              stopped_by=self.stopped_by, checkpoints=self.checkpoints)
            except Exception as exc:  # never fail a finished run over its run.json
                log.warning("offloop: could not mark %s finished: %s", self.run_dir, exc)

    def _check_open(self, what: str) -> None:
        """After close() the stream, the control channel and the workers are gone: a fit,
        eval or predict then would run unseen by every callback, so it is refused."""
        if self._closed:
            raise TrainerError(f"{what}() on a closed Trainer: close() ended its event stream, control "
                               "channel and callback workers; build a new Trainer (load_path= resumes "
                               "from a checkpoint)")

    def _answer_late(self) -> None:
        """Requests that come after training stopped: a checkpoint is still written (of
        the final weights) and acked; a halt is refused — nothing is left to stop."""
        if self.control is None:
            return
        for request in self.control.poll():
            if request.op == "checkpoint" and self.rank == 0 and self.world_size == 1:
                self._pending_ckpts, self._ckpts_due = [request], 1
                self._save_requested("after_fit")
            else:
                request.refuse("the run has finished", step=self.timestamp.batch)

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---------------------------------------------------------------------- helpers


def _parse_duration(name: str, value: Any) -> Time:
    try:
        return Time.parse(value)
    except DurationError as exc:
        raise ConfigError(f"{name}: {exc}") from None


def _resolve_device(device: str | torch.device) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError):
        raise ConfigError(f"device {device!r} is not a device: use 'auto', 'cpu', 'cuda' or 'cuda:N'") from None
    if resolved.type not in ("cpu", "cuda"):
        raise ConfigError(f"device {device!r} is not supported: use 'auto', 'cpu', 'cuda' or 'cuda:N'")
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {device!r} was asked for, but this machine has no CUDA device")
    if resolved.type == "cuda" and resolved.index is not None and resolved.index >= torch.cuda.device_count():
        raise ConfigError(f"device {device!r} was asked for, but this machine has "
                          f"{torch.cuda.device_count()} CUDA device(s): use cuda:0 … "
                          f"cuda:{torch.cuda.device_count() - 1}")
    return resolved


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _as_list(value: Any) -> list:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _eval_loaders(value: Any) -> dict[str, Iterable]:
    if value is None:
        return {}
    if isinstance(value, Mapping):
        return dict(value)
    return {"eval": value}


def _metrics(value: Any, device: torch.device) -> dict[str, Any]:
    if value is None:
        return {}
    if isinstance(value, Mapping):
        items = dict(value)
    elif isinstance(value, (list, tuple)):
        items = {type(m).__name__: m for m in value}
    elif hasattr(value, "items") and hasattr(value, "compute"):  # MetricCollection
        items = dict(value.items())
    else:
        items = {type(value).__name__: value}
    for name, metric in items.items():
        if not (hasattr(metric, "update") and hasattr(metric, "compute")):
            raise ConfigError(f"eval_metrics[{name!r}] is a {type(metric).__name__}, not a torchmetrics Metric")
        metric.to(device)
    return items


def _eval_intervals(value: Any, loaders: dict[str, Iterable]) -> dict[str, Time]:
    """One interval per eval dataloader label, in epochs or batches (an int means epochs)."""
    per_label = dict(value) if isinstance(value, Mapping) else {label: value for label in loaders}
    unknown = sorted(set(per_label) - set(loaders))
    if unknown:
        raise ConfigError(f"eval_interval names {unknown}, which are not eval_dataloader labels "
                          f"({sorted(loaders)})")
    out = {}
    for label in loaders:
        raw = per_label.get(label, 1)
        interval = _parse_duration(f"eval_interval[{label!r}]", f"{raw}ep" if isinstance(raw, int) else raw)
        if interval.unit not in (TimeUnit.EPOCH, TimeUnit.BATCH) or interval.value < 1:
            raise ConfigError(f"eval_interval {raw!r} for {label!r} must be a positive number of "
                              "epochs or batches ('1ep', '100ba')")
        out[label] = interval
    return out


def _len(loader: Any) -> int | None:
    try:
        return len(loader)
    except TypeError:
        return None


def _pair(batch: Any) -> tuple[Any, Any]:
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    shape = f"a dict with keys {sorted(batch)}" if isinstance(batch, Mapping) else (
        f"a {type(batch).__name__} of {len(batch)}" if isinstance(batch, (tuple, list)) else type(batch).__name__)
    raise TrainerError(f"with loss_fn= a batch must be an (input, target) pair; got {shape}")


def _batch_size(batch: Any) -> int:
    while isinstance(batch, (tuple, list)) and batch:  # the first element's
        batch = batch[0]
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.ndim else 1
    if isinstance(batch, Mapping) and batch:
        return _batch_size(next(iter(batch.values())))
    raise TrainerError(f"cannot tell the batch size of a {type(batch).__name__} batch")


def _split(batch: Any, n: int) -> list:
    if n == 1:
        return [batch]
    if isinstance(batch, torch.Tensor):
        return list(torch.chunk(batch, n))
    if isinstance(batch, (tuple, list)):
        parts = [_split(x, n) for x in batch]
        return [type(batch)(p[i] for p in parts) if isinstance(batch, tuple) else [p[i] for p in parts]
                for i in range(len(parts[0]))]
    if isinstance(batch, Mapping):
        parts = {k: _split(v, n) for k, v in batch.items()}
        return [{k: v[i] for k, v in parts.items()} for i in range(len(next(iter(parts.values()))))]
    raise TrainerError(f"grad_accum={n} cannot split a {type(batch).__name__} batch")


def _to_device(batch: Any, device: torch.device) -> Any:
    if device.type == "cpu":
        return batch
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (tuple, list)):
        return type(batch)(_to_device(x, device) for x in batch)
    if isinstance(batch, Mapping):
        return {k: _to_device(v, device) for k, v in batch.items()}
    return batch


def _cuda_memory(device: torch.device) -> dict[str, int]:
    """Allocator counters, read on the host: no device synchronisation."""
    stats = torch.cuda.memory_stats(device)  # one read (memory_allocated() etc. each make one)
    return {
        "allocated_bytes": stats.get("allocated_bytes.all.current", 0),
        "reserved_bytes": stats.get("reserved_bytes.all.current", 0),
        "max_allocated_bytes": stats.get("allocated_bytes.all.peak", 0),
    }


def _describe_optimizer(opt: torch.optim.Optimizer) -> dict[str, Any]:
    group = opt.param_groups[0] if opt.param_groups else {}
    return {"name": type(opt).__name__, "param_groups": len(opt.param_groups),
            **{k: v for k, v in group.items() if isinstance(v, (int, float, str, bool))}}


def _safe_name(text: str) -> str:
    """A tag or file name reduced to characters that cannot leave the checkpoint folder."""
    cleaned = "".join(c if c.isalnum() or c in "._-" else "_" for c in text)[:100]
    return cleaned.lstrip(".")


def _check_filename(name: Any) -> None:
    """A checkpoint file name must stay in the save folder: letters, digits, '.', '-', '_'."""
    if name is not None and (not isinstance(name, str) or not name or _safe_name(name) != name):
        raise CheckpointError(f"checkpoint filename {name!r} must be a plain file name "
                              "(letters, digits, '.', '-', '_')")


def _max_rss() -> int:
    """Peak resident memory of this process, in bytes (one cheap syscall)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _hypot(values: list[float]) -> float:
    """sqrt of the sum of squares, as torch.linalg.vector_norm: NaN wins over inf."""
    norm = math.hypot(*values)
    return math.nan if math.isinf(norm) and any(math.isnan(v) for v in values) else norm


def _scalar(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.ndim == 0:
        return value.item()
    return value


def _install_sigterm(trainer: Trainer) -> None:
    """SIGTERM: checkpoint (when asked for) and publish fit_end before exiting."""
    if torch.multiprocessing.current_process().name != "MainProcess":
        return
    try:
        previous = signal.getsignal(signal.SIGTERM)
    except ValueError:
        return

    def handler(signum, frame):
        if trainer._closed:
            if callable(previous):
                previous(signum, frame)
            raise SystemExit(128 + signum)
        trainer._sigterm = True
        if not trainer._agreement.active:  # under torchrun the ranks agree at the next batch end
            trainer._stop = True  # fit() ends after this batch, checkpoints, closes and exits
        if not trainer._in_fit:
            trainer.close()
            raise SystemExit(128 + signum)

    try:
        signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread
        pass
