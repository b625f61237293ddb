"""Every built-in callback, importable from here:
`from offloop.workers.callbacks import EarlyStopper` (or `from offloop.callbacks import ...`).

Names resolve lazily (PEP 562), so `offloop worker` loads only the callbacks it runs
and a read-only command never imports torch through this package. Adding one: a module
here and a line in `BUILTINS` (docs/adding-a-callback.md).
"""

from __future__ import annotations

import importlib
from typing import Any

#: public name -> module under workers.callbacks
BUILTINS: dict[str, str] = {
    # Composer's callbacks
    "CheckpointSaver": "checkpoint_saver",
    "SpeedMonitor": "speed_monitor",
    "LRMonitor": "lr_monitor",
    "GradMonitor": "grad_monitor",
    "OptimizerMonitor": "grad_monitor",
    "MemoryMonitor": "memory_monitor",
    "RuntimeEstimator": "runtime_estimator",
    "ImageVisualizer": "image_visualizer",
    "MLPerfCallback": "mlperf",
    "ThresholdStopper": "stoppers",
    "EarlyStopper": "stoppers",
    "ExportForInferenceCallback": "export",
    # pytorch-accelerated's callbacks
    "TrainerCallback": "accelerated.adapter",
    "TerminateOnNaNCallback": "accelerated.terminate_on_nan",
    "LogMetricsCallback": "accelerated.log_metrics",
    "PrintProgressCallback": "accelerated.print_progress",
    "ProgressBarCallback": "accelerated.progress_bar",
    "SaveBestModelCallback": "accelerated.save_best_model",
    "EarlyStoppingCallback": "accelerated.early_stopping",
    "MoveModulesToDeviceCallback": "accelerated.move_modules_to_device",
    # metrics computed in the worker from published eval outputs
    "ClassificationMetricsCallback": "metrics",
    # offloop's own
    "Recorder": "recorder",
    "PrometheusExporter": "prometheus",
}

__all__ = sorted(BUILTINS)


def __getattr__(name: str) -> Any:
    if name not in BUILTINS:
        raise AttributeError(f"offloop.callbacks has no callback {name!r}; built-ins: {', '.join(__all__)}")
    module = importlib.import_module(f"offloop.workers.callbacks.{BUILTINS[name]}")
    return getattr(module, name)


def __dir__() -> list[str]:
    return __all__
