"""Where metrics go: `Trainer(loggers=[TensorboardLogger(), MLFlowLogger(), WandBLogger(),
FileLogger()])`, with Composer's names and arguments; `from offloop.loggers import ...`.

The public home of the destinations in `offloop.workers.destinations`, one module each, and of
the `Logger` callbacks call. They all run in a worker process, never on the training thread.
`TensorBoardLogger` is the same class as `TensorboardLogger` (Composer's spelling).
"""

from offloop.workers.destinations import (
    ConsoleLogger,
    FileLogger,
    JSONLLogger,
    LoggerDestination,
    MissingExtraError,
    MLFlowLogger,
    TensorBoardLogger,
    TensorboardLogger,
    WandBLogger,
)
from offloop.workers.logger import Logger

__all__ = ["ConsoleLogger", "FileLogger", "JSONLLogger", "Logger", "LoggerDestination",
           "MLFlowLogger", "MissingExtraError", "TensorBoardLogger", "TensorboardLogger",
           "WandBLogger"]
