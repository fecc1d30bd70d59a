"""Diagnose the fused ZeCO operator on P GPUs: real All-Scan (overlapped or not) against no
communication, host enqueue time against GPU time, and a torch-profiler kernel table of rank 0.

    torchrun --nproc_per_node=2 -m apps.gla.bench.profile_sp --out docs/results/raw
"""
from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from lingua_zeco.comm import AllScanArgs, ScanWork, all_scan

from .common import finish, gla_inputs, init_distributed, parse_dataclass


@dataclass
class ProfileSPArgs:
    out: str = "results/profile_sp"
    t_local: int = 16384
    heads: int = 16
    head_dim: int = 128
    iters: int = 20


def main(argv=None):
    from lingua_zeco.sp.fused_zeco import FusedZeCOGLA
    args = parse_dataclass(ProfileSPArgs, argv, __doc__)
    dev = init_distributed()
    rank = dist.get_rank()
    q, k, v, g, do = gla_inputs(args.t_local, args.heads, args.head_dim, args.head_dim, dev, seed=rank)
    scale = args.head_dim ** -0.5
    scan = AllScanArgs()

    def overlapped(x, a, reverse):
        return all_scan(x, a, None, reverse=reverse, args=scan, async_op=True)

    def blocking(x, a, reverse):
        return ScanWork(all_scan(x, a, None, reverse=reverse, args=scan))

    def no_comm(x, a, reverse):
        return ScanWork(torch.zeros_like(x))

    variants = {"overlapped": overlapped, "blocking": blocking, "no_comm": no_comm}
    res = {n: ([], []) for n in variants}
    for it in range(5 + args.iters):
        for name, fn in variants.items():
            dist.barrier()
            torch.cuda.synchronize()
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            e0.record()
            FusedZeCOGLA.apply(q, k, v, g, scale, fn).backward(do)
            e1.record()
            host = time.perf_counter() - t0
            torch.cuda.synchronize()
            if it >= 5:
                res[name][0].append(e0.elapsed_time(e1))
                res[name][1].append(host * 1e3)
    for name, (gpu, host) in res.items():
        print(f"rank {rank} {name:11s} gpu {statistics.median(gpu):7.3f} ms  host enqueue {statistics.median(host):7.3f} ms",
              flush=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            FusedZeCOGLA.apply(q, k, v, g, scale, overlapped).backward(do)
        torch.cuda.synchronize()
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        prof.export_chrome_trace(os.path.join(args.out, "trace_zeco_P2_rank0.json"))
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=50))
    finish()


if __name__ == "__main__":
    main()
