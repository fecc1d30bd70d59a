"""Extra compute of the fused ZeCO operator against plain fla chunk_gla on one GPU (issue: ≤ 2%).

    python -m apps.gla.bench.bench_fused --out docs/results/raw

The fused path runs with a scan that returns at once (zeros; no communication), so the difference
to fla's chunk_gla forward+backward at the same shape is the work ZeCO adds: the gate sums at chunk
ends, the fold of S_in into h, the separate D pass ordering and the fold of G into dh. Both variants
are timed in the same process, interleaved, with CUDA events after warm-up; medians reported.
"""
from __future__ import annotations

import json
import os
import statistics
from dataclasses import asdict, dataclass

import torch

from lingua_zeco.comm import ScanWork

from .common import gla_inputs, parse_dataclass


@dataclass
class BenchFusedArgs:
    out: str = "results/bench_fused"
    t_local: tuple = (16384, 32768)
    heads: int = 16
    head_k: int = 128
    head_v: int = 128
    warmup: int = 5
    iters: int = 30


def _no_comm_scan(x, a, reverse):
    return ScanWork(torch.zeros_like(x))


def main(argv=None):
    from fla.ops.gla import chunk_gla

    from lingua_zeco.sp.fused_zeco import FusedZeCOGLA
    args = parse_dataclass(BenchFusedArgs, argv, __doc__)
    dev = torch.device("cuda")
    rows = []
    for T in args.t_local:
        q, k, v, g, do = gla_inputs(T, args.heads, args.head_k, args.head_v, dev)
        scale = args.head_k ** -0.5
        variants = {
            "fla_chunk_gla": lambda: chunk_gla(q, k, v, g, scale=scale)[0],
            "zeco_fused_no_comm": lambda: FusedZeCOGLA.apply(q, k, v, g, scale, _no_comm_scan),
        }
        times = {n: [] for n in variants}
        for it in range(args.warmup + args.iters):
            for name, fn in variants.items():  # interleaved: clock and thermal drift hit both alike
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn().backward(do)
                end.record()
                torch.cuda.synchronize()
                if it >= args.warmup:
                    times[name].append(start.elapsed_time(end))
        med = {n: statistics.median(t) for n, t in times.items()}
        row = dict(T_local=T, **{f"{n}_ms": round(m, 4) for n, m in med.items()},
                   extra_pct=round(100 * (med["zeco_fused_no_comm"] / med["fla_chunk_gla"] - 1), 2))
        rows.append(row)
        print(json.dumps(row), flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_fused.json"), "w") as f:
        json.dump(dict(args=asdict(args), device=torch.cuda.get_device_name(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
