"""Test hook: LINGUA_ZECO_FAULT makes the process signal itself after a given step."""
from __future__ import annotations

import logging
import os
import signal
import sys

from lingua_zeco.args import ConfigError

log = logging.getLogger(__package__)  # "lingua_zeco.reliability" in log lines, one name for the package


class FaultInjection:
    """LINGUA_ZECO_FAULT="SIGKILL@12" or "SIGSTOP@3:1": signal this process after that step (on that rank).
    Several comma-separated faults are sent in order, e.g. "SIGUSR2@2,SIGUSR2@2" (a second signal)."""

    def __init__(self, rank: int):
        spec = os.environ.get("LINGUA_ZECO_FAULT", "")
        self.faults: list[tuple[int, int]] = []  # (step, signum)
        for one in filter(None, spec.split(",")):
            try:
                name, rest = one.split("@")
                step, _, only_rank = rest.partition(":")
                if not only_rank or int(only_rank) == rank:
                    self.faults.append((int(step), getattr(signal, name)))
            except (ValueError, AttributeError) as e:
                raise ConfigError(f"LINGUA_ZECO_FAULT={spec!r}: expected SIGNAME@STEP or SIGNAME@STEP:RANK, "
                                  f"comma-separated") from e

    def after_step(self, step: int) -> None:
        for at, signum in self.faults:
            if at == step:
                log.warning("LINGUA_ZECO_FAULT: sending %s to myself after step %d", signal.Signals(signum).name, step)
                sys.stdout.flush()
                sys.stderr.flush()
                os.kill(os.getpid(), signum)
