"""Python's garbage collector on the training loop's schedule (gc.every).

Automatic generational collection runs whenever enough objects were allocated, which is at some step of
some rank: a rank that stops for a collection holds up every collective of the others. gc.every=N turns it
off for the loop and runs a young-generation collection (generations 0 and 1) every N steps, at the same
step on every rank; one full collection at the start clears what building the run left behind.
"""
from __future__ import annotations

import contextlib
import gc
import logging
import time
from dataclasses import dataclass

from lingua_zeco.args import ConfigError

logger = logging.getLogger(__name__)

GENERATION = 1  # the young generations: long-lived objects (modules, tensors' owners) are seldom garbage


@dataclass
class GCArgs:
    every: int = 0  # 0: Python's automatic collection (as before); N > 0: off, and a collection every N steps

    def check(self) -> None:
        if self.every < 0:
            raise ConfigError(f"gc.every={self.every} must be >= 0 (0 = Python's automatic garbage collection)")


class _Scheduled:
    def __init__(self, every: int):
        self.every = every

    def step(self, step: int) -> None:
        """Call once after every training step (`step`: the steps done, counted over resumes)."""
        if self.every and step % self.every == 0:
            collect(GENERATION, f"step {step}")


def collect(generation: int, when: str) -> None:
    t0 = time.perf_counter()
    gc.collect(generation)
    logger.debug("gc: generation %d collection at %s took %.2f ms", generation, when,
                 1e3 * (time.perf_counter() - t0))


@contextlib.contextmanager
def collecting(args: GCArgs):
    """Yield an object with `.step(step)`; with gc.every > 0, automatic collection is off inside."""
    args.check()
    if args.every == 0:
        yield _Scheduled(0)
        return
    was_enabled = gc.isenabled()
    gc.disable()
    collect(2, "the start")
    try:
        yield _Scheduled(args.every)
    finally:
        if was_enabled:
            gc.enable()
