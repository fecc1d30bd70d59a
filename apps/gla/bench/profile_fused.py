"""Where the fused ZeCO operator spends its time next to fla chunk_gla: its CUDA kernels (torch profiler) or,
with host=true, the host's Python functions that enqueue them (cProfile over eager calls: where an eager call
that takes longer to enqueue than its GPU work spends its host time).

    python -m apps.gla.bench.profile_fused t_local=16384 out=docs/results/raw
    python -m apps.gla.bench.profile_fused t_local=16384 host=true variants=fla_chunk_gla,staged_chunk_gla
"""
from __future__ import annotations

import cProfile
import io
import os
import pstats
from dataclasses import dataclass

import torch

from lingua_zeco import reliability
from lingua_zeco.args import ConfigError, parse_args

from .bench_fused import variants
from .common import SLICE_MINIMUM, SliceArgs, at_least, needs_cuda, profiled


@dataclass
class ProfileFusedArgs(SliceArgs):
    out: str = "results/profile_fused"  # output folder: one kernel table per variant
    t_local: int = 16384  # tokens on this GPU
    warmup: int = 3  # unprofiled calls of each variant first
    iters: int = 5  # profiled calls of each variant
    host: bool = False  # profile the host's Python functions (cProfile) instead of the CUDA kernels
    variants: str = ""  # comma-separated bench_fused variant names to profile; empty: all


def main(argv=None):
    args = parse_args(ProfileFusedArgs, argv)
    needs_cuda("profile_fused")
    at_least(args, **SLICE_MINIMUM)
    q, k, v, g, do = args.inputs(args.t_local, torch.device("cuda"))
    fns = variants(q, k, v, g, do, args.head_k ** -0.5)  # bench_fused's: fla with and without S_in, ours, fused ZeCO
    wanted = [n.strip() for n in args.variants.split(",") if n.strip()] or list(fns)
    unknown = [n for n in wanted if n not in fns]
    if unknown:
        raise ConfigError(f"variants={args.variants}: unknown {unknown}; pick from {sorted(fns)}")
    os.makedirs(args.out, exist_ok=True)
    for name in wanted:
        fn = fns[name]
        for _ in range(args.warmup):
            fn()
        if args.host:
            kind, table = "host", host_profile(fn, args.iters)
        else:
            kind, table = "profile", profiled(fn, args.iters, host_ops=False).key_averages().table(
                sort_by="cuda_time_total", row_limit=20, max_name_column_width=60)
        with open(os.path.join(args.out, f"{kind}_{name}_{args.t_local}.txt"), "w") as f:
            f.write(table)
        print(f"== {name} (T={args.t_local}, {args.iters} iterations, {kind})\n{table}", flush=True)


def host_profile(fn, calls: int, rows: int = 45) -> str:
    """cProfile over `calls` eager calls enqueued back to back from an idle GPU (the last one synchronised):
    the functions by their own time, then by cumulative time. cProfile slows Python by a constant-ish factor,
    so read shares, not absolute times."""
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    prof.disable()
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out).strip_dirs()
    stats.sort_stats("tottime").print_stats(rows)
    stats.sort_stats("cumulative").print_stats(rows)
    return out.getvalue()


if __name__ == "__main__":
    with reliability.clean_exit():  # bad input: one `error: ...` line, exit code 2
        main()
