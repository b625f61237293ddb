"""The Trainer's argument checks: what can be known before training fails here, naming
the argument, the value received and what would be valid (a ConfigError)."""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterable, Mapping
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch

from offloop.bus import Time, TimeUnit
from offloop.bus.duration import DurationError
from offloop.trainer.errors import CheckpointError, ConfigError

log = logging.getLogger("offloop.trainer")

__all__ = [
    "PRECISIONS",
    "autocast",
    "fit_duration",
    "check_settings",
    "check_model",
    "check_run",
    "parse_duration",
    "resolve_device",
    "as_list",
    "eval_loaders",
    "eval_intervals",
    "eval_metrics",
]

PRECISIONS = ("fp32", "amp_fp16", "amp_bf16")


def check_settings(
    *,
    precision: Any,
    grad_accum: Any,
    contiguous_grads: Any,
    publish_samples: Any,
    burst_interval: Any,
    worker_nice: Any,
    decision_timeout: Any,
) -> None:
    """The Trainer's plain settings, each against what it may be."""
    if precision not in PRECISIONS:
        raise ConfigError(f"precision {precision!r} is not one of {', '.join(PRECISIONS)}")
    if not isinstance(grad_accum, int) or grad_accum < 1:
        raise ConfigError(f"grad_accum must be an int >= 1, got {grad_accum!r}")
    if not (isinstance(contiguous_grads, bool) or contiguous_grads == "auto"):
        raise ConfigError(
            f"contiguous_grads must be True, False or 'auto', got {contiguous_grads!r}"
        )
    if not isinstance(publish_samples, int) or publish_samples < 0:
        raise ConfigError(f"publish_samples must be an int >= 0, got {publish_samples!r}")
    if (
        isinstance(burst_interval, bool)
        or not isinstance(burst_interval, (int, float))
        or not 0 <= burst_interval <= 60
    ):
        raise ConfigError(
            f"burst_interval must be seconds between 0 and 60, got {burst_interval!r}"
        )
    if (
        isinstance(worker_nice, bool)
        or not isinstance(worker_nice, int)
        or not 0 <= worker_nice <= 19
    ):
        raise ConfigError(f"worker_nice must be an int between 0 and 19, got {worker_nice!r}")
    if (
        isinstance(decision_timeout, bool)
        or not isinstance(decision_timeout, (int, float))
        or not 0 < decision_timeout <= 3600
    ):
        raise ConfigError(
            f"decision_timeout must be seconds between 0 and 3600, got {decision_timeout!r}"
        )


def check_model(model: Any, loss_fn: Any, max_duration: Time | None, num_tokens_fn: Any) -> None:
    """A model the loop can train, for as long as it is asked to."""
    if max_duration is not None and max_duration.unit is TimeUnit.TOKEN and not num_tokens_fn:
        raise ConfigError("max_duration in tokens needs num_tokens_fn= to count tokens per batch")
    if not hasattr(model, "loss") and loss_fn is None:
        raise ConfigError(
            f"model {type(model).__name__} has no loss(outputs, batch) method and "
            "no loss_fn= was given: one of them is needed to train"
        )


def fit_duration(duration: Any, max_duration: Time | None, train_dataloader: Any) -> Time:
    """What fit(duration=) trains for: `duration` if given, else the Trainer's max_duration."""
    if duration is not None:
        max_duration = parse_duration("duration", duration)
    if max_duration is None:
        raise ConfigError("no max_duration: pass max_duration= to Trainer or duration= to fit()")
    if train_dataloader is None:
        raise ConfigError("no train_dataloader was given")
    return max_duration


def autocast(precision: str, device_type: str):
    """The context a forward pass runs in for `precision` (none for fp32)."""
    if precision == "fp32":
        return nullcontext()
    dtype = torch.float16 if precision == "amp_fp16" else torch.bfloat16
    return torch.autocast(device_type, dtype=dtype)


def check_run(
    callbacks: list | None, publish: bool, load_path: Any, loggers: list | None = None
) -> None:
    """Callbacks and loggers that can run, a checkpoint that exists."""
    if (callbacks or loggers) and not publish:
        raise ConfigError(
            f"{'callbacks' if callbacks else 'loggers'} run in worker processes and need "
            "publish=True"
        )
    if loggers is not None and not isinstance(loggers, (list, tuple)):
        raise ConfigError(
            f"loggers must be a list of logger destinations, got {type(loggers).__name__}"
        )
    for destination in loggers or []:
        if not callable(getattr(destination, "log_metrics", None)):
            raise ConfigError(
                f"loggers: {type(destination).__name__} is not a logger destination (it has no "
                "log_metrics); use offloop.loggers' TensorboardLogger, FileLogger, ..."
            )
    if load_path is not None and not Path(load_path).is_file():
        raise CheckpointError(f"load_path {str(load_path)!r} does not exist or is not a file")


def parse_duration(name: str, value: Any) -> Time:
    try:
        return Time.parse(value)
    except DurationError as exc:
        raise ConfigError(f"{name}: {exc}") from None


def resolve_device(
    device: str | torch.device, local_rank: int | None = None, cuda_devices: int | None = None
) -> torch.device:
    """'auto', 'cpu', 'cuda', 'cuda:N', or Composer's 'gpu' (the current CUDA device).

    Under torchrun (`local_rank` given) 'auto', 'gpu' and 'cuda' name the rank's own GPU,
    cuda:LOCAL_RANK, as Composer's DeviceGPU does: NCCL refuses two ranks on one GPU.
    `cuda_devices` is how many this machine has (read from torch when not given)."""
    count = torch.cuda.device_count() if cuda_devices is None else cuda_devices
    if device == "auto" and not count:
        return torch.device("cpu")
    if device in ("auto", "gpu", "cuda") and local_rank is not None and count:
        if local_rank >= count:
            raise ConfigError(
                f"device {device!r} gives each rank its own GPU, cuda:LOCAL_RANK, but this rank's "
                f"LOCAL_RANK is {local_rank} and this machine has {count} CUDA device(s): start "
                f"at most {count} process(es) per node, or pass device='cpu'"
            )
        return torch.device("cuda", local_rank)
    if device == "auto":
        return torch.device("cuda")
    if device == "gpu":
        if not count:
            raise ConfigError("device 'gpu' was asked for, but this machine has no CUDA device")
        return torch.device("cuda", torch.cuda.current_device())
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError):
        raise ConfigError(
            f"device {device!r} is not a device: use 'auto', 'cpu', 'gpu', 'cuda' or 'cuda:N'"
        ) from None
    if resolved.type not in ("cpu", "cuda"):
        raise ConfigError(
            f"device {device!r} is not supported: use 'auto', 'cpu', 'gpu', 'cuda' or 'cuda:N'"
        )
    if resolved.type == "cuda" and not count:
        raise ConfigError(f"device {device!r} was asked for, but this machine has no CUDA device")
    if resolved.type == "cuda" and resolved.index is not None and resolved.index >= count:
        raise ConfigError(
            f"device {device!r} was asked for, but this machine has "
            f"{count} CUDA device(s): use cuda:0 … cuda:{count - 1}"
        )
    return resolved


def as_list(value: Any) -> list:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def eval_loaders(value: Any) -> dict[str, Iterable]:
    """Eval dataloaders by label: one loader is labelled 'eval'."""
    if value is None:
        return {}
    if isinstance(value, Mapping):
        return dict(value)
    return {"eval": value}


def eval_metrics(value: Any, device: torch.device, model: Any = None) -> dict[str, Any]:
    """torchmetrics Metrics by name (from a Metric, a list, a dict or a MetricCollection),
    moved to `device`; given none, a Composer-protocol `model`'s get_metrics(is_train=False)."""
    if value is None and model is not None and callable(getattr(model, "get_metrics", None)):
        value = model.get_metrics(is_train=False) or None
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
            raise ConfigError(
                f"eval_metrics[{name!r}] is a {type(metric).__name__}, not a torchmetrics Metric"
            )
        metric.to(device)
    return items


def eval_intervals(value: Any, loaders: dict[str, Iterable]) -> dict[str, Time]:
    """One interval per eval dataloader label, in epochs or batches (an int means epochs)."""
    per_label = dict(value) if isinstance(value, Mapping) else {label: value for label in loaders}
    unknown = sorted(set(per_label) - set(loaders))
    if unknown:
        raise ConfigError(
            f"eval_interval names {unknown}, which are not eval_dataloader labels "
            f"({sorted(loaders)})"
        )
    out = {}
    for label in loaders:
        raw = per_label.get(label, 1)
        interval = parse_duration(
            f"eval_interval[{label!r}]", f"{raw}ep" if isinstance(raw, int) else raw
        )
        if interval.unit not in (TimeUnit.EPOCH, TimeUnit.BATCH) or interval.value < 1:
            raise ConfigError(
                f"eval_interval {raw!r} for {label!r} must be a positive number of "
                "epochs or batches ('1ep', '100ba')"
            )
        out[label] = interval
    return out


def worker_builtins(
    save_folder: Any,
    folder: Path,
    filename: Any,
    latest_filename: Any,
    interval: Any,
    keep: Any,
    autoresume: bool,
    run_name: str | None,
    load_path: Any,
    publish: bool,
    console: tuple[bool, bool, str],
) -> tuple[dict[str, dict], Any]:
    """What the shared worker builds besides the callbacks — {class name: arguments} of
    Composer's CheckpointSaver (the save_* arguments), ProgressBar and ConsoleLogger
    (`console`: progress_bar, log_to_console, console_stream) — and the checkpoint to load
    (autoresume's, or load_path). The trainer names them; it imports no callback."""
    builtins: dict[str, dict] = {}
    saver = checkpoint_saving(save_folder, filename, latest_filename, interval, keep, publish)
    if saver is not None:
        builtins["CheckpointSaver"] = saver
    progress_bar, log_to_console, stream = console
    if stream not in ("stdout", "stderr"):
        raise ConfigError(f"console_stream must be 'stdout' or 'stderr', got {stream!r}")
    if log_to_console:
        if not publish:
            raise ConfigError(
                "log_to_console=True logs from a worker process and needs publish=True"
            )
        builtins["ConsoleLogger"] = {"stream": stream}
    # a bar redraws in place: only on a terminal (a log file would fill with carriage returns)
    if progress_bar and publish and getattr(sys.stderr, "isatty", lambda: False)():
        builtins["ProgressBar"] = {}
    return builtins, autoresume_path(autoresume, run_name, folder, latest_filename, load_path)


def checkpoint_saving(
    save_folder: Any, filename: Any, latest_filename: Any, interval: Any, keep: Any, publish: bool
) -> dict[str, Any] | None:
    """Composer's save_* arguments: with a `save_folder` and a `save_interval`, the arguments
    of the CheckpointSaver the shared worker runs (it asks at each interval; the trainer
    writes into save_folder, keeps the newest `keep` and points `latest_filename` at the
    newest); None without a save_folder, or with save_interval=None."""
    if save_folder is None or interval is None:
        return None
    if not publish:
        raise ConfigError(
            "save_folder with a save_interval saves through a CheckpointSaver in a worker "
            "process and needs publish=True (or save_interval=None)"
        )
    if isinstance(interval, bool):
        raise ConfigError(f"save_interval {interval!r} is not a duration")
    every = (
        Time(interval, TimeUnit.EPOCH)
        if isinstance(interval, int)
        else parse_duration("save_interval", interval)
    )
    if every.unit not in (TimeUnit.EPOCH, TimeUnit.BATCH) or every.value < 1:
        raise ConfigError(
            f"save_interval {interval!r} must be a positive number of epochs or batches "
            "('1ep', '500ba', or an int of epochs)"
        )
    for name, value in (("save_filename", filename), ("save_latest_filename", latest_filename)):
        if value is not None and not isinstance(value, str):
            raise ConfigError(
                f"{name} must be a str (a format string: {{epoch}}, {{batch}}, {{rank}}, ...), "
                f"got {value!r}"
            )
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < -1:
        raise ConfigError(
            f"save_num_checkpoints_to_keep must be an int >= -1 (-1 keeps all), got {keep!r}"
        )
    return {
        "filename": filename,
        "latest_filename": latest_filename,
        "save_interval": str(every),
        "num_checkpoints_to_keep": keep,
    }


def autoresume_path(
    autoresume: bool,
    run_name: str | None,
    save_folder: Path,
    latest_filename: str | None,
    load_path: Any,
) -> Any:
    """Composer's autoresume: the checkpoint `latest_filename` points at in the save folder,
    if there is one (it wins over load_path); else load_path."""
    if not autoresume:
        return load_path
    if not run_name:
        raise ConfigError(
            "autoresume=True needs a run_name: a resumed run finds its checkpoints by it"
        )
    if not latest_filename:
        raise ConfigError(
            "autoresume=True needs save_latest_filename: it finds the newest checkpoint by it"
        )
    latest = save_folder / latest_filename.format(run_name=run_name, rank=0)
    if latest.exists():
        log.info("offloop: autoresume from %s", latest.resolve())
        return str(latest.resolve())
    return load_path


def microbatch_size(value: Any, grad_accum: int) -> int | None:
    """Composer's device_train_microbatch_size: an int of samples (each batch split into
    microbatches of that size, gradients accumulated); 'auto' is not supported here."""
    if value is None:
        return None
    if value == "auto":
        raise ConfigError(
            "device_train_microbatch_size='auto' is not supported: give the number of samples "
            "a microbatch holds (an int), or grad_accum"
        )
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(
            f"device_train_microbatch_size must be an int >= 1 (samples), got {value!r}"
        )
    if grad_accum != 1:
        raise ConfigError(
            "give device_train_microbatch_size or grad_accum, not both: each sets how a batch "
            "is split"
        )
    return value
