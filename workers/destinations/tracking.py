"""Experiment trackers as logger destinations: `MLFlowLogger` and `WandBLogger`, with
Composer's names and arguments. They run in the worker that holds the run's loggers, so
their clients, threads and network calls never touch the training thread.

Each is built in the training process (arguments checked there, the library only looked
up, since importing mlflow takes seconds) and opens its run in the worker, when
`init(state, logger)` tells it the run's name and rank.
"""

from __future__ import annotations

import fnmatch
import math
import os
import time
from typing import TYPE_CHECKING, Any

from offloop.workers.destinations.base import (
    LoggerDestination,
    MissingExtraError,
    jsonable,
    require_extra,
)
from offloop.workers.scalars import as_float, as_scalar

if TYPE_CHECKING:  # imported where images are made: a worker starts without numpy
    import numpy as np

__all__ = ["MLFlowLogger", "WandBLogger", "MissingExtraError"]

# the events after which a run ended as it should; any other last event means the trainer stopped
_CLEAN_ENDS = frozenset({"fit_end", "eval_standalone_end", "predict_end"})


def _ended_cleanly(state) -> bool:
    event = getattr(state, "event", None)
    return getattr(event, "value", event) in _CLEAN_ENDS


def _patterns(owner: str, name: str, value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str) or not all(isinstance(item, str) for item in value):
        raise ValueError(f"{owner}: {name} must be a list of glob patterns (str), got {value!r}")
    return list(value)


class _TrackerLogger(LoggerDestination):
    """What both trackers share: their live client is not sent to the worker (`_LIVE`), and
    `init` says whether this rank logs and its run still has to be opened."""

    _LIVE: tuple[str, ...] = ("_state",)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, **dict.fromkeys(self._LIVE)}

    def _opens_here(self, state, opened: bool) -> bool:
        self._state = state
        self._enabled = not self.rank_zero_only or state.rank == 0
        return self._enabled and not opened


class MLFlowLogger(_TrackerLogger):
    """Composer's MLFlowLogger: one MLflow run per training run, in `experiment_name`
    (`$MLFLOW_EXPERIMENT_NAME` or "Default"), named after the run unless `run_name` is
    given; metrics (an unchanged value is sent again only every
    `log_duplicated_metric_every_n_steps` steps), hyperparameters as params, `tags`, and
    images. The run is marked FINISHED when the trainer ended cleanly, FAILED otherwise.
    Needs the `mlflow` extra."""

    def __init__(self, experiment_name: str | None = None, run_name: str | None = None,
                 tags: dict[str, Any] | None = None, tracking_uri: str | os.PathLike | None = None,
                 rank_zero_only: bool = True, flush_interval: int = 10, synchronous: bool = False,
                 log_system_metrics: bool = True, rename_metrics: dict[str, str] | None = None,
                 ignore_metrics: list[str] | None = None, ignore_hyperparameters: list[str] | None = None,
                 run_group: str | None = None, resume: bool = False,
                 logging_buffer_seconds: int | None = 10, log_duplicated_metric_every_n_steps: int = 100) -> None:
        require_extra("mlflow", "MLFlowLogger", "mlflow")
        for name, value in (("experiment_name", experiment_name), ("run_name", run_name), ("run_group", run_group)):
            if value is not None and not isinstance(value, str):
                raise ValueError(f"MLFlowLogger: {name} must be a str, got {value!r}")
        if tags is not None and not isinstance(tags, dict):
            raise ValueError(f"MLFlowLogger: tags must be a dict, got {tags!r}")
        for name, value in (("flush_interval", flush_interval),
                            ("log_duplicated_metric_every_n_steps", log_duplicated_metric_every_n_steps)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"MLFlowLogger: {name} must be an int >= 0, got {value!r}")
        self.experiment_name, self.run_name, self.run_group = experiment_name, run_name, run_group
        self.tags = dict(tags or {})
        self.tracking_uri = str(tracking_uri) if tracking_uri is not None else None
        self.rank_zero_only, self.flush_interval, self.synchronous = rank_zero_only, flush_interval, synchronous
        self.log_system_metrics, self.resume = log_system_metrics, resume
        self.rename_metrics = dict(rename_metrics or {})
        self.ignore_metrics = _patterns("MLFlowLogger", "ignore_metrics", ignore_metrics)
        self.ignore_hyperparameters = _patterns("MLFlowLogger", "ignore_hyperparameters", ignore_hyperparameters)
        self.logging_buffer_seconds = logging_buffer_seconds
        self.log_duplicated_metric_every_n_steps = log_duplicated_metric_every_n_steps
        self.run_id: str | None = None
        self.experiment_id: str | None = None
        self._enabled = False
        self._state = None
        self._client = None
        self._cache: dict[str, tuple[float, int]] = {}
        self._last_flush = 0.0

    _LIVE = ("_client", "_state")

    def init(self, state, logger) -> None:
        if not self._opens_here(state, self.run_id is not None):
            return
        if self.logging_buffer_seconds:
            os.environ["MLFLOW_ASYNC_LOGGING_BUFFERING_SECONDS"] = str(self.logging_buffer_seconds)
        import mlflow
        from mlflow import MlflowClient

        self.tracking_uri = self.tracking_uri or mlflow.get_tracking_uri()
        mlflow.set_tracking_uri(self.tracking_uri)
        self._client = MlflowClient(self.tracking_uri)
        name = self.experiment_name or os.environ.get("MLFLOW_EXPERIMENT_NAME", "Default")
        self.experiment_name = name
        found = self._client.get_experiment_by_name(name)
        self.experiment_id = found.experiment_id if found is not None else self._client.create_experiment(name)
        run_name = self.run_name or state.run_name or None
        tags = {"run_name": state.run_name or run_name or "", **self.tags}
        if self.run_group:
            tags["run_group"] = self.run_group
        self.run_id = self._existing_run(tags["run_name"]) if self.resume else None
        if self.run_id is None:
            self.run_id = self._client.create_run(self.experiment_id, run_name=run_name).info.run_id
        mlflow.start_run(run_id=self.run_id, tags=tags, log_system_metrics=self.log_system_metrics)
        self._last_flush = time.monotonic()

    def _existing_run(self, run_name: str) -> str | None:
        runs = self._client.search_runs([self.experiment_id], filter_string=f'tags.run_name = "{run_name}"',
                                        max_results=1)
        return runs[0].info.run_id if runs else None

    def log_metrics(self, metrics: dict[str, Any], step: int) -> None:
        if not self._enabled or self.run_id is None:
            return
        import mlflow

        due: dict[str, float] = {}
        for key, value in metrics.items():
            number = as_float(value)
            if number is None or any(fnmatch.fnmatch(key, pattern) for pattern in self.ignore_metrics):
                continue
            last = self._cache.get(key)
            if last is not None and _same(last[0], number) and step < last[1] + self.log_duplicated_metric_every_n_steps:
                continue
            self._cache[key] = (number, step)
            due[self.rename_metrics.get(key, key)] = number
        if due:
            mlflow.log_metrics(due, step=step, synchronous=self.synchronous)
        if not self.synchronous and time.monotonic() - self._last_flush >= self.flush_interval:
            self.flush()

    def log_hyperparameters(self, hparams: dict[str, Any]) -> None:
        if not self._enabled or self.run_id is None:
            return
        import mlflow

        params = {key: value for key, value in jsonable(hparams).items()
                  if not any(fnmatch.fnmatch(key, pattern) for pattern in self.ignore_hyperparameters)}
        if params:
            mlflow.log_params(params, synchronous=self.synchronous)

    def log_images(self, images: list[np.ndarray], name: str, step: int) -> None:
        if not self._enabled or self.run_id is None:
            return
        for index, image in enumerate(images):
            self._client.log_image(self.run_id, _unit_range(image), key=f"{name}_{index}", step=step)

    def log_table(self, columns: list[str], rows: list[list[Any]], name: str, step: int) -> None:
        if not self._enabled or self.run_id is None:
            return
        data = {column: [jsonable(row[index]) for row in rows] for index, column in enumerate(columns)}
        self._client.log_table(self.run_id, data=data, artifact_file=f"{name}.json")

    def flush(self) -> None:
        if self._enabled and self.run_id is not None and not self.synchronous:
            import mlflow

            mlflow.flush_async_logging()
            self._last_flush = time.monotonic()

    def close(self) -> None:
        if not self._enabled or self.run_id is None or self._client is None:
            return
        import mlflow

        self.flush()
        self._client.set_terminated(self.run_id, status="FINISHED" if _ended_cleanly(self._state) else "FAILED")
        mlflow.end_run()
        self._client = None


def _same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


def _unit_range(image: np.ndarray) -> np.ndarray:
    """uint8 as it is; floats clipped to [0, 1], as MLflow's and wandb's image types want."""
    import numpy as np

    if image.dtype == np.uint8:
        return image
    return np.clip(image.astype(np.float32), 0.0, 1.0)


class WandBLogger(_TrackerLogger):
    """Composer's WandBLogger: a wandb run named after the training run unless `name` is
    given (`-rank{N}` added with `rank_zero_only=False`, grouped by the run's name);
    metrics with `run.log` at their step, hyperparameters in `run.config`, images and
    tables. `init_kwargs` go to `wandb.init` (`{"mode": "offline"}` to log without an
    account). Needs the `wandb` extra."""

    def __init__(self, project: str | None = None, group: str | None = None, name: str | None = None,
                 entity: str | None = None, tags: list[str] | None = None, log_artifacts: bool = False,
                 rank_zero_only: bool = True, init_kwargs: dict[str, Any] | None = None) -> None:
        require_extra("wandb", "WandBLogger", "wandb")
        if init_kwargs is not None and not isinstance(init_kwargs, dict):
            raise ValueError(f"WandBLogger: init_kwargs must be a dict of wandb.init arguments, got {init_kwargs!r}")
        if log_artifacts:
            raise ValueError("WandBLogger: log_artifacts=True is not supported: checkpoints stay where "
                             "CheckpointSaver writes them (upload them with wandb's own tools)")
        self.init_kwargs = dict(init_kwargs or {})
        for key, value in (("project", project), ("group", group), ("name", name), ("entity", entity),
                           ("tags", tags)):
            if value is not None:
                self.init_kwargs[key] = list(value) if key == "tags" else value
        self.project, self.entity = project, entity
        self.rank_zero_only = rank_zero_only
        self.run_dir: str | None = None
        self._enabled = False
        self._state = None
        self._run = None

    _LIVE = ("_run", "_state")

    def init(self, state, logger) -> None:
        if not self._opens_here(state, self._run is not None):
            return
        import wandb

        kwargs = dict(self.init_kwargs)
        kwargs["name"] = kwargs.get("name") or state.run_name or None
        if not self.rank_zero_only:
            kwargs.setdefault("group", kwargs["name"])
            kwargs["name"] = f"{kwargs['name']}-rank{state.rank}"
        self._run = wandb.init(**kwargs)
        self.run_dir = self._run.dir
        self.project, self.entity = self._run.project, self._run.entity

    def log_metrics(self, metrics: dict[str, Any], step: int) -> None:
        if self._run is None:
            return
        self._run.log({key: as_scalar(value) for key, value in metrics.items()}, step=step)

    def log_hyperparameters(self, hparams: dict[str, Any]) -> None:
        if self._run is not None:
            self._run.config.update(jsonable(hparams), allow_val_change=True)

    def log_images(self, images: list[np.ndarray], name: str, step: int) -> None:
        if self._run is None:
            return
        import wandb

        self._run.log({name: [wandb.Image(_unit_range(image)) for image in images]}, step=step)

    def log_table(self, columns: list[str], rows: list[list[Any]], name: str, step: int) -> None:
        if self._run is None:
            return
        import wandb

        self._run.log({name: wandb.Table(columns=columns, rows=[jsonable(row) for row in rows])}, step=step)

    def close(self) -> None:
        if self._run is not None:
            self._run.finish(exit_code=0 if _ended_cleanly(self._state) else 1)
            self._run = None
