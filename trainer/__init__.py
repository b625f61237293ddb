"""offloop's trainer: Composer's training loop, publishing every event off the loop."""

from offloop.bus import Event, Time, Timestamp, TimeUnit
from offloop.trainer.errors import CheckpointError, ConfigError, TrainerError
from offloop.trainer.trainer import Trainer

__all__ = ["Trainer", "Event", "Time", "TimeUnit", "Timestamp", "ConfigError", "CheckpointError",
           "TrainerError"]
