"""One way a built-in callback halts the run: once per training run, never after the trainer's
last batch, asked from a thread of its own (`_ask_halt`) or from the worker's (`_halt_now`)."""

from __future__ import annotations

import threading
from typing import Any

from offloop.bus import Event
from offloop.bus.control import Ack


def past_last_batch(state) -> str | None:
    """Why a halt asked for now would stop nothing, or None: the trainer applies requests at
    its batch boundaries, and once its last batch has trained there is none left."""
    if state.event is Event.FIT_END:
        return "the run has ended: its last batch has trained, nothing is left to stop"
    if state.max_duration is not None and state.max_duration.reached(state.timestamp):
        return "the run reaches max_duration here, after its last batch: nothing is left to stop"
    return None


class BackgroundHalt:
    """Mixin for a Callback that halts the run once: `_ask_halt()` from an event method,
    `_report()` from later ones, `wait()` and `_report(final=True)` at close(); or
    `_halt_now()`, which waits for the answer on the worker's thread and returns it."""

    #: how long close() waits for the trainer's answer to a halt still in flight
    close_timeout: float = 2.0

    # read before _init_halt() runs too: pytorch-accelerated subclasses skip the base __init__
    halted_at = None
    halt_ack: Ack | None = None
    halt_error: str | None = None
    _sender: threading.Thread | None = None
    _reported = False

    def _init_halt(self) -> None:
        #: the timestamp at which this callback asked for a halt, and the trainer's answer
        self.halted_at = None
        self.halt_ack = None
        self.halt_error = None
        self._sender = None
        self._reported = False

    def _ask_halt(self, state, logger, reason: str) -> None:
        """Record the decision and send the halt from a thread (none when the run ends here
        anyway); raises NotAttachedError at once when no worker connects this callback."""
        self.halted_at = state.timestamp
        self.halt_error = past_last_batch(state)
        if self.halt_error is not None:
            logger.log_text(f"{reason}; training ends here anyway")
            return
        if self.control_handle is None:
            self.halt(reason)  # raises NotAttachedError, which says what is missing
        logger.log_text(f"{reason}; asking the trainer to stop")
        self._sender = threading.Thread(target=self._send_halt, args=(reason,),
                                        name=f"offloop-{type(self).__name__}-halt", daemon=True)
        self._sender.start()
        if state.decision_awaited:  # the trainer waits at this event: answered before it goes on
            self._sender.join(self.control_timeout)

    def _send_halt(self, reason: str) -> None:
        try:
            self.halt_ack = self.halt(reason)
        except Exception as exc:  # reported on the worker's thread by _report()
            self.halt_error = f"{type(exc).__name__}: {exc}"

    def _halt_now(self, state, reason: str) -> Ack:
        """The same request, waited for: a second one in the same training run returns the
        first answer, and after the last batch the answer (not ok) comes without asking."""
        if self.halt_ack is not None and self.halt_ack.ok:
            return self.halt_ack
        self.halted_at = state.timestamp
        self.halt_error = past_last_batch(state)
        if self.halt_error is not None:
            self.halt_ack = Ack("", 0, "halt", False, {"step": state.timestamp.batch}, self.halt_error)
        else:
            self.halt_ack = super().halt(reason)  # Callback.halt: over the control channel
        return self.halt_ack

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
