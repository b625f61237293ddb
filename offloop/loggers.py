"""Where metrics go: `Trainer(loggers=[TensorboardLogger(), MLFlowLogger(), WandBLogger(),
FileLogger()])`, with Composer's names and arguments; `from offloop.loggers import ...`.

The public home of the destinations in `offloop.workers.logger` and
`offloop.workers.tracking`. They all run in a worker process, never on the training thread.
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
from offloop.workers.tracking import MissingExtraError, MLFlowLogger, WandBLogger

__all__ = ["ConsoleLogger", "FileLogger", "JSONLLogger", "Logger", "LoggerDestination", "MLFlowLogger",
           "MissingExtraError", "TensorBoardLogger", "TensorboardLogger", "WandBLogger"]
