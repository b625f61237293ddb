"""offloop's workers: Composer-style callbacks that run in their own processes."""

from offloop.bus import Event
from offloop.workers.callback import Callback, NotAttachedError, StopTrainingError
from offloop.workers.destinations import (
    ConsoleLogger,
    JSONLLogger,
    LoggerDestination,
    TensorBoardLogger,
    TensorboardLogger,
)
from offloop.workers.logger import Logger
from offloop.workers.runtime import CallbackRuntime, Worker
from offloop.workers.state import ReadOnlyStateError, State, Timestamp
from offloop.workers.state_writer import StateWriter

__all__ = ["Callback", "Event", "Logger", "State", "StateWriter", "Timestamp", "CallbackRuntime",
           "Worker", "StopTrainingError",
           "LoggerDestination", "ConsoleLogger", "JSONLLogger", "TensorboardLogger",
           "TensorBoardLogger",
           "ReadOnlyStateError", "NotAttachedError"]
