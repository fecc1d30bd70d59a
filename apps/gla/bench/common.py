"""Shared plumbing of the benchmark programs: process group, timing, statistics, output files.

Runs under `torchrun` (NCCL on CUDA, gloo on CPU), as a plain single process (a world of one), or
inside a process group somebody else already set up (tests). Times are taken per iteration after a
barrier (CUDA events on GPU, perf_counter on CPU) and reduced with MAX over ranks: a collective is
done when its slowest rank is done.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import socket
import statistics
import time
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist


# ------------------------------------------------------------------------------------ arguments
def parse_dataclass(cls, argv: list[str] | None, description: str = ""):
    """`--field value` for every field of `cls`; tuple/list fields take comma-separated values."""
    ap = argparse.ArgumentParser(description=description)
    defaults = cls()
    for f in dataclasses.fields(cls):
        val = getattr(defaults, f.name)
        flag = "--" + f.name.replace("_", "-")
        if isinstance(val, bool):
            ap.add_argument(flag, type=lambda s: s.lower() in ("1", "true", "yes"), default=val, metavar="BOOL")
        elif isinstance(val, (tuple, list)):
            elem = type(val[0]) if val else str
            ap.add_argument(flag, type=lambda s, e=elem: tuple(e(x) for x in s.split(",") if x), default=tuple(val))
        else:
            ap.add_argument(flag, type=type(val), default=val)
    return cls(**vars(ap.parse_args(argv)))


# -------------------------------------------------------------------------------- process group
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_OWN_GROUP = False  # did init_distributed create the default group (then finish() tears it down)?


def init_distributed(timeout_s: int = 300) -> torch.device:
    """Join (or create) the default process group and return this rank's device."""
    global _OWN_GROUP
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if not dist.is_initialized():
        if "RANK" not in os.environ:  # plain `python -m ...`: a world of one
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(_free_port()))
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
        dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=timeout_s))
        _OWN_GROUP = True
    return torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")


def local_world_size() -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))


def env_info(device: torch.device) -> dict:
    return dict(torch=torch.__version__, backend=dist.get_backend(), world_size=dist.get_world_size(),
                local_world_size=local_world_size(), device=torch.cuda.get_device_name(device)
                if device.type == "cuda" else platform.processor() or "cpu", host=socket.gethostname(),
                time=time.strftime("%Y-%m-%d %H:%M:%S"))


# ------------------------------------------------------------------------------------- timing
def time_iters(fn: Callable[[], object], device: torch.device, warmup: int, iters: int,
               group=None) -> list[float]:
    """Seconds of each timed call of `fn`, the slowest rank's for each iteration."""
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    times = []
    events = []
    nccl = dist.get_backend(group) == "nccl"
    barrier_kw = dict(device_ids=[device.index]) if nccl else {}  # NCCL: no guessing of the device
    for _ in range(iters):
        dist.barrier(group=group, **barrier_kw)
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # start from an idle stream so the start event is "now"
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            events.append((start, end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    if events:
        torch.cuda.synchronize(device)
        times = [s.elapsed_time(e) * 1e-3 for s, e in events]
    # NCCL reduces device tensors only; gloo takes CPU ones
    buf = torch.tensor(times, dtype=torch.float64, device=device if nccl else "cpu")
    dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=group)
    return buf.tolist()


def summarize(times_s: list[float], unit: str = "ms") -> dict:
    """median, p10, p90 and mean in `unit` (ms or us)."""
    scale = {"ms": 1e3, "us": 1e6}[unit]
    xs = sorted(t * scale for t in times_s)

    def pct(p: float) -> float:  # linear interpolation between order statistics
        if len(xs) == 1:
            return xs[0]
        k = (len(xs) - 1) * p
        lo = math.floor(k)
        hi = min(lo + 1, len(xs) - 1)
        return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)

    return {f"median_{unit}": statistics.median(xs), f"p10_{unit}": pct(0.1), f"p90_{unit}": pct(0.9),
            f"mean_{unit}": statistics.fmean(xs), "n": len(xs)}


def peak_memory_mib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


# -------------------------------------------------------------------------------------- output
def markdown_table(rows: list[dict], cols: list[str]) -> str:
    def cell(v):
        if isinstance(v, float):
            return f"{v:.4g}"
        return "" if v is None else str(v)

    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    lines += ["| " + " | ".join(cell(r.get(c)) for c in cols) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def write_outputs(out_dir: str, stem: str, payload: dict, markdown: str) -> str | None:
    """Rank 0 writes <stem>.json and <stem>.md and prints the table; returns the JSON path there (None elsewhere)."""
    if dist.get_rank() != 0:
        return None
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, stem + ".json")
    with open(path, "w") as f:
        json.dump(payload, f, indent=1)
    with open(os.path.join(out_dir, stem + ".md"), "w") as f:
        f.write(markdown)
    print(markdown)
    print(f"wrote {path}")
    return path


def finish() -> None:
    """Tear down the process group if we created it under torchrun or as a single process."""
    global _OWN_GROUP
    if dist.is_initialized() and _OWN_GROUP:
        _OWN_GROUP = False
        dist.barrier()
        dist.destroy_process_group()


def gla_inputs(T: int, heads: int, head_k: int, head_v: int, device, dtype=torch.bfloat16, seed: int = 0):
    """Leaf q, k, v, g (g = logsigmoid(randn), fp32 math then `dtype`) and an output gradient, B = 1."""
    gen = torch.Generator(device=device).manual_seed(seed)
    shape = (1, T, heads, head_k)
    q, k = (torch.randn(shape, device=device, generator=gen, dtype=dtype).requires_grad_() for _ in range(2))
    v = torch.randn(1, T, heads, head_v, device=device, generator=gen, dtype=dtype).requires_grad_()
    g = torch.nn.functional.logsigmoid(torch.randn(shape, device=device, generator=gen)).to(dtype).requires_grad_()
    return q, k, v, g, torch.randn_like(v)
