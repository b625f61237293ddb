"""Composer's `SpeedMonitor`: throughput, MFU and wall-clock time, from published times.

Times are the trainer's publish times of each event (`state.wall_time`), so the
numbers describe the trainer even when this worker reads its events late; time
spent evaluating (eval_start to eval_end) is kept out of the training clock.
"""

from __future__ import annotations

from collections import deque

from offloop.workers.callback import Callback

__all__ = ["SpeedMonitor", "GPU_AVAILABLE_FLOPS", "TIME_UNITS"]

#: peak dense flops per GPU and precision (Composer's table; NVIDIA's data sheets)
GPU_AVAILABLE_FLOPS: dict[str, dict[str, float]] = {
    "h100-sxm": {"fp64": 67e12, "fp32": 67e12, "tf32": 989e12 / 2, "fp16": 1.979e15 / 2,
                 "amp_fp16": 1.979e15 / 2, "bf16": 1.979e15 / 2, "amp_bf16": 1.979e15 / 2,
                 "fp8": 3.958e15 / 2, "amp_fp8": 3.958e15 / 2, "int8": 3.958e15 / 2},
    "h100-pcie": {"fp64": 51e12, "fp32": 51e12, "tf32": 756e12 / 2, "fp16": 1.513e15 / 2,
                  "amp_fp16": 1.513e15 / 2, "bf16": 1.513e15 / 2, "amp_bf16": 1.513e15 / 2,
                  "fp8": 3.026e15 / 2, "amp_fp8": 3.026e15 / 2, "int8": 3.026e15 / 2},
    "a100": {"fp64": 19.5e12, "fp32": 19.5e12, "tf32": 156e12, "fp16": 312e12, "amp_fp16": 312e12,
             "bf16": 312e12, "amp_bf16": 312e12},
    "v100-sxm": {"fp64": 7.8e12, "fp32": 15.7e12, "fp16": 125e12, "amp_fp16": 125e12},
    "v100-pcie": {"fp64": 7e12, "fp32": 14e12, "fp16": 112e12, "amp_fp16": 112e12},
    "v100s-pcie": {"fp64": 8.2e12, "fp32": 16.4e12, "fp16": 130e12, "amp_fp16": 130e12},
    "t4": {"fp32": 8.1e12, "fp16": 65e12, "amp_fp16": 65e12, "int8": 130e12, "int4": 260e12},
}

#: seconds per unit for the `time_unit` options
TIME_UNITS = {"seconds": 1.0, "minutes": 60.0, "hours": 3600.0, "days": 86400.0}


def time_divider(owner: str, time_unit: str) -> float:
    try:
        return TIME_UNITS[time_unit]
    except KeyError:
        raise ValueError(f"{owner}: invalid time_unit {time_unit!r}; use one of "
                         f"{', '.join(repr(u) for u in TIME_UNITS)}") from None


def gpu_flops_available(device_name: str | None, precision: str | None) -> float | None:
    """Peak flops for a CUDA device name ('NVIDIA H100 80GB HBM3') at a precision, if known."""
    if not device_name or not precision:
        return None
    name = device_name.lower()
    if "h100" in name and "hbm3" in name or "h100-sxm" in name:
        key = "h100-sxm"
    elif "h100" in name and ("pcie" in name or "hbm2e" in name):
        key = "h100-pcie"
    else:
        key = next((k for k in ("a100", "v100-sxm", "v100-pcie", "v100s-pcie", "t4") if k in name), None)
    return GPU_AVAILABLE_FLOPS[key].get(precision) if key else None


class SpeedMonitor(Callback):
    """Logs throughput over the last `window_size` batches and the wall-clock time.

    Keys (Composer's): throughput/batches_per_sec, throughput/samples_per_sec,
    throughput/tokens_per_sec (when tokens are counted), throughput/flops_per_sec
    (when the model defines flops_per_batch), each also as throughput/device/... (per
    device), throughput/device/mfu (when peak flops are known), and wall_clock/train,
    wall_clock/val, wall_clock/total in `time_unit`.

    Args:
        window_size: batches in the rolling window; throughput is logged once
            window_size + 1 batch ends have been seen.
        gpu_flops_available: peak flops of one device, for MFU. None: looked up from
            the run config's `device_name` and `precision` when the trainer publishes them.
        time_unit: 'seconds', 'minutes', 'hours' or 'days', for wall_clock/*.
    """

    def __init__(self, window_size: int = 100, gpu_flops_available: float | None = None,
                 time_unit: str = "hours") -> None:
        if isinstance(window_size, bool) or not isinstance(window_size, int) or window_size < 1:
            raise ValueError(f"SpeedMonitor: window_size must be an int >= 1, got {window_size!r}")
        if gpu_flops_available is not None and not gpu_flops_available > 0:
            raise ValueError(f"SpeedMonitor: gpu_flops_available must be > 0, got {gpu_flops_available!r}")
        self.window_size = window_size
        self.gpu_flops_available = gpu_flops_available
        self.divider = time_divider("SpeedMonitor", time_unit)
        # (batch, sample, token, train seconds) at each batch end, and flops per batch
        self.history: deque[tuple[int, int, int, float]] = deque(maxlen=window_size + 1)
        self.history_flops: deque[float] = deque(maxlen=window_size + 1)
        self.total_eval_wct = 0.0
        self._fit_start: float | None = None
        self._eval_start: float | None = None

    def fit_start(self, state, logger) -> None:
        self._fit_start = state.wall_time
        if self.gpu_flops_available is None:
            self.gpu_flops_available = gpu_flops_available(state.config.get("device_name"),
                                                           state.config.get("precision"))

    def eval_start(self, state, logger) -> None:
        self._eval_start = state.wall_time

    def eval_end(self, state, logger) -> None:
        if self._eval_start is not None:
            self.total_eval_wct += max(0.0, state.wall_time - self._eval_start)
            self._eval_start = None

    def batch_end(self, state, logger) -> None:
        if self._fit_start is None:  # joined mid-run: the clock starts at the first batch seen
            self._fit_start = state.wall_time
        ts = state.timestamp
        train_wct = max(0.0, state.wall_time - self._fit_start - self.total_eval_wct)
        self.history.append((ts.batch, ts.sample, ts.token, train_wct))
        metrics: dict[str, float] = {}
        world_size = max(1, int(state.world_size or 1))
        if len(self.history) == self.history.maxlen:
            metrics.update(self._throughput(world_size))
        if state.flops is not None:
            self.history_flops.append(float(state.flops))
        else:
            self.history_flops.clear()
        if len(self.history_flops) == self.history_flops.maxlen and len(self.history) == self.history.maxlen:
            metrics.update(self._flops(world_size))
        metrics.update({
            "wall_clock/train": train_wct / self.divider,
            "wall_clock/val": self.total_eval_wct / self.divider,
            "wall_clock/total": (train_wct + self.total_eval_wct) / self.divider,
        })
        logger.log_metrics(metrics)

    def _elapsed(self) -> float:
        return self.history[-1][3] - self.history[0][3]

    def _throughput(self, world_size: int) -> dict[str, float]:
        (b0, s0, t0, _), (b1, s1, t1, _) = self.history[0], self.history[-1]
        elapsed = self._elapsed()
        if elapsed <= 0:
            return {}
        # counters are this rank's: samples and tokens over all ranks are world_size times more
        batches_per_sec = (b1 - b0) / elapsed
        samples_per_sec = (s1 - s0) * world_size / elapsed
        out = {
            "throughput/batches_per_sec": batches_per_sec,
            "throughput/samples_per_sec": samples_per_sec,
            "throughput/device/batches_per_sec": batches_per_sec / world_size,
            "throughput/device/samples_per_sec": samples_per_sec / world_size,
        }
        if t1 > t0:
            tokens_per_sec = (t1 - t0) * world_size / elapsed
            out["throughput/tokens_per_sec"] = tokens_per_sec
            out["throughput/device/tokens_per_sec"] = tokens_per_sec / world_size
        return out

    def _flops(self, world_size: int) -> dict[str, float]:
        elapsed = self._elapsed()
        if elapsed <= 0:
            return {}
        # flops of the window's batches after the first (its end opens the window)
        device_flops_per_sec = (sum(self.history_flops) - self.history_flops[0]) / elapsed
        out = {"throughput/flops_per_sec": device_flops_per_sec * world_size,
               "throughput/device/flops_per_sec": device_flops_per_sec}
        if self.gpu_flops_available:
            out["throughput/device/mfu"] = device_flops_per_sec / self.gpu_flops_available
        return out
