"""Where metrics go: `Trainer(loggers=[TensorboardLogger(), FileLogger()])`, with Composer's
names and arguments; `from offloop.loggers import TensorboardLogger, FileLogger`.

The public home of the destinations in `offloop.workers.logger`.
"""

from offloop.workers.logger import (
    ConsoleLogger,
    FileLogger,
    JSONLLogger,
    Logger,
    LoggerDestination,
    TensorBoardLogger,
    TensorboardLogger,
)

__all__ = ["ConsoleLogger", "FileLogger", "JSONLLogger", "Logger", "LoggerDestination", "TensorBoardLogger",
           "TensorboardLogger"]
