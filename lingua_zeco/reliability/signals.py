"""Stop signals become a flag; the step boundary turns the flag into a checkpoint and exit 0."""
from __future__ import annotations

import signal
import threading

STOP_SIGNALS = ("SIGTERM", "SIGUSR2", "SIGINT")


class StopSignals:
    """Context manager that turns SIGTERM/SIGUSR2/SIGINT into a flag (main thread only; elsewhere a no-op)."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled and threading.current_thread() is threading.main_thread()
        self.received: int | None = None
        self._previous: dict[int, object] = {}

    def _handle(self, signum, frame):
        self.received = signum
        # A second one of the same kind terminates: the default action, not the previous handler, which
        # may be SIG_IGN inherited from the launcher (the second would then be lost) or, for SIGINT,
        # Python's KeyboardInterrupt (not delivered while a collective blocks in C++).
        signal.signal(signum, signal.SIG_DFL)

    @property
    def name(self) -> str | None:
        return signal.Signals(self.received).name if self.received is not None else None

    def __enter__(self):
        if self.enabled:
            signums = [getattr(signal, n) for n in STOP_SIGNALS if hasattr(signal, n)]
            self._previous = {s: signal.signal(s, self._handle) for s in signums}
        return self

    def __exit__(self, *exc):
        for s, prev in self._previous.items():
            signal.signal(s, prev)
        self._previous.clear()
        return False
