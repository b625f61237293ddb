"""The `trainer` a hook receives in a worker: `TrainerView`, and the `RunConfig` it offers.

Promise: both are read-only; what only the trainer's process has raises an AttributeError saying so.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from types import MappingProxyType
from typing import Any

from offloop.workers.callbacks.accelerated.run_history import RunHistory

__all__ = ["ReadOnly", "RunConfig", "TrainerView"]


class ReadOnly:
    """Attributes are set while `__init__` runs, which ends with `_seal()`; after that, setting
    one raises AttributeError with the subclass's `_refusal(name)`."""

    _sealed = False

    def _seal(self) -> None:
        self._sealed = True

    def __setattr__(self, name: str, value: Any) -> None:
        if self._sealed:
            raise AttributeError(self._refusal(name))
        super().__setattr__(name, value)

    def __delattr__(self, name: str) -> None:
        raise AttributeError(self._refusal(name))

    def _refusal(self, name: str) -> str:
        return f"cannot set {name}: {type(self).__name__} is read-only"


_PRECISION = {"fp32": "no", "amp_fp16": "fp16", "amp_bf16": "bf16"}


class RunConfig(ReadOnly, Mapping):
    """pytorch-accelerated's TrainerRunConfig, read from the run's published config: by
    attribute (`run_config.num_epochs`) or by key (`run_config["num_epochs"]`). Keys of
    offloop's own config (run_name, seed, precision, …) are there too. Unknown to a worker,
    and so None: gradient_clip_value and the eval batch sizes."""

    def __init__(self, state) -> None:
        config = dict(state.config)
        world = int(config.get("world_size") or 1)
        steps, batch_size = state.dataloader_len, state.batch_size
        self._values = MappingProxyType({**config, **_num_steps(state.max_duration, steps), **{
            "train_per_device_batch_size": batch_size,
            "train_total_batch_size": batch_size * world if batch_size else None,
            "eval_per_device_batch_size": None,
            "eval_total_batch_size": None,
            "train_dl_kwargs": {},
            "eval_dl_kwargs": {},
            "gradient_accumulation_steps": config.get("grad_accum", 1),
            "gradient_clip_value": None,
            "num_update_steps_per_epoch": steps,
            "num_local_update_steps_per_epoch": steps,
            "is_local_process_zero": state.rank == 0,
            "is_world_process_zero": state.rank == 0,
            "is_distributed": world > 1,
            "mixed_precision": _PRECISION.get(config.get("precision"), config.get("precision")),
            "num_processes": world,
        }})
        self._seal()

    def __getitem__(self, key: str) -> Any:
        return self._values[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        try:
            return self._values[name]
        except KeyError:
            raise AttributeError(f"run_config has no {name!r}; it has {', '.join(sorted(self._values))}") from None

    def _refusal(self, name: str) -> str:
        return f"cannot set run_config.{name}: run_config is read-only, it describes the trainer's run"

    def to_dict(self) -> dict[str, Any]:
        return dict(self._values)


def _num_steps(duration, steps: int | None) -> dict[str, int | None]:
    """num_epochs and max_num_train_steps from max_duration ('3ep' or '500ba')."""
    unit = getattr(getattr(duration, "unit", None), "value", None)
    if unit == "ep":
        return {"num_epochs": duration.value, "max_num_train_steps": None}
    if unit == "ba":
        return {"num_epochs": math.ceil(duration.value / steps) if steps else None,
                "max_num_train_steps": duration.value}
    return {"num_epochs": None, "max_num_train_steps": None}


class TrainerView(ReadOnly):
    """The `trainer` a pytorch-accelerated hook receives in a worker: `state` (the offloop
    State), `run_history`, `run_config`, `logger` (the worker's Logger), `device` (the CPU:
    published tensors arrive on the host) and `print()`. The trainer itself is in another
    process; anything else raises AttributeError saying so."""

    def __init__(self, state, logger=None, run_history: RunHistory | None = None) -> None:
        self.state = state
        self.logger = logger
        self.run_history = run_history if run_history is not None else RunHistory()
        self._seal()

    @property
    def run_config(self) -> RunConfig:
        return RunConfig(self.state)

    @property
    def device(self):
        import torch

        return torch.device("cpu")

    def print(self, *args: Any, sep: str = " ", **_: Any) -> None:
        """Print once, as pytorch-accelerated's `trainer.print` does: through the worker's logger."""
        text = sep.join(str(a) for a in args).strip("\n")
        if self.logger is not None:
            self.logger.log_text(text)
        else:
            print(text, flush=True)

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(
            f"trainer.{name} is not available to a callback in an offloop worker: the trainer "
            "runs in another process and publishes read-only snapshots. Read trainer.state, "
            "trainer.run_history or trainer.run_config; to change the run, raise StopTrainingError "
            "or call self.halt() / self.request_checkpoint()"
        )

    def _refusal(self, name: str) -> str:
        return (f"cannot set trainer.{name}: a worker observes the run (the trainer is in another "
                "process); ask it with self.halt() or self.request_checkpoint()")
