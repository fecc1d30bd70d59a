"""Where the fused ZeCO operator spends its time next to fla chunk_gla (torch profiler, CUDA kernels).

    python -m apps.gla.bench.profile_fused t_local=16384 out=docs/results/raw
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from lingua_zeco import reliability
from lingua_zeco.args import parse_args

from .bench_fused import variants
from .common import SLICE_MINIMUM, SliceArgs, at_least, needs_cuda, profiled


@dataclass
class ProfileFusedArgs(SliceArgs):
    out: str = "results/profile_fused"  # output folder: one kernel table per variant
    t_local: int = 16384  # tokens on this GPU
    warmup: int = 3  # unprofiled calls of each variant first
    iters: int = 5  # profiled calls of each variant


def main(argv=None):
    args = parse_args(ProfileFusedArgs, argv)
    needs_cuda("profile_fused")
    at_least(args, **SLICE_MINIMUM)
    q, k, v, g, do = args.inputs(args.t_local, torch.device("cuda"))
    fns = variants(q, k, v, g, do, args.head_k ** -0.5)  # bench_fused's: fla with and without S_in, fused ZeCO
    os.makedirs(args.out, exist_ok=True)
    for name, fn in fns.items():
        for _ in range(args.warmup):
            fn()
        prof = profiled(fn, args.iters, host_ops=False)
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=20, max_name_column_width=60)
        with open(os.path.join(args.out, f"profile_{name}_{args.t_local}.txt"), "w") as f:
            f.write(table)
        print(f"== {name} (T={args.t_local}, {args.iters} iterations)\n{table}", flush=True)


if __name__ == "__main__":
    with reliability.clean_exit():  # bad input: one `error: ...` line, exit code 2
        main()
