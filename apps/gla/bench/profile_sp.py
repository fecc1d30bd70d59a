"""Diagnose the fused ZeCO operator on P GPUs: real All-Scan (overlapped or not) against no
communication, host enqueue time against GPU time, rank 0's traces of both modes with the GPU idle
time in them (gpu_gaps) and a torch-profiler kernel table.

    torchrun --nproc_per_node=2 -m apps.gla.bench.profile_sp out=docs/results/raw
"""
from __future__ import annotations

import os
import statistics
from dataclasses import dataclass

import torch
import torch.distributed as dist

from lingua_zeco import reliability
from lingua_zeco.args import parse_args
from lingua_zeco.comm import AllScanArgs, ScanWork, all_scan

from .common import (SLICE_MINIMUM, SliceArgs, at_least, barrier, finish, init_distributed, needs_cuda, profiled,
                     time_calls)
from .gpu_gaps import idle_gaps


@dataclass
class ProfileSPArgs(SliceArgs):
    out: str = "results/profile_sp"  # output folder: rank 0's chrome traces
    t_local: int = 16384  # tokens per GPU


def main(argv=None):
    args = parse_args(ProfileSPArgs, argv)
    needs_cuda("profile_sp")
    at_least(args, **SLICE_MINIMUM)
    from lingua_zeco.kernels import GLAOptions
    from lingua_zeco.sp.fused_zeco import FusedZeCOGLA  # Triton: imported on the GPU only
    dev = init_distributed()
    rank = dist.get_rank()
    q, k, v, g, do = args.inputs(args.t_local, dev, seed=rank)
    scale = args.head_k ** -0.5
    scan, save_h = AllScanArgs(), GLAOptions().save_h

    def overlapped(x, a, reverse):
        return all_scan(x, a, None, reverse=reverse, args=scan, async_op=True)

    def blocking(x, a, reverse):
        return ScanWork(all_scan(x, a, None, reverse=reverse, args=scan))

    def no_comm(x, a, reverse):
        return ScanWork(torch.zeros_like(x))

    fns = {name: (lambda fn=fn: FusedZeCOGLA.apply(q, k, v, g, scale, fn, save_h).backward(do))
           for name, fn in {"overlapped": overlapped, "blocking": blocking, "no_comm": no_comm}.items()}
    timed = time_calls(fns, dev, args.warmup, args.iters, before=lambda: barrier(dev))
    for name, (gpu_s, host_s) in timed.items():
        print(f"rank {rank} {name:11s} gpu {1e3 * statistics.median(gpu_s):7.3f} ms  "
              f"host enqueue {1e3 * statistics.median(host_s):7.3f} ms", flush=True)
    # GPU idle around the scan, per mode: the trace's gaps (gpu_gaps), each blamed on the host op that
    # launched the kernel ending it; an overlap that pays leaves less idle than blocking
    P = dist.get_world_size()
    for name in ("overlapped", "blocking"):
        prof = profiled(fns[name], 3)
        if rank == 0:
            os.makedirs(args.out, exist_ok=True)
            trace = os.path.join(args.out, f"trace_zeco_P{P}_{name}_rank0.json")
            prof.export_chrome_trace(trace)
            gaps = idle_gaps(trace, per=3, ignore=("nccl",))  # a waiting receive is idle compute
            print(f"{name}: GPU compute idle {gaps['idle_us'] / 1e3:.3f} ms per fwd+bwd of "
                  f"{gaps['span_us'] / 1e3:.3f}; largest causes {gaps['by_cause'][:3]}", flush=True)
            if name == "overlapped":
                print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=50))
    finish()


if __name__ == "__main__":
    with reliability.clean_exit():  # bad input: one `error: ...` line, exit code 2
        main()
