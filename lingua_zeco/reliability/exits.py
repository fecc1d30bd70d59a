"""Failures to one line on stderr and the documented exit code (the table in the package docstring)."""
from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import signal
import sys
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from lingua_zeco.args import ConfigError
from lingua_zeco.reliability.errors import CollectiveError, NonFiniteError, StorageError

log = logging.getLogger(__package__)  # "lingua_zeco.reliability" in log lines, one name for the package

EXIT_FAILED, EXIT_BAD_INPUT = 1, 2  # a clean end (a stop signal included) exits 0


@contextlib.contextmanager
def clean_exit():
    """Turn the failures of errors.py (and bad input) into one line on stderr and the documented exit code.
    LINGUA_ZECO_DEBUG=1 prints the traceback as well. Bad input found by every rank alike (a typo under
    torchrun) is printed once, by rank 0 (`BadInputOnce`). Ctrl-C outside the training loop (where
    stop signals are not yet, or no longer, turned into a checkpoint) ends with one line and exit 0:
    nothing is half-written, the newest complete checkpoint stays the one a rerun resumes from.

    Leaving, it collects the garbage: process groups that a finished run left in reference cycles (a model
    holding its SP context) are otherwise freed during the interpreter's shutdown, when gloo's worker
    threads can no longer take the GIL and abort the process ("terminate called without an active
    exception", exit 134) after a run that succeeded."""
    try:
        yield
    except (ConfigError, FileNotFoundError, ValueError, NonFiniteError, CollectiveError, StorageError) as e:
        if os.environ.get("LINGUA_ZECO_DEBUG") == "1":
            log.exception("traceback")
        code = EXIT_FAILED if isinstance(e, (NonFiniteError, CollectiveError, StorageError)) else EXIT_BAD_INPUT
        rank = os.environ.get("RANK")
        once = BadInputOnce() if code == EXIT_BAD_INPUT else None
        if once is None or once.should_print(str(e)):
            shared = once is not None and once.store is not None and once.rank == 0  # every rank's message
            line = f"error{f' (rank {rank})' if rank and not shared else ''}: {e}"
            if not to_launcher(line):
                print(line, file=sys.stderr, flush=True)
        else:  # rank 0 reports this very message: a second later, so that torchrun names rank 0 the root cause
            to_launcher("stopped on the same bad input as rank 0, which reports it", delay_s=1)
        sys.stdout.flush()
        if once is not None:
            once.leave()
        if isinstance(e, CollectiveError):
            os._exit(code)  # the broken group's threads may block or abort the normal interpreter exit
        sys.exit(code)
    except KeyboardInterrupt:
        print("stopped by SIGINT (Ctrl-C) outside the training loop: nothing was left half-written; rerun the "
              "same command to start or resume", file=sys.stderr, flush=True)
        sys.exit(0)
    finally:
        gc.collect()


def to_launcher(line: str, delay_s: int = 0) -> bool:
    """Under torchrun: write `line` as this worker's error file (TORCHELASTIC_ERROR_FILE), which torchrun's
    failure summary, printed last, shows as the worker's `traceback :` in place of a link to its docs;
    the summary's root cause is the worker with the earliest time (`delay_s` later than now). False when
    there is no file to write (not under torchrun, or its logs off): print the line instead."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return False
    data = {"message": {"message": line, "extraInfo": {"timestamp": str(int(time.time()) + delay_s)}}}
    try:
        with open(path, "w") as f:
            json.dump(data, f)
    except OSError:
        return False
    return True


class BadInputOnce:
    """Under torchrun, every rank usually finds the same bad input (same argv, same files): print it once.

    Through the launcher's key-value store (torchrun's agent store, reachable before any process group
    exists): each rank posts its message; rank 0 prints its own; another rank prints only a message rank 0
    did not post within a few seconds (bad input on that rank alone). The ranks then leave together, SIGTERM
    ignored meanwhile: torchrun sends it to the others once one has exited, which would turn their exit 2
    into a death by signal. Without the agent store (a plain run, another launcher) every rank prints."""

    WAIT_S = 5.0

    def __init__(self):
        self.rank, self.world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
        self.prefix = f"lingua_zeco/bad_input/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/msg"
        self.store = None
        if self.world > 1 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            try:
                self.store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                           is_master=False, timeout=timedelta(seconds=self.WAIT_S))
            except (RuntimeError, KeyError, ValueError):  # no store to reach: every rank prints
                self.store = None

    def _posted(self, ranks) -> bool:
        try:
            self.store.wait([f"{self.prefix}{r}" for r in ranks], timedelta(seconds=self.WAIT_S))
            return True
        except RuntimeError:  # timed out: some rank is elsewhere (its input was fine)
            return False

    def should_print(self, message: str) -> bool:
        if self.store is None:
            return True
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        self.store.set(f"{self.prefix}{self.rank}", message)
        if self.rank == 0:
            return True
        return not (self._posted([0]) and self.store.get(f"{self.prefix}0").decode() == message)

    def leave(self) -> None:
        if self.store is not None:
            self._posted(range(self.world))  # every rank is on its way to exit 2 (or WAIT_S passed)
