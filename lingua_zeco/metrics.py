"""Training metrics: a jsonl file (appended, so a resumed run continues it), optional wandb, and the
throughput numbers the paper reports.

The file is strict JSON (NaN/inf are written as null) and holds each step once: a resumed run first
removes the records after its checkpoint's step (the steps it is about to redo). A write that fails
(a full disk) is undone, so no half line stays, and raises MetricsWriteError.

tokens/s/GPU = tokens this GPU processed in the step / step time, where the step time is the
slowest rank's (a step ends for everybody when the slowest rank finishes). MFU uses the honest GLA
FLOP count from the model (no quadratic attention term).
"""
from __future__ import annotations

import errno
import json
import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from lingua_zeco.args import ConfigError, at_least

from lingua_zeco.reliability import StorageError

log = logging.getLogger(__name__)

# Dense bf16 peak per GPU (vendor datasheets, no sparsity), matched on the device name.
PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "H800": 989e12, "A100": 312e12, "A800": 312e12, "L40S": 362e12}


@dataclass
class LoggingArgs:
    freq: int = 10  # log every `freq` steps (and steps 1 and the last)
    metrics_file: str = "metrics.jsonl"  # relative to dump_dir
    wandb: str = "disabled"  # disabled | online | offline
    wandb_project: str = "lingua-zeco"
    wandb_run: str = ""  # empty: the run's name
    peak_flops: float = 0.0  # per GPU; 0 = look the device up (MFU is left out when unknown)

    def check(self) -> None:
        at_least({"logging.freq": self.freq})


def peak_flops(device: torch.device, override: float = 0.0) -> float:
    if override > 0:
        return override
    if device.type != "cuda":
        return 0.0
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), 0.0)


def memory_stats(device: torch.device) -> dict:
    if device.type != "cuda":  # peak resident memory of this process (Linux reports KiB)
        import resource
        return dict(mem_gib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20)
    gib = 2**30
    return dict(mem_alloc_gib=torch.cuda.memory_allocated(device) / gib,
                mem_gib=torch.cuda.max_memory_allocated(device) / gib,  # peak allocated
                mem_reserved_gib=torch.cuda.max_memory_reserved(device) / gib)


def throughput(tokens_per_gpu: int, step_time_s: float, flops_per_token: float, peak: float) -> dict:
    tps = tokens_per_gpu / step_time_s if step_time_s > 0 else 0.0
    out = dict(tok_per_s_per_gpu=tps, tflops_per_gpu=tps * flops_per_token / 1e12)
    if peak > 0:
        out["mfu"] = tps * flops_per_token / peak
    return out


def duration_text(seconds: float) -> str:
    """'H:MM:SS', with days in front past 24 hours ('3d 04:05:06'); any non-negative number of seconds, huge
    ones included (a run of 10^20 steps), where time.gmtime would overflow and %H would wrap at a day."""
    if not math.isfinite(seconds) or seconds >= 1e15:
        return "never" if seconds > 0 else "?"
    days, rest = divmod(int(max(seconds, 0)), 86400)
    text = f"{rest // 3600:02d}:{rest // 60 % 60:02d}:{rest % 60:02d}"
    return f"{days}d {text}" if days else text


class StepTimer:
    """Mean seconds per step over a logging window, with no synchronisation per step. Marks are CUDA
    events (perf_counter on CPU); `pause()`/`resume()` leave logging, evaluation and checkpoints out
    of the window; `window()` waits for the last mark only."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.n, self.last_n = 0, 0
        self._segments = []  # closed (start, end) marks of the current window
        self._start = self._mark()

    def _mark(self):
        if not self.cuda:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def step(self) -> None:
        self.n += 1

    def pause(self) -> None:
        if self._start is not None:
            self._segments.append((self._start, self._mark()))
            self._start = None

    def resume(self) -> None:
        if self._start is None:
            self._start = self._mark()

    def window(self) -> float:
        """Mean step time since the last window; the next window starts now (or at resume())."""
        running = self._start is not None
        self.pause()
        if self.cuda and self._segments:
            self._segments[-1][1].synchronize()
            dt = sum(a.elapsed_time(b) * 1e-3 for a, b in self._segments)
        else:
            dt = sum(b - a for a, b in self._segments)
        self._segments, self.last_n, self.n = [], self.n, 0
        if running:
            self.resume()
        return dt / max(self.last_n, 1)


class MetricsWriteError(StorageError):
    """metrics.jsonl could not be appended to (full disk...); nothing of the record was left in it."""


def _strict(v):
    """JSON has no NaN/inf: such floats become null (strict parsers reject Python's bare NaN)."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: _strict(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_strict(x) for x in v]
    return v


class MetricLogger:
    """Rank 0 writes; other ranks hold a logger that does nothing, so call sites need no `if`.
    resume_step: the step training starts from; records of later steps (left by a run that went past
    its last checkpoint) are removed, since this run logs those steps again."""

    def __init__(self, dump_dir: str, args: LoggingArgs, *, active: bool, run_name: str = "",
                 config: dict | None = None, resume_step: int | None = None):
        self.active, self.args = active, args
        self.path = Path(dump_dir) / args.metrics_file
        self._file = self._wandb = None
        if not active:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # O_APPEND: a resumed run appends after the old lines, never truncates them
        self._file = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
        size = os.fstat(self._file).st_size
        # a crash mid-line: end that fragment so our first line stays whole
        if size and os.pread(self._file, 1, size - 1) != b"\n":
            _write_all(self._file, b"\n")
        if resume_step is not None:
            self._drop_after(resume_step)
        if args.wandb not in ("disabled", "online", "offline"):
            raise ValueError(f"logging.wandb={args.wandb!r}; use disabled, online or offline")
        if args.wandb != "disabled":
            import wandb

            self._wandb = wandb.init(project=args.wandb_project, name=args.wandb_run or run_name or None,
                                     mode=args.wandb, dir=str(self.path.parent), config=config, resume="allow")

    def _drop_after(self, step: int) -> None:
        """Cut the file before the first record of a step after `step` (what follows is redone now)."""
        data = os.pread(self._file, os.fstat(self._file).st_size, 0)
        offset, cut, dropped = 0, None, 0
        for line in data.splitlines(keepends=True):
            try:
                s = json.loads(line).get("step")
            except (ValueError, AttributeError):
                s = None
            if cut is None and isinstance(s, (int, float)) and s > step:
                cut = offset
            dropped += cut is not None and bool(line.strip())
            offset += len(line)
        if cut is not None:
            os.ftruncate(self._file, cut)
            log.warning("%s: %d record(s) after step %d removed: this run resumes from step %d and logs those "
                        "steps again", self.path, dropped, step, step)

    def log(self, metrics: dict) -> None:
        if not self.active:
            return
        plain = {k: v.item() if isinstance(v, torch.Tensor) else v for k, v in metrics.items()}
        record = _strict({"time": time.time(), **plain})
        line = (json.dumps(record, allow_nan=False) + "\n").encode()
        # one write of one whole line (no buffering in this process): a crash loses at most this line;
        # a failed write (full disk) is cut back, never left as half a line
        size = os.fstat(self._file).st_size
        try:
            _write_all(self._file, line)
        except OSError as e:
            try:
                os.ftruncate(self._file, size)
            except OSError:
                pass  # the next start ends a cut line before appending (see __init__)
            why = f"{e.strerror or e} ({errno.errorcode.get(e.errno, e.errno)})"
            raise MetricsWriteError(f"the metrics file {self.path} could not be written: {why}") from e
        if self._wandb is not None:
            self._wandb.log(record, step=record.get("step"))

    def close(self) -> None:
        if self._file is not None:
            os.close(self._file)
            self._file = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


def _write_all(fd: int, data: bytes) -> None:
    while data:
        data = data[os.write(fd, data):]


def append_records(path: str, records: list[dict], active: bool = True, key: str = "out") -> None:
    """Append each record to the jsonl file `path` as MetricLogger writes (strict JSON, one whole line a
    write); an unwritable path is a ConfigError naming the command's `key`. `active`: this rank writes."""
    path = os.path.abspath(path)
    try:
        writer = MetricLogger(os.path.dirname(path), LoggingArgs(metrics_file=os.path.basename(path)), active=active)
    except OSError as e:  # e.g. a file where its folder should be, no write permission
        raise ConfigError(f"{key}={path!r}: cannot append to it ({e}); give a writable file path") from e
    try:
        for record in records:
            writer.log(record)
    finally:
        writer.close()


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """Every record of the file; a line cut short by a crash is skipped with a warning."""
    out, torn = [], 0
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            try:
                out.append(json.loads(line))
            except ValueError:
                torn += 1
    if torn:
        logging.getLogger(__name__).warning("%s: skipped %d unreadable line(s) (a crash mid-write)", path, torn)
    return out
