"""offloop's trainer: Composer's training loop, publishing every event off the loop."""

from bus import Event, Time, TimeUnit
from trainer.errors import CheckpointError, ConfigError, TrainerError
from trainer.timestamp import Timestamp
from trainer.trainer import Trainer

__all__ = ["Trainer", "Event", "Time", "TimeUnit", "Timestamp", "ConfigError", "CheckpointError",
           "TrainerError"]
