"""Where a worker's logs go: one module per destination, each a `LoggerDestination`.

`base` holds the contract and what destinations share; `console`, `jsonl`, `file`,
`tensorboard` and `tracking` (MLflow, Weights & Biases) one destination each. The public home
is `offloop.loggers`; `workers/logger.py`'s `Logger` calls them, on a thread of their own.
"""

from offloop.workers.destinations.base import LoggerDestination, MissingExtraError
from offloop.workers.destinations.console import ConsoleLogger
from offloop.workers.destinations.file import FileLogger
from offloop.workers.destinations.jsonl import JSONLLogger
from offloop.workers.destinations.tensorboard import TensorBoardLogger, TensorboardLogger
from offloop.workers.destinations.tracking import MLFlowLogger, WandBLogger

__all__ = ["ConsoleLogger", "FileLogger", "JSONLLogger", "LoggerDestination", "MissingExtraError",
           "MLFlowLogger", "TensorBoardLogger", "TensorboardLogger", "WandBLogger"]
