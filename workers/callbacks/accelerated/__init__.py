"""pytorch-accelerated's callbacks in an offloop worker: the adapter (`TrainerCallback`, its
`trainer` view and run history), then one module per built-in, keeping its names and options."""

from offloop.workers.callback import StopTrainingError
from offloop.workers.callbacks.accelerated.adapter import HOOKS, OutOfProcessError, TrainerCallback
from offloop.workers.callbacks.accelerated.early_stopping import EarlyStoppingCallback
from offloop.workers.callbacks.accelerated.log_metrics import LogMetricsCallback
from offloop.workers.callbacks.accelerated.move_modules_to_device import MoveModulesToDeviceCallback
from offloop.workers.callbacks.accelerated.print_progress import PrintProgressCallback
from offloop.workers.callbacks.accelerated.progress_bar import ProgressBarCallback
from offloop.workers.callbacks.accelerated.run_history import RUN_HISTORY_TOPICS, RunHistory
from offloop.workers.callbacks.accelerated.save_best_model import SaveBestModelCallback
from offloop.workers.callbacks.accelerated.terminate_on_nan import TerminateOnNaNCallback
from offloop.workers.callbacks.accelerated.trainer_view import RunConfig, TrainerView

__all__ = [
    "TrainerCallback",
    "StopTrainingError",
    "RunHistory",
    "RunConfig",
    "TrainerView",
    "TerminateOnNaNCallback",
    "LogMetricsCallback",
    "PrintProgressCallback",
    "ProgressBarCallback",
    "SaveBestModelCallback",
    "EarlyStoppingCallback",
    "MoveModulesToDeviceCallback",
    "OutOfProcessError",
    "HOOKS",
    "RUN_HISTORY_TOPICS",
]
