"""What runs beside the training loop at step boundaries, as the config says: a torch profiler window
(profiling.*), a CUDA memory snapshot over the same window, and the garbage collector's schedule (gc.every).

The profiler window: skip `start_step` steps, warm up, record `active` steps. Each rank writes its own
Chrome trace (profile/rank{r}_step{s}.json) so communication stalls of one SP rank can be compared with
its neighbours.

profiling.memory_snapshot (CUDA only) records the caching allocator's history over the same window
(warm-up and active steps) and dumps it per rank to profile/memory_snapshot_rank{r}_step{s}.pickle:
every allocation with its stack, for https://pytorch.org/memory_viz. It works with or without the
trace (profiling.enabled). On a CPU it is skipped with one warning.

gc.every: Python's automatic generational collection runs whenever enough objects were allocated, which
is at some step of some rank: a rank that stops for a collection holds up every collective of the
others. gc.every=N turns it off for the loop and runs a young-generation collection (generations 0 and
1) every N steps, at the same step on every rank; one full collection at the start clears what building
the run left behind.
"""
from __future__ import annotations

import contextlib
import gc
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from lingua_zeco.args import at_least

logger = logging.getLogger(__name__)


@dataclass
class ProfilerArgs:
    enabled: bool = False
    start_step: int = 10  # first step of the warm-up (counted from this run's first step)
    warmup: int = 1
    active: int = 3
    trace_dir: str = "profile"  # relative to dump_dir
    record_shapes: bool = False
    profile_memory: bool = False
    with_stack: bool = False
    memory_snapshot: bool = False  # CUDA: the allocator's history over the window, as a pickle per rank
    memory_snapshot_entries: int = 100000  # allocation events kept (the newest), bounds the host memory used

    def check(self) -> None:
        """Window values no profiler can use, named by their key."""
        if not (self.enabled or self.memory_snapshot):
            return
        at_least({"profiling.start_step": self.start_step, "profiling.warmup": self.warmup}, 0)
        at_least({"profiling.active": self.active, "profiling.memory_snapshot_entries": self.memory_snapshot_entries})


def snapshot_window(args: ProfilerArgs) -> tuple[int, int]:
    """(steps done when recording starts, steps done when it is dumped): the profiler's warm-up and active steps."""
    return args.start_step, args.start_step + args.warmup + args.active


def snapshot_path(out: Path, rank: int, step: int) -> Path:
    return out / f"memory_snapshot_rank{rank}_step{step}.pickle"


class _MemorySnapshot:
    """Counts steps like the profiler's schedule; records the CUDA allocator's history inside the window."""

    def __init__(self, args: ProfilerArgs, out: Path, rank: int):
        self.begin, self.end = snapshot_window(args)
        self.entries, self.out, self.rank = args.memory_snapshot_entries, out, rank
        self.steps, self.recording = 0, False
        if self.begin == 0:
            self.start()

    def start(self) -> None:
        torch.cuda.memory._record_memory_history(max_entries=self.entries)
        self.recording = True

    def stop(self) -> None:
        """Dump what was recorded (also when the run ends inside the window) and stop recording."""
        if not self.recording:
            return
        path = snapshot_path(self.out, self.rank, self.steps)
        torch.cuda.memory._dump_snapshot(str(path))
        torch.cuda.memory._record_memory_history(enabled=None)
        self.recording = False
        logger.info("memory snapshot of steps %d-%d written to %s", self.begin + 1, self.steps, path)

    def step(self) -> None:
        self.steps += 1
        if self.steps == self.begin:
            self.start()
        elif self.steps == self.end:
            self.stop()


class _Steps:
    """`.step()` on each of several step counters."""

    def __init__(self, *counters):
        self.counters = counters

    def step(self) -> None:
        for c in self.counters:
            c.step()


class _NoProfiler:
    def step(self) -> None:
        pass


@contextlib.contextmanager
def maybe_profile(args: ProfilerArgs, dump_dir: str, rank: int):
    """Yield an object with `.step()`; call it once at the end of every training step."""
    args.check()
    out = Path(dump_dir) / args.trace_dir
    snapshot = None
    if args.memory_snapshot and not torch.cuda.is_available():
        logger.warning("profiling.memory_snapshot needs CUDA (the caching allocator's history): no memory "
                       "snapshot on this CPU run")
    elif args.memory_snapshot:
        out.mkdir(parents=True, exist_ok=True)
        snapshot = _MemorySnapshot(args, out, rank)
    try:
        if not args.enabled:
            yield snapshot or _NoProfiler()
            return
        with _trace(args, out, rank) as prof:
            yield _Steps(prof, snapshot) if snapshot else prof
    finally:
        if snapshot is not None:
            snapshot.stop()


@contextlib.contextmanager
def _trace(args: ProfilerArgs, out: Path, rank: int):
    """torch.profiler over the window: one Chrome trace per rank."""
    out.mkdir(parents=True, exist_ok=True)

    def on_ready(prof):
        prof.export_chrome_trace(str(out / f"rank{rank}_step{prof.step_num}.json"))

    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    schedule = torch.profiler.schedule(skip_first=args.start_step, wait=0, warmup=args.warmup,
                                       active=args.active, repeat=1)
    with torch.profiler.profile(activities=activities, schedule=schedule, on_trace_ready=on_ready,
                                record_shapes=args.record_shapes, profile_memory=args.profile_memory,
                                with_stack=args.with_stack) as prof:
        yield prof


# -- the garbage collector (gc.every) ------------------------------------------------------------
GENERATION = 1  # the young generations: long-lived objects (modules, tensors' owners) are seldom garbage


@dataclass
class GCArgs:
    every: int = 0  # 0: Python's automatic collection (as before); N > 0: off, and a collection every N steps

    def check(self) -> None:
        at_least({"gc.every": self.every}, 0, {"gc.every": "0 = Python's automatic garbage collection"})


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
