"""The ZeCO stages of our own alone: time and effective bandwidth of `zeco_dS_in` (the backward's
local ∂L/∂S_in, memory-bound: it reads q, the gates and dO once) at several `runs` (programs per
call, i.e. chunks per program), from fla's fp32 chunk-local cumsum and from the raw 16-bit gates.

    python -m apps.gla.bench.bench_stages          # writes docs/results/raw/<date>-<gpu>/bench_stages.json

Each call is replayed from a CUDA graph (a ~150 µs kernel timed eagerly would include its launch),
CUDA events after warm-up, medians, the variants interleaved (common.time_interleaved).
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch

from lingua_zeco import reliability

from .common import SliceArgs, cuda_graph, slices_main, time_interleaved


@dataclass
class BenchStagesArgs(SliceArgs):
    out: str = ""  # empty: docs/results/raw/<date>-<gpu>
    runs: tuple[int, ...] = (132, 264, 528)  # programs per zeco_dS_in call, one measurement each
    iters: int = 50  # timed replays (medians over these)
    per_config: bool = True  # also time every autotune config of the kernel at the default runs


def _time_configs(stages, q, g, Gx, do, BT, args) -> dict:
    """{config: median µs} of `_dS_in_kernel` on the raw gates for each of its autotune configs
    (the partial sums only)."""
    import triton
    B, T, H, K = q.shape
    V = do.shape[-1]
    NT = triton.cdiv(T, BT)
    CPS = triton.cdiv(NT, max(1, min(NT, triton.cdiv(264, B * H))))
    NS = triton.cdiv(NT, CPS)
    dp = q.new_empty(NS, B, H, K, V, dtype=torch.float32)
    fns = {}
    for cfg in stages._dS_in_kernel.configs:
        kw = dict(cfg.kwargs, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        tiles = triton.cdiv(K, kw["BK"]) * triton.cdiv(V, kw["BV"])
        grid = (B * H, NS, tiles) if kw["HF"] else (tiles, NS, B * H)
        fns[str(cfg)] = (lambda grid=grid, kw=kw: stages._dS_in_kernel.fn[grid](
            q, g, Gx, do, dp, 0.1, T, NT, CPS, B, H=H, K=K, V=V, BT=BT, RAW=True, **kw))
    timed = time_interleaved({n: cuda_graph(fn) for n, fn in fns.items()}, 2, 20)
    return {name: round(1e3 * statistics.median(ms), 2) for name, (ms, _) in sorted(
        timed.items(), key=lambda kv: statistics.median(kv[1][0]))}


def measure_one(args: BenchStagesArgs, T: int, inputs) -> dict:
    from fla.ops.utils.constant import RCP_LN2
    from fla.ops.utils.cumsum import chunk_local_cumsum

    from lingua_zeco.kernels import zeco_stages
    q, _, v, g, do = inputs
    BT = zeco_stages.fla_chunk_size(T)
    g_cs = chunk_local_cumsum(g.detach(), BT, scale=RCP_LN2)  # base 2, as FusedZeCOGLA
    Gx, _ = zeco_stages.chunk_decay_prefix(g_cs, BT)
    q, v = q.detach(), v.detach()
    g = g.detach()
    dS_in = zeco_stages.zeco_dS_in
    fns = {f"dS_in_runs{r}": (lambda r=r: dS_in(q, g_cs, Gx, do, 0.1, BT, runs=r)) for r in args.runs}
    fns |= {f"dS_in_raw_runs{r}": (lambda r=r: dS_in(q, None, Gx, do, 0.1, BT, runs=r, g=g))
            for r in args.runs}  # from the raw 16-bit gates (what FusedZeCOGLA's backward calls)
    timed = time_interleaved({n: cuda_graph(fn) for n, fn in fns.items()}, args.warmup, args.iters)
    row = dict(T_local=T, BT=BT, best_config=str(zeco_stages._dS_in_kernel.best_config))
    for name, (gpu_ms, _) in timed.items():
        nbytes = q.nbytes + (g if "raw" in name else g_cs).nbytes + do.nbytes + Gx.nbytes
        us = 1e3 * statistics.median(gpu_ms)
        row[f"{name}_us"] = round(us, 2)
        row[f"{name}_TBps"] = round(nbytes / us * 1e-6, 3)
    if args.per_config:  # every autotune candidate launched directly, at the default runs
        row["per_config_us"] = _time_configs(zeco_stages, q, g, Gx, do, BT, args)
    return row


main = slices_main(BenchStagesArgs, "bench_stages", measure_one)


if __name__ == "__main__":
    with reliability.clean_exit():  # bad input: one `error: ...` line, exit code 2
        main()
