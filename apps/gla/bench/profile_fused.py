"""Where the fused ZeCO operator spends its time next to fla chunk_gla (torch profiler, CUDA kernels).

    python -m apps.gla.bench.profile_fused --t-local 16384 --out docs/results/raw
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch.profiler import ProfilerActivity, profile

from .bench_fused import variants
from .common import gla_inputs, parse_dataclass


@dataclass
class ProfileFusedArgs:
    out: str = "results/profile_fused"
    t_local: int = 16384
    heads: int = 16
    head_dim: int = 128
    iters: int = 5


def main(argv=None):
    args = parse_dataclass(ProfileFusedArgs, argv, __doc__)
    dev = torch.device("cuda")
    q, k, v, g, do = gla_inputs(args.t_local, args.heads, args.head_dim, args.head_dim, dev)
    scale = args.head_dim ** -0.5
    fns = variants(q, k, v, g, do, scale)  # bench_fused's: fla with and without S_in, fused ZeCO on a middle rank
    os.makedirs(args.out, exist_ok=True)
    for name, fn in fns.items():
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(args.iters):
                fn()
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=20, max_name_column_width=60)
        with open(os.path.join(args.out, f"profile_{name}_{args.t_local}.txt"), "w") as f:
            f.write(table)
        print(f"== {name} (T={args.t_local}, {args.iters} iterations)\n{table}", flush=True)


if __name__ == "__main__":
    main()
