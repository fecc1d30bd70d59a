"""A torch profiler window chosen by config: skip `start_step` steps, warm up, record `active` steps.

Each rank writes its own Chrome trace (profile/rank{r}_step{s}.json) so communication stalls of
one SP rank can be compared with its neighbours.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

import torch


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


class _NoProfiler:
    def step(self) -> None:
        pass


@contextlib.contextmanager
def maybe_profile(args: ProfilerArgs, dump_dir: str, rank: int):
    """Yield an object with `.step()`; call it once at the end of every training step."""
    if not args.enabled:
        yield _NoProfiler()
        return
    out = Path(dump_dir) / args.trace_dir
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
