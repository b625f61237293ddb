"""offloop's workers: Composer-style callbacks that run in their own processes."""

from bus import Event
from workers.callback import Callback, NotAttachedError
from workers.logger import ConsoleLogger, JSONLLogger, Logger, LoggerDestination, TensorBoardLogger
from workers.runtime import StopTrainingError, Worker
from workers.state import ReadOnlyStateError, State, Timestamp

__all__ = ["Callback", "Event", "Logger", "State", "Timestamp", "Worker", "StopTrainingError",
           "LoggerDestination", "ConsoleLogger", "JSONLLogger", "TensorBoardLogger",
           "ReadOnlyStateError", "NotAttachedError"]
