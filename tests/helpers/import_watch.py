"""A callback that says what its worker process has imported, in a module that imports
nothing but offloop: a worker rebuilding it imports this module alone."""

from __future__ import annotations

import sys

from offloop.workers import Callback


class ReportsTorch(Callback):
    """Logs, at the end of the fit, whether torch was ever imported in its worker."""

    def fit_end(self, state, logger) -> None:
        logger.log_metrics({"worker/torch_imported": float("torch" in sys.modules)})
