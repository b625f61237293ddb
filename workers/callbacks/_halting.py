"""A halt asked for from a thread of its own, so the worker goes on handling events while
the trainer answers; the answer is logged on the worker's thread once it has come."""

from __future__ import annotations

import threading
from typing import Any


class BackgroundHalt:
    """Mixin for a Callback that halts the run once: `_ask_halt()` from an event method,
    `_report()` from later ones, `wait()` and `_report(final=True)` at close()."""

    #: how long close() waits for the trainer's answer to a halt still in flight
    close_timeout: float = 2.0

    def _init_halt(self) -> None:
        #: the timestamp at which this callback asked for a halt, and the trainer's answer
        self.halted_at = None
        self.halt_ack = None
        self.halt_error: str | None = None
        self._sender: threading.Thread | None = None
        self._reported = False

    def _ask_halt(self, state, logger, reason: str) -> None:
        """Record the decision and send the halt from a thread (none when the run ends here
        anyway); raises NotAttachedError at once when no worker connects this callback."""
        self.halted_at = state.timestamp
        if state.max_duration is not None and state.max_duration.reached(state.timestamp):
            self.halt_error = "the run reaches max_duration here: nothing is left to stop"
            logger.log_text(f"{reason}; training ends here anyway")
            return
        if self._control is None:
            self.halt(reason)  # raises NotAttachedError, which says what is missing
        logger.log_text(f"{reason}; asking the trainer to stop")
        self._sender = threading.Thread(target=self._send_halt, args=(reason,),
                                        name=f"offloop-{type(self).__name__}-halt", daemon=True)
        self._sender.start()

    def _send_halt(self, reason: str) -> None:
        try:
            self.halt_ack = self.halt(reason)
        except Exception as exc:  # reported on the worker's thread by _report()
            self.halt_error = f"{type(exc).__name__}: {exc}"

    def wait(self, timeout: float) -> Any:
        """Wait up to `timeout` seconds for the trainer's answer; returns the ack or None."""
        if self._sender is not None:
            self._sender.join(timeout)
        return self.halt_ack

    def _report(self, logger, final: bool = False) -> None:
        """Log the trainer's answer once it has come (or, at close, that it has not)."""
        if self._reported or self._sender is None or (self._sender.is_alive() and not final):
            return
        self._reported = True
        name, ack = type(self).__name__, self.halt_ack
        if ack is not None and ack.ok:
            logger.log_text(f"{name}: the trainer stopped after batch {ack.result.get('step')}")
        elif ack is not None:
            logger.log_text(f"{name}: the trainer refused the halt: {ack.error}")
        elif self._sender.is_alive():
            logger.log_text(f"{name}: no answer to the halt before the worker closed")
        else:
            logger.log_text(f"{name}: the halt request failed: {self.halt_error}")
