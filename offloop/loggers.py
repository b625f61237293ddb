"""Where callbacks' metrics go: `from offloop.loggers import JSONLLogger, TensorBoardLogger`.

The public home of the destinations in `offloop.workers.logger`.
"""

from offloop.workers.logger import (
    ConsoleLogger,
    JSONLLogger,
    Logger,
    LoggerDestination,
    TensorBoardLogger,
)

__all__ = ["ConsoleLogger", "JSONLLogger", "Logger", "LoggerDestination", "TensorBoardLogger"]
