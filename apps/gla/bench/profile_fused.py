"""Where the fused ZeCO operator spends its time next to fla chunk_gla (torch profiler, CUDA kernels).

    python -m apps.gla.bench.profile_fused --t-local 16384 --out docs/results/raw
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch.profiler import ProfilerActivity, profile

from .bench_fused import _no_comm_scan
from .common import gla_inputs, parse_dataclass


@dataclass
class ProfileFusedArgs:
    out: str = "results/profile_fused"
    t_local: int = 16384
    heads: int = 16
    head_dim: int = 128
    iters: int = 5


def main(argv=None):
    from fla.ops.gla import chunk_gla

    from lingua_zeco.sp.fused_zeco import FusedZeCOGLA
    args = parse_dataclass(ProfileFusedArgs, argv, __doc__)
    dev = torch.device("cuda")
    q, k, v, g, do = gla_inputs(args.t_local, args.heads, args.head_dim, args.head_dim, dev)
    scale = args.head_dim ** -0.5
    variants = {"fla_chunk_gla": lambda: chunk_gla(q, k, v, g, scale=scale)[0],
                "zeco_fused_no_comm": lambda: FusedZeCOGLA.apply(q, k, v, g, scale, _no_comm_scan)}
    os.makedirs(args.out, exist_ok=True)
    for name, fn in variants.items():
        for _ in range(3):
            fn().backward(do)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(args.iters):
                fn().backward(do)
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=20, max_name_column_width=60)
        with open(os.path.join(args.out, f"profile_{name}_{args.t_local}.txt"), "w") as f:
            f.write(table)
        print(f"== {name} (T={args.t_local}, {args.iters} iterations)\n{table}", flush=True)


if __name__ == "__main__":
    main()
