"""The run's folder (dump_dir): one run at a time, writable before training, its saved config.

* Lock: rank 0 holds an exclusive `flock` on <dump_dir>/.lock, and on <checkpoint folder>/.lock, for the
  run's lifetime. Two runs on one folder (orphaned workers of a killed torchrun and a rerun; two
  dump_dirs sharing one checkpoint.path) would interleave metrics and checkpoints, and one save would
  remove the other's unfinished folder; the second run stops at once instead. The kernel drops the lock
  when the holder dies, even by kill -9.
* Writability: every rank writes, fsyncs and removes a probe file in the checkpoint folder before
  training, so a read-only or full disk is an error at start, not at the first save hours later.
* Saved config: `config_changes` lists the keys where this run differs from <dump_dir>/config.yaml.
All three raise ConfigError (one `error:` line, exit 2), on every rank alike. `RunFolders` takes the
locks and remembers the folders and lock files taking them created: a run that stops before training
removes those (a folder only while empty), so a refused run leaves the tree as it found it.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import socket
import time

from omegaconf import OmegaConf

from lingua_zeco.args import CONFIG_NAME, ConfigError
from lingua_zeco.reliability import flatten_config, gather_all, rank_world

from .integrity import probe_writable

RUN_ID = ".run_id"  # in dump_dir: {"run_id": ...}, made when a run starts; checkpoint markers record it

LOCK_NAME = ".lock"

log = logging.getLogger(__name__)


def _agree(msg: str | None) -> str | None:
    """Collective: the first rank's error message, on every rank (None if no rank has one)."""
    return next((m for m in gather_all(msg) if m is not None), None)


def not_writable(what: str, e: OSError, fix: str) -> str:
    """One line: `what` could not be written, the OS's reason with its errno name, and what to do."""
    code = errno.errorcode.get(e.errno, str(e.errno)) if e.errno else ""
    return f"{what} is not writable: {e.strerror or e} ({code}); {fix}"


class DumpDirLock:
    """Exclusive, non-blocking flock on <folder>/.lock; holder's pid/host written into it. `key`: the
    config key that names the folder (dump_dir, checkpoint.path), for the messages."""

    def __init__(self, dump_dir: str, key: str = "dump_dir"):
        self.dump_dir, self.path, self.fd, self.key = dump_dir, os.path.join(dump_dir, LOCK_NAME), None, key

    def acquire(self) -> str | None:
        """None when taken, else the error message (in use, or not writable)."""
        try:
            os.makedirs(self.dump_dir, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:
            return not_writable(f"{self.key} {self.dump_dir}", e,
                                f"set {self.key} to a writable folder with free space")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = os.pread(fd, 4096, 0).decode(errors="replace")
            os.close(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                # e.g. a network filesystem mounted without lock support: do not forbid every run there
                log.warning("%s %s: cannot lock %s (%s); running without the one-run-per-folder guard",
                            self.key, self.dump_dir, self.path, e)
                return None
            try:
                h = json.loads(holder)
                who = f"pid {h['pid']} on {h['host']}, started {h['started']}"
            except (ValueError, KeyError, TypeError):
                who = "holder unknown"
            return (f"{self.key} {self.dump_dir} is in use by another run ({who}; it holds {self.path} until it "
                    f"exits). Stop that run (orphaned workers of a killed torchrun count) or use another {self.key}")
        if not _names(self.path, fd):  # a refused run removed the file between our open and flock: a new one
            os.close(fd)
            return self.acquire()
        info = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
        try:  # a full disk lets the file be created and fails here
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(info).encode(), 0)
        except OSError as e:
            os.close(fd)
            return not_writable(f"{self.key} {self.dump_dir}", e, f"free space or set {self.key} to a writable folder")
        self.fd = fd
        return None

    def release(self, remove: bool = False) -> None:
        """Drop the lock; `remove`: delete the lock file first, while still holding it (a run that takes
        the lock after us then opens a new file, never the removed one)."""
        if self.fd is not None:
            if remove:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(self.path)
            os.close(self.fd)  # closing the last descriptor drops the flock
            self.fd = None


def _names(path: str, fd: int) -> bool:
    """Whether `path` still names the file open as `fd`."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)


def _missing(path: str) -> list[str]:
    """`path` and those of its parents that do not exist yet, outermost first."""
    out, path = [], os.path.abspath(path)
    while not os.path.lexists(path) and os.path.dirname(path) != path:
        out.append(path)
        path = os.path.dirname(path)
    return out[::-1]


class RunFolders:
    """The locks of a run's folders (dump_dir, checkpoint folder), and what taking them created. A run
    refused at start (`release(refused=True)`) removes exactly that: its lock files, the run id a start
    records in a folder that had none, and the folders it made when nothing else was put in them; a folder
    or file that was there before stays."""

    def __init__(self, is_master: bool):
        self.is_master, self.locks, self.created = is_master, [], []

    def lock(self, folder: str, key: str = "dump_dir") -> None:
        """Collective: `lock_dump_dir` of `folder`, remembering the folders and lock file it creates."""
        new = _missing(os.path.join(folder, LOCK_NAME)) if self.is_master else []
        self.created += [p for p in new if p not in self.created]
        self.locks.append(lock_dump_dir(folder, self.is_master, key))
        if self.is_master and not os.path.lexists(run_id := os.path.abspath(os.path.join(folder, RUN_ID))):
            self.created.append(run_id)  # the checkpoint manager records it before it loads anything

    def release(self, refused: bool = False) -> None:
        for lock in reversed(self.locks):
            if lock is not None:
                lock.release(remove=refused and os.path.abspath(lock.path) in self.created)
        self.locks = []
        if refused:
            for path in reversed(self.created):  # innermost first; a folder someone wrote into stays
                with contextlib.suppress(OSError):
                    (os.remove if os.path.basename(path) == RUN_ID else os.rmdir)(path)
        self.created = []


def lock_dump_dir(dump_dir: str, is_master: bool, key: str = "dump_dir") -> DumpDirLock | None:
    """Collective: rank 0 takes the lock of the folder (returned; release it at the end); every rank raises
    alike. `key`: the config key naming the folder (dump_dir, or checkpoint.path for the checkpoints)."""
    lock = DumpDirLock(dump_dir, key) if is_master else None
    if (err := _agree(lock.acquire() if lock else None)) is not None:
        if lock:
            lock.release()
        raise ConfigError(err)
    return lock


def check_writable(folder: str) -> None:
    """Collective: every rank probes `folder` (created if missing); a failure anywhere stops every rank."""
    msg = None
    try:
        probe_writable(folder)
    except OSError as e:
        rank = rank_world()[0]
        msg = not_writable(f"checkpoint folder {folder}{f' (rank {rank})' if rank else ''}", e,
                       "set checkpoint.path (or dump_dir) to a writable folder with free space")
    if (err := _agree(msg)) is not None:
        raise ConfigError(err)


def config_changes(dump_dir: str, config: dict, prefixes: tuple[str, ...]) -> tuple[str, list[str]]:
    """(path of the saved config, 'key: saved X, now Y' for the keys under `prefixes` that differ)."""
    path = os.path.join(dump_dir, CONFIG_NAME)
    if not os.path.isfile(path):
        return path, []
    saved = flatten_config(OmegaConf.to_container(OmegaConf.load(path)))
    now = flatten_config(config)
    keys = sorted(k for k in set(saved) | set(now) if k.startswith(prefixes) and saved.get(k) != now.get(k))
    return path, [f"{k}: saved {saved.get(k)!r}, now {now.get(k)!r}" for k in keys]
