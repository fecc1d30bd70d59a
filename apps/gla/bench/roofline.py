"""Every GLA kernel against the GPU's ceilings, measured in the same run (the roofline table).

    python -m apps.gla.bench.roofline                         # 16K tokens, B = 1, H = 16, K = V = 128
    python -m apps.gla.bench.roofline t_local=32768 out=$OUT

The ceilings are this GPU's, measured first: copy bandwidth (a device-to-device copy of `copy_mib`, bytes read
plus written per second) and bf16 GEMM throughput (an n×n×n matmul). Then each operator of ROOFLINE_VARIANTS
(bench_fused's: fla's chunk_gla, ours with the library's defaults, the fused ZeCO middle rank) runs forward +
backward under the torch profiler, and every kernel's mean time per call is set against the bytes and FLOPs
lingua_zeco/perf_model/gla_kernels.py gives it: achieved TB/s and TFLOP/s, which ceiling bounds it, and the
share of that bound it reaches. Kernels the model has no entry for are listed
with their time alone.
Writes roofline.json (rows per variant, the ceilings) and roofline.md (the tables).
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch

from lingua_zeco import reliability
from lingua_zeco.kernels import GLAOptions
from lingua_zeco.perf_model.gla_kernels import gla_kernel_costs, match_kernel, roofline_row

from .bench_fused import variants
from .common import (SLICE_MINIMUM, SliceArgs, at_least, bench_main, markdown_table, needs_cuda, profiled,
                     time_calls)


@dataclass
class RooflineArgs(SliceArgs):
    t_local: tuple[int, ...] = (16384,)  # tokens on this GPU, one table each
    calls: int = 5  # profiled forward + backward calls of each variant
    copy_mib: int = 2048  # the copy that measures the bandwidth ceiling
    gemm_n: int = 8192  # the bf16 matmul that measures the compute ceiling


def check_args(args: RooflineArgs, device) -> None:
    needs_cuda("roofline")
    at_least(args, **SLICE_MINIMUM, calls=1, copy_mib=1, gemm_n=128)


def ceilings(args: RooflineArgs, device) -> dict:
    """Measured: copy bandwidth in bytes/s (read + write) and bf16 GEMM FLOP/s, medians over args.iters."""
    n = args.copy_mib * 2**20 // 2
    src, dst = torch.empty(n, dtype=torch.bfloat16, device=device), torch.empty(n, dtype=torch.bfloat16, device=device)
    a, b = (torch.randn(args.gemm_n, args.gemm_n, dtype=torch.bfloat16, device=device) for _ in range(2))
    t = time_calls({"copy": lambda: dst.copy_(src), "gemm": lambda: a @ b}, device, args.warmup, args.iters)
    copy_s, gemm_s = (statistics.median(t[k][0]) for k in ("copy", "gemm"))
    return dict(copy_Bps=2 * src.numel() * 2 / copy_s, gemm_flops=2 * args.gemm_n ** 3 / gemm_s)


def kernel_times(prof) -> dict[str, tuple[float, int]]:
    """CUDA kernel name -> (mean seconds per call, calls) from a profile."""
    out = {}
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0)
        if us > 0 and e.count:
            out[e.key] = (us * 1e-6 / e.count, e.count)
    return out


def table_rows(times: dict[str, tuple[float, int]], costs: dict, ceil: dict, per_call: int) -> list[dict]:
    """One row per kernel, slowest total first: the roofline columns where the cost model knows the kernel."""
    rows = []
    for name, (s, count) in sorted(times.items(), key=lambda kv: -kv[1][0] * kv[1][1]):
        entry = match_kernel(name, costs)
        row = roofline_row(entry, costs[entry], s, ceil["copy_Bps"], ceil["gemm_flops"]) if entry else \
            dict(kernel=name[:60], us=round(s * 1e6, 2))
        rows.append(dict(row, calls_per_fwd_bwd=round(count / per_call, 2)))
    return rows


ROOFLINE_VARIANTS = ("fla_chunk_gla", "staged_chunk_gla", "zeco_fused")
COLS = ["kernel", "calls_per_fwd_bwd", "us", "MB", "GFLOP", "flop_per_byte", "TBps", "TFLOPs", "bound",
        "of_bound_pct"]


def measure(args: RooflineArgs, device):
    ceil = ceilings(args, device)
    result, md = dict(ceilings=ceil, tables={}), [f"ceilings (measured): copy {ceil['copy_Bps'] / 1e12:.2f} TB/s, "
                                                   f"bf16 GEMM {ceil['gemm_flops'] / 1e12:.0f} TFLOP/s\n"]
    stores_h = GLAOptions().save_h  # the fused ZeCO's output stage then writes the true states back
    for T in args.t_local:
        q, k, v, g, do = args.inputs(T, device)
        fns = variants(q, k, v, g, do, args.head_k ** -0.5)
        for name in ROOFLINE_VARIANTS:
            for _ in range(args.warmup):
                fns[name]()
            costs = gla_kernel_costs(1, T, args.heads, args.head_k, args.head_v,
                                     stores_h=stores_h and name == "zeco_fused", dh16=name != "fla_chunk_gla")
            rows = table_rows(kernel_times(profiled(fns[name], args.calls, host_ops=False)), costs, ceil,
                              args.calls)
            result["tables"][f"{name}_{T}"] = rows
            md.append(f"\n### {name}, T = {T}\n\n" + markdown_table(rows, COLS))
        torch.cuda.empty_cache()
    return "roofline", result, "".join(md)


main = bench_main(RooflineArgs, measure, check_args)


if __name__ == "__main__":
    with reliability.clean_exit():  # bad input: one `error: ...` line, exit code 2
        main()
