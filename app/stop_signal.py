"""Graceful stop on SIGINT (Ctrl-C) and SIGTERM (torchrun, job schedulers): finish the current step, checkpoint, exit.

The first signal only sets a flag: the job checks it between steps (on the main rank, shared with every rank so
that all ranks stop after the same step), saves a checkpoint and exits with 128 + the signal number (130 for
SIGINT, 143 for SIGTERM, the shell's convention). A second signal abandons the current step at once: it raises
`StepAbandoned`, and the job saves the last consistent state (that of the last finished step) before exiting.
`StepAbandoned` is a BaseException, like KeyboardInterrupt, so that library code catching `Exception` (a subprocess
probe, an engine's start-up wrapping its failures) lets it through wherever the signal lands.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType

__all__ = ["StopSignal", "StepAbandoned"]

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StepAbandoned(BaseException):
    """A second stop signal arrived during a step."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"{signal.Signals(signum).name} received twice: the step was abandoned")
        self.signum = signum

    def __reduce__(self):
        return type(self), (self.signum,)


class StopSignal:
    """Context manager installing the handlers (main thread only; elsewhere it does nothing) and restoring the
    previous ones on exit. `received` is the first signal's number, or None."""

    def __init__(self, announce=None) -> None:
        self.received: int | None = None
        self._announce = announce
        self._previous: dict[int, object] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is not None:
            raise StepAbandoned(signum)
        self.received = signum
        if self._announce is not None:
            self._announce(f"{signal.Signals(signum).name} received: stopping after this step with a checkpoint "
                           "(send it again to stop now)")

    @property
    def exit_code(self) -> int:
        return 128 + int(self.received or 0)

    def __enter__(self) -> "StopSignal":
        if threading.current_thread() is threading.main_thread():
            for s in SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()
