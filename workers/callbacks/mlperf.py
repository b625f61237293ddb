"""Composer's `MLPerfCallback`, logging from a worker process: an MLPerf Training result file.

Each line is `:::MLLOG {json}` in the mlperf_logging format, stamped with the time the
trainer published the event (not when the worker read it); the run ends with
`run_stop` status `success` once the target is reached, or `aborted` at the end.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any

from offloop.workers.callback import Callback
from offloop.workers.callbacks._halting import BackgroundHalt

__all__ = ["MLPerfCallback", "get_system_description"]

# the options Composer's callback supports
BENCHMARKS = ("resnet", "bert")
DIVISIONS = ("open",)
STATUS = ("onprem", "cloud", "preview")

# mlperf_logging's event types
_POINT, _START, _END = "POINT_IN_TIME", "INTERVAL_START", "INTERVAL_END"


class MLPerfCallback(BackgroundHalt, Callback):
    """Write an MLPerf Training result file for the run (Composer's MLPerfCallback).

    The submission folder gets Composer's layout::

        root_folder/
            results/[system_name]/[benchmark]/result_[index].txt
            systems/[system_name].json

    Args:
        root_folder: the submission folder.
        index: the repetition index of this run: the file is `result_[index].txt`.
        benchmark: 'resnet' (time counted in epochs) or 'bert' (in samples).
        target: the value of the metric that ends the timed run (`run_stop` success).
        division: 'open' (the only division supported, as in Composer).
        metric_name: the eval metric compared with the target, as the trainer names it
            (`Trainer(eval_metrics=MulticlassAccuracy(...))` -> 'MulticlassAccuracy').
        metric_label: the eval dataloader's label ('eval' for a single one).
        submitter: the submitting organisation.
        system_name: the system's name. Default: '[world_size]x[device name]_offloop'.
        status: 'onprem', 'cloud' or 'preview'.
        cache_clear_cmd: a command run (by the worker, once, before `init_start`) to clear
            the system's caches; MLPerf compliance needs it.
        host_processors_per_node: recorded in the system description.
        exit_at_target: ask the trainer to halt once the target is reached.
    """

    def __init__(
        self,
        root_folder: str | os.PathLike,
        index: int,
        benchmark: str = "resnet",
        target: float = 0.759,
        division: str = "open",
        metric_name: str = "MulticlassAccuracy",
        metric_label: str = "eval",
        submitter: str = "MosaicML",
        system_name: str | None = None,
        status: str = "onprem",
        cache_clear_cmd: str | None = None,
        host_processors_per_node: int | None = None,
        exit_at_target: bool = False,
    ) -> None:
        if benchmark not in BENCHMARKS:
            raise ValueError(f"MLPerfCallback: benchmark {benchmark!r} must be one of {BENCHMARKS}")
        if division not in DIVISIONS:
            raise ValueError(f"MLPerfCallback: division {division!r} must be one of {DIVISIONS}")
        if status not in STATUS:
            raise ValueError(f"MLPerfCallback: status {status!r} must be one of {STATUS}")
        if isinstance(index, bool) or not isinstance(index, int) or index < 0:
            raise ValueError(f"MLPerfCallback: index must be an int >= 0, got {index!r}")
        if isinstance(target, bool) or not isinstance(target, (int, float)):
            raise ValueError(f"MLPerfCallback: target must be a number, got {target!r}")
        for option, value in (("metric_name", metric_name), ("metric_label", metric_label)):
            if not isinstance(value, str) or not value:
                raise ValueError(f"MLPerfCallback: {option} must be a non-empty string, got {value!r}")
        self.root_folder = str(root_folder)
        self.index = index
        self.benchmark, self.target, self.division = benchmark, float(target), division
        self.metric_name, self.metric_label = metric_name, metric_label
        self.submitter, self.status = submitter, status
        self.cache_clear_cmd = cache_clear_cmd
        self.host_processors_per_node = host_processors_per_node
        self.exit_at_target = bool(exit_at_target)
        self.system_name = system_name
        self.filename: str | None = None
        self.systems_path: str | None = None
        if system_name is not None:
            self._set_paths(system_name)
            if os.path.exists(self.filename):
                raise FileExistsError(f"MLPerfCallback: {self.filename} already exists; "
                                      "use another index or root_folder")
        #: True once the target was reached (run_stop status success written)
        self.success = False
        #: (time value, metric value) at each evaluation, in order
        self.accuracies: list[tuple[int, float]] = []
        #: where exit_at_target asked for a halt (halted_at), and the answer (halt_ack, halt_error)
        self._init_halt()
        self._file: IO[str] | None = None
        self._logged: set[str] = set()
        self._stopped = False  # run_stop written: nothing more goes into the file

    def __getstate__(self) -> dict[str, Any]:
        """Picklable (the trainer sends each callback to its worker process): no file, no
        thread, no control connection."""
        state = {**self.__dict__, "_file": None, "_sender": None}
        state.pop("_control", None)
        return state

    # ------------------------------------------------------------- events

    def init(self, state, logger) -> None:
        self._open(state, logger)

    def fit_start(self, state, logger) -> None:
        self._open(state, logger)
        config = state.config
        hparams = {
            "seed": config.get("seed"),
            "global_batch_size": _times(config.get("train_batch_size"), state.world_size),
            "gradient_accumulation_steps": config.get("grad_accum"),
            "train_samples": config.get("train_samples"),
            "eval_samples": (config.get("eval_samples") or {}).get(self.metric_label),
        }
        for key, value in hparams.items():
            if value is not None:
                self._once(state, key, value)
        self._event(state, "init_stop", event_type=_END)
        self._event(state, "run_start", event_type=_START)

    def batch_end(self, state, logger) -> None:
        self._report(logger)
        if "global_batch_size" not in self._logged and state.batch_size:
            self._once(state, "global_batch_size", _times(state.batch_size, state.world_size))

    def epoch_start(self, state, logger) -> None:
        self._open(state, logger)
        first = self._time(state) + (1 if self.benchmark == "resnet" else 0)
        self._event(state, "epoch_start", metadata={"epoch_num": first}, event_type=_START)
        self._event(state, "block_start", metadata={"first_epoch_num": first, "epoch_count": 1},
                    event_type=_START)

    def epoch_end(self, state, logger) -> None:
        self._event(state, "epoch_stop", metadata={"epoch_num": self._time(state)}, event_type=_END)
        if "train_samples" not in self._logged and state.timestamp.epoch == 1:
            self._once(state, "train_samples", state.timestamp.sample * max(state.world_size, 1))

    def eval_start(self, state, logger) -> None:
        if state.dataloader_label == self.metric_label:
            self._event(state, "eval_start", metadata={"epoch_num": self._time(state)}, event_type=_START)

    def eval_end(self, state, logger) -> None:
        if state.dataloader_label != self.metric_label:
            return
        accuracy = self._accuracy(state)
        now = self._time(state)
        self.accuracies.append((now, accuracy))
        self._event(state, "eval_stop", metadata={"epoch_num": now}, event_type=_END)
        self._event(state, "eval_accuracy", accuracy, metadata={"epoch_num": now})
        self._event(state, "block_stop", metadata={"first_epoch_num": now}, event_type=_END)
        if accuracy >= self.target and not self.success:
            self.success = True
            self._run_stop(state, "success")
            logger.log_text(f"MLPerfCallback: {self.metric_name} {accuracy:.6g} reached the target "
                            f"{self.target:.6g} at {self._unit()} {now}")
            if self.exit_at_target:
                self._halt(state, logger, accuracy)

    def fit_end(self, state, logger) -> None:
        self._run_stop(state, "aborted")
        self._close_file()

    def close(self, state, logger) -> None:
        if self._file is not None:  # the worker stops before fit_end (the trainer fell silent)
            self._run_stop(state, "aborted")
            self._close_file()
        self.wait(self.close_timeout)
        self._report(logger, final=True)

    # ------------------------------------------------------------- the file

    def _set_paths(self, system_name: str) -> None:
        self.system_name = system_name
        self.systems_path = os.path.join(self.root_folder, "systems", f"{system_name}.json")
        self.filename = os.path.join(self.root_folder, "results", system_name, self.benchmark,
                                     f"result_{self.index}.txt")

    def _open(self, state, logger) -> None:
        """Start the result file at the first event this worker sees (init, or later when
        it joined a run already under way): system description, cache clear, init_start."""
        if self._file is not None or self._stopped:
            return
        config = state.config
        desc = get_system_description(self.submitter, self.division, self.status, self.system_name,
                                      self.host_processors_per_node, world_size=state.world_size,
                                      device=str(config.get("device", "cpu")),
                                      device_name=config.get("device_name"))
        if self.filename is None:
            self._set_paths(desc["system_name"])
        Path(self.filename).parent.mkdir(parents=True, exist_ok=True)
        Path(self.systems_path).parent.mkdir(parents=True, exist_ok=True)
        Path(self.systems_path).write_text(json.dumps(desc, indent=4))
        try:
            self._file = open(self.filename, "x", buffering=1)  # noqa: SIM115 - held for the run
        except FileExistsError:
            raise FileExistsError(f"MLPerfCallback: {self.filename} already exists; use another "
                                  "index or root_folder") from None
        if self.cache_clear_cmd is not None:
            subprocess.run(self.cache_clear_cmd.split(), check=True, text=True)
            self._event(state, "cache_clear", True, event_type=_START)
        else:
            logger.log_text("MLPerfCallback: cache_clear_cmd was not given; a valid submission "
                            "clears the system's caches before the run")
        self._event(state, "init_start", event_type=_START)
        for key, value in (("submission_benchmark", self.benchmark),
                           ("submission_division", self.division),
                           ("submission_org", self.submitter),
                           ("submission_platform", self.system_name),
                           ("submission_status", self.status)):
            self._event(state, key, value)

    def _event(self, state, key: str, value: Any = None, metadata: dict | None = None,
               event_type: str = _POINT) -> None:
        if self._file is None or self._stopped:
            return
        wall = state.wall_time or time.time()
        line = {"namespace": "", "time_ms": int(wall * 1000), "event_type": event_type,
                "key": key, "value": value, "metadata": metadata or {}}
        self._file.write(":::MLLOG " + json.dumps(line) + "\n")

    def _once(self, state, key: str, value: Any) -> None:
        self._logged.add(key)
        self._event(state, key, value)

    def _run_stop(self, state, status: str) -> None:
        if self._file is None or self._stopped:
            return
        self._event(state, "run_stop", metadata={"status": status}, event_type=_END)
        self._stopped = True

    def _close_file(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    # ------------------------------------------------------------- reading

    def _unit(self) -> str:
        return "epoch" if self.benchmark == "resnet" else "sample"

    def _time(self, state) -> int:
        """Composer's benchmark time: epochs for resnet, samples for bert."""
        ts = state.timestamp
        return ts.epoch if self.benchmark == "resnet" else ts.sample

    def _accuracy(self, state) -> float:
        metrics = state.eval_metrics.get(self.metric_label, {})
        if self.metric_name not in metrics:
            raise ValueError(f"MLPerfCallback: {self.metric_name!r} must be an eval metric of "
                             f"{self.metric_label!r}; the trainer published {sorted(metrics)} "
                             "(set metric_name, or Trainer(eval_metrics=...))")
        value = metrics[self.metric_name]
        return float(value.item() if hasattr(value, "item") else value)

    # ------------------------------------------------------------- halting

    def _halt(self, state, logger, accuracy: float) -> None:
        self._ask_halt(state, logger, f"MLPerfCallback: {self.metric_name} {accuracy:.6g} "
                                      f"reached the target {self.target:.6g}")


def _times(value: Any, world_size: int) -> int | None:
    return None if value is None else int(value) * max(int(world_size or 1), 1)


def get_system_description(
    submitter: str,
    division: str,
    status: str,
    system_name: str | None = None,
    host_processors_per_node: int | None = None,
    *,
    world_size: int = 1,
    device: str = "cpu",
    device_name: str | None = None,
) -> dict[str, Any]:
    """MLPerf's system description, filled in as far as this machine tells (check it by
    hand before submitting). Reads no accelerator: a worker must not claim GPU memory."""
    is_cuda = device.startswith("cuda")
    # the trainer publishes device_name "cpu" on the CPU: that is no accelerator
    accelerator = (device_name or _gpu_model()) if is_cuda else ""
    cpu = _cpu_model()
    desc: dict[str, Any] = {
        "submitter": submitter,
        "division": division,
        "status": status,
        "number_of_nodes": "1",
        "host_processors_per_node": str(host_processors_per_node) if host_processors_per_node else "",
        "host_processor_model_name": cpu,
        "host_processor_core_count": str(os.cpu_count() or ""),
        "host_processor_vcpu_count": "",
        "host_processor_frequency": "",
        "host_processor_caches": "",
        "host_processor_interconnect": "",
        "host_memory_capacity": "",
        "host_storage_type": "",
        "host_storage_capacity": "",
        "host_networking": "",
        "host_networking_topology": "",
        "host_memory_configuration": "",
        "accelerators_per_node": str(world_size) if is_cuda else "0",
        "accelerator_model_name": accelerator,
        "accelerator_host_interconnect": "",
        "accelerator_frequency": "",
        "accelerator_on-chip_memories": "",
        "accelerator_memory_configuration": "",
        "accelerator_memory_capacity": "",
        "accelerator_interconnect": "",
        "accelerator_interconnect_topology": "",
        "cooling": "",
        "hw_notes": "",
        "framework": f"PyTorch v{_version('torch')} and offloop v{_version('offloop')}",
        "other_software_stack": {"python_version": sys.version},
        "operating_system": f"{platform.system()} {platform.release()}",
        "sw_notes": "",
    }
    if system_name is None:
        name = (accelerator if is_cuda and accelerator else cpu or "CPU").replace(" ", "_")
        system_name = f"{world_size}x{name}_offloop"
    desc["system_name"] = system_name
    return desc


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "CPU"


def _gpu_model() -> str:
    """The first NVIDIA GPU's model from the driver's /proc files (no CUDA context)."""
    try:
        for info in sorted(Path("/proc/driver/nvidia/gpus").glob("*/information")):
            for line in info.read_text().splitlines():
                if line.startswith("Model:"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "GPU"


def _version(dist: str) -> str:
    try:
        from importlib.metadata import version

        return version(dist)
    except Exception:
        return "unknown"
