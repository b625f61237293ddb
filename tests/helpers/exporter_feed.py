"""Drives a PrometheusExporter with synthetic messages through a real State, as a worker would:
for series a CPU run cannot produce (CUDA allocator counters) and exact expected values."""

from __future__ import annotations

from offloop.bus import Message
from offloop.workers.callbacks import PrometheusExporter
from offloop.workers.logger import Logger
from offloop.workers.state import State
from offloop.workers.state_writer import StateWriter


class ExporterFeed:
    """One exporter, one State, messages numbered in order."""

    def __init__(self, exporter: PrometheusExporter, run: str) -> None:
        self.exporter, self.run = exporter, run
        self.state = State()
        self.writer = StateWriter(self.state)
        self.logger = Logger(self.state, [])
        self.seq = 0

    def event(self, topic: str, t: float, ts: tuple, **data) -> None:
        self.seq += 1
        self.writer.fold(Message(topic, "event", self.run, "pub", 0, self.seq, self.seq, t, ts,
                                 data))
        if topic != "grad_norms":  # it only updates the state, as in a worker
            getattr(self.exporter, topic)(self.state, self.logger)
