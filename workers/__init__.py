"""offloop's workers: Composer-style callbacks that run in their own processes."""

from offloop.bus import Event
from offloop.workers.callback import Callback, NotAttachedError
from offloop.workers.logger import (
           ConsoleLogger,
           JSONLLogger,
           Logger,
           LoggerDestination,
           TensorBoardLogger,
)
from offloop.workers.runtime import StopTrainingError, Worker
from offloop.workers.state import ReadOnlyStateError, State, Timestamp

__all__ = ["Callback", "Event", "Logger", "State", "Timestamp", "Worker", "StopTrainingError",
           "LoggerDestination", "ConsoleLogger", "JSONLLogger", "TensorBoardLogger",
           "ReadOnlyStateError", "NotAttachedError"]
