"""Composer's `RuntimeEstimator`: time left, from progress toward max_duration.

Progress is the fraction of max_duration done (in its unit; epochs count batches, so
an estimate moves within an epoch); time is the trainer's publish time of each event.
Training time extrapolates linearly; evaluations still to come are added at their
average duration and observed frequency.
"""

from __future__ import annotations

from offloop.bus import TimeUnit
from offloop.workers.callback import Callback
from offloop.workers.callbacks.speed_monitor import time_divider

__all__ = ["RuntimeEstimator"]


class RuntimeEstimator(Callback):
    """Logs the estimated time to completion at each batch_end after `skip_batches`.

    Keys: `wall_clock/remaining_estimate` and `time/remaining_estimate` (the same value,
    under the key of older and of current Composer), in `time_unit`; the unit is logged
    once as the hyperparameter `time/remaining_estimate_unit`.

    Args:
        skip_batches: batches to let pass before starting the clock (the first ones are
            slow: data loader start-up, caches, compilation).
        time_unit: 'seconds', 'minutes', 'hours' or 'days'.
    """

    def __init__(self, skip_batches: int = 1, time_unit: str = "hours") -> None:
        if isinstance(skip_batches, bool) or not isinstance(skip_batches, int) or skip_batches < 0:
            raise ValueError(f"RuntimeEstimator: skip_batches must be an int >= 0, got {skip_batches!r}")
        self.time_unit = time_unit
        self.divider = time_divider("RuntimeEstimator", time_unit)
        self.batches_left_to_skip = skip_batches
        self.start_time: float | None = None
        self.start_dur: float | None = None
        self.total_eval_wct = 0.0
        self.eval_wct_per_label: dict[str, list[float]] = {}
        self.eval_frequency_per_label: dict[str, float] = {}
        self._enabled = True
        self._unit_logged = False
        self._eval_start: float | None = None

    def _log_unit(self, logger) -> None:
        if not self._unit_logged:
            self._unit_logged = True
            logger.log_hyperparameters({"time/remaining_estimate_unit": self.time_unit})

    def init(self, state, logger) -> None:
        self._log_unit(logger)

    def fit_start(self, state, logger) -> None:
        self._log_unit(logger)

    def batch_start(self, state, logger) -> None:
        if not self._enabled or self.start_time is not None or self.batches_left_to_skip:
            return
        self.start_time, self.start_dur = state.wall_time, _elapsed_duration(state)
        if self.start_dur is None:
            self._enabled = False
            logger.log_text("RuntimeEstimator: the run has no max_duration; no estimate is possible")

    def batch_end(self, state, logger) -> None:
        if not self._enabled:
            return
        if self.batches_left_to_skip > 0:
            self.batches_left_to_skip -= 1
            return
        if self.start_time is None:  # this worker joined mid-batch: start at the next batch
            return
        elapsed_dur = _elapsed_duration(state)
        if elapsed_dur is None or elapsed_dur <= self.start_dur:
            return
        elapsed_time = state.wall_time - self.start_time - self.total_eval_wct
        remaining = elapsed_time / (elapsed_dur - self.start_dur) * max(0.0, 1.0 - elapsed_dur)
        remaining += self._remaining_eval_time()
        value = max(0.0, remaining) / self.divider
        logger.log_metrics({"wall_clock/remaining_estimate": value, "time/remaining_estimate": value})

    def _remaining_eval_time(self) -> float:
        """Evaluations still to come, each at its label's average time (the first one, often
        slow, left out once there are more) and at its observed frequency."""
        total = 0.0
        for label, wcts in self.eval_wct_per_label.items():
            average = sum(wcts[1:]) / (len(wcts) - 1) if len(wcts) > 1 else wcts[0]
            rate = self.eval_frequency_per_label.get(label, 0.0)
            if rate > 0:
                total += average * max(0.0, (1 - self.start_dur) / rate - len(wcts))
        return total

    def eval_start(self, state, logger) -> None:
        self._eval_start = state.wall_time

    def eval_end(self, state, logger) -> None:
        began, self._eval_start = self._eval_start, None
        if not self._enabled or self.start_time is None or began is None:
            return  # evaluations before the clock started do not count
        wct = max(0.0, state.wall_time - began)
        self.total_eval_wct += wct
        label = state.dataloader_label or "eval"
        self.eval_wct_per_label.setdefault(label, []).append(wct)
        elapsed_dur = _elapsed_duration(state)
        if elapsed_dur is not None:
            done = len(self.eval_wct_per_label[label])
            self.eval_frequency_per_label[label] = (elapsed_dur - self.start_dur) / done


def _elapsed_duration(state) -> float | None:
    """The fraction of max_duration done; in epochs, counted in batches (Composer's rule)."""
    duration, ts = state.max_duration, state.timestamp
    if duration is None or duration.value <= 0:
        return None
    if duration.unit is TimeUnit.EPOCH:
        if ts.epoch >= 1:
            batches_per_epoch = (ts.batch - ts.batch_in_epoch) / ts.epoch
            if batches_per_epoch > 0:
                return ts.batch / (duration.value * batches_per_epoch)
        if state.dataloader_len:
            return ts.batch / (duration.value * state.dataloader_len)
    return ts.get(duration.unit) / duration.value
