"""offloop's trainer: Composer's training loop, publishing every event off the loop."""

from offloop.bus import Event, Time, Timestamp, TimeUnit
from offloop.trainer.errors import CheckpointError, ConfigError, TrainerError
from offloop.trainer.trainer import Trainer
from offloop.trainer.user_metrics import log_metrics

__all__ = ["Trainer", "Event", "Time", "TimeUnit", "Timestamp", "ConfigError", "CheckpointError",
           "TrainerError", "log_metrics"]
