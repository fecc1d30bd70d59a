"""The stages of our own alone, each beside fla's stage it replaces where there is one: time and effective
bandwidth of `zeco_dS_in` (the backward's local ∂L/∂S_in, memory-bound: it reads q, the gates and dO once) at
several `runs` (programs per call, i.e. chunks per program), from fla's fp32 chunk-local cumsum and from the raw
16-bit gates; the backward's state gradients dh as ours keeps them (`dh_ours`: 16-bit) and as fla does (`dh_fla`:
fp32); its dq, dk, dg, ours in one kernel (`dqkg_ours`, kernels/gla_bwd_dqkg.py) and fla's three stages it replaces
(`dqkg_fla`: dA, intra-chunk dq/dk, inter-chunk with dg), and its dv, ours (`dv_ours`, kernels/gla_bwd_dv.py) and
fla's stage (`dv_fla`), each from its own dh, with the largest relative difference between ours and fla's; the
forward's intra-chunk attention A, ours
(`fwdA_ours`, kernels/gla_fwd_intra.py) and fla's (`fwdA_fla`); ZeCO's output stage (`fwdO`) as the fused
operator runs it with the library's save_h (writing the true states back when it keeps them).

    python -m apps.gla.bench.bench_stages          # writes docs/results/raw/<date>-<gpu>/bench_stages.json

Each call is replayed from a CUDA graph (a short kernel timed eagerly would include its launch),
CUDA events after warm-up, medians, the variants interleaved (common.time_calls).
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass

from lingua_zeco import reliability

from .common import SLICE_MINIMUM, SliceArgs, at_least, cuda_graph, needs_cuda, slices_main, time_calls


@dataclass
class BenchStagesArgs(SliceArgs):
    out: str = ""  # empty: docs/results/raw/<date>-<gpu>
    runs: tuple[int, ...] = (132, 264, 528)  # programs per zeco_dS_in call, one measurement each
    iters: int = 50  # timed replays (medians over these)
    per_config: bool = True  # also time every autotune config of the kernel at the default runs


def check_args(args: BenchStagesArgs, device) -> None:
    needs_cuda("bench_stages")
    at_least(args, **SLICE_MINIMUM, runs=1)


def _median_us(fns: dict, device, warmup: int, iters: int) -> dict:
    """{name: median µs} of each call replayed from a CUDA graph, the calls interleaved."""
    timed = time_calls({n: cuda_graph(fn) for n, fn in fns.items()}, device, warmup, iters)
    return {name: 1e6 * statistics.median(gpu_s) for name, (gpu_s, _) in timed.items()}


def measure_one(args: BenchStagesArgs, T: int, inputs) -> dict:
    # fla and Triton: imported on the GPU only; fla's own intra stages straight from fla (the reference)
    from lingua_zeco.kernels.fla_stages import chunk_gla_bwd_dqk_intra, chunk_gla_fwd_intra_gk

    from lingua_zeco.kernels import ChunkLayout, GLAOptions, fla_stages, zeco_stages
    from lingua_zeco.kernels.gla_bwd_dqkg import chunk_gla_bwd_dqkg
    from lingua_zeco.kernels.gla_bwd_dv import chunk_gla_bwd_dv, dv_best_config
    from lingua_zeco.kernels.gla_fwd_intra import chunk_gla_fwd_A
    q, k, v, g, do = (t.detach() for t in inputs)
    BT = zeco_stages.fla_chunk_size(T)
    g_cs = fla_stages.gate_cumsum(g, BT)  # base 2, as FusedZeCOGLA
    Gx, _ = zeco_stages.chunk_decay_prefix(g_cs, BT)
    dS_in = zeco_stages.zeco_dS_in
    fns = {f"dS_in_runs{r}": (lambda r=r: dS_in(q, g_cs, Gx, do, 0.1, BT, runs=r)) for r in args.runs}
    fns |= {f"dS_in_raw_runs{r}": (lambda r=r: dS_in(q, None, Gx, do, 0.1, BT, runs=r, g=g))
            for r in args.runs}  # from the raw 16-bit gates (what FusedZeCOGLA's backward calls)
    # the backward from the kept 16-bit states; the state gradients in 16 bits (ours) or fp32 (fla's chunk_gla)
    h, _ = fla_stages.chunk_fwd_h(k=k, v=v, gk=g_cs, h0=None, output_final_state=False, chunk_size=BT)
    dh_of = {name: (lambda fp32=fp32: fla_stages.chunk_bwd_dh(
        q=q, k=k, v=v, do=do, h0=None, dht=None, scale=0.1, gk=g_cs, chunk_size=BT, states_in_fp32=fp32))
        for name, fp32 in (("ours", False), ("fla", True))}
    dh16, dh = dh_of["ours"]()[0], dh_of["fla"]()[0]
    fns |= {f"dh_{name}": fn for name, fn in dh_of.items()}

    def dqkg_fla():
        dA = fla_stages.chunk_gla_bwd_dA(v=v, do=do, scale=0.1, chunk_size=BT)
        dq, dk = chunk_gla_bwd_dqk_intra(q=q, k=k, g=g_cs, dA=dA, chunk_size=BT)
        return fla_stages.chunk_gla_bwd_dqkg(q=q, k=k, v=v, h=h, g=g_cs, do=do, dh=dh, dq=dq, dk=dk, scale=0.1,
                                             chunk_size=BT)
    dqkg = {"ours": lambda: chunk_gla_bwd_dqkg((q, k, v, g_cs), h, dh16, do, scale=0.1,
                                               dtypes=(q.dtype, k.dtype, g.dtype), layout=ChunkLayout(BT)),
            "fla": dqkg_fla}
    ours, theirs = dqkg["ours"](), dqkg["fla"]()  # before the timed replays, in which fwdO rewrites h
    dqkg_diff = max(((a.float() - b).abs().max() / b.abs().max()).item() for a, b in zip(ours, theirs))
    fns |= {f"dqkg_{name}": fn for name, fn in dqkg.items()}
    A = chunk_gla_fwd_A(q, k, g_cs, 0.1, BT)
    dv = {"ours": lambda: chunk_gla_bwd_dv(k, g_cs, A, do, dh16, layout=ChunkLayout(BT)),
          "fla": lambda: fla_stages.chunk_gla_bwd_dv(k=k, g=g_cs, A=A, do=do, dh=dh, chunk_size=BT)}
    dv_fla = dv["fla"]().float()
    dv_diff = ((dv["ours"]().float() - dv_fla).abs().max() / dv_fla.abs().max()).item()
    fns |= {f"dv_{name}": fn for name, fn in dv.items()}
    fns |= {"fwdA_ours": lambda: chunk_gla_fwd_A(q, k, g_cs, 0.1, BT),
            "fwdA_fla": lambda: chunk_gla_fwd_intra_gk(q=q, k=k, g=g_cs, scale=0.1, chunk_size=BT)}
    # ZeCO's output stage, S_in in bf16 as fused_zeco passes it; storing the true states, each replay folds S_in
    # into h again: the values drift, the traffic does not
    S_in, store_h = 0.01 * h[:, -1].clone(), GLAOptions().save_h
    fns["fwdO"] = lambda: zeco_stages.zeco_fwd_o(q, v, g_cs, A, h, (S_in, Gx), 0.1, store_h=store_h)
    timed_us = _median_us(fns, q.device, args.warmup, args.iters)
    row = dict(T_local=T, BT=BT, fwdO_store_h=store_h, best_config=zeco_stages.dS_in_best_config())
    row["dqkg_max_rel_diff"] = dqkg_diff
    row["dv_max_rel_diff"] = dv_diff
    row["dv_best_config"] = dv_best_config()
    for name, us in timed_us.items():
        row[f"{name}_us"] = round(us, 2)
        if name.startswith("dS_in"):
            nbytes = q.nbytes + (g if "raw" in name else g_cs).nbytes + do.nbytes + Gx.nbytes
            row[f"{name}_TBps"] = round(nbytes / us * 1e-6, 3)
    if args.per_config:  # every autotune candidate alone, on the raw gates, partial sums only, at the default runs
        per_config_us = _median_us(zeco_stages.dS_in_candidates(q, g, Gx, do, 0.1, BT), q.device, 2, 20)
        row["per_config_us"] = {n: round(us, 2) for n, us in sorted(per_config_us.items(), key=lambda kv: kv[1])}
    return row


main = slices_main(BenchStagesArgs, "bench_stages", measure_one, check_args)


if __name__ == "__main__":
    with reliability.clean_exit():  # bad input: one `error: ...` line, exit code 2
        main()
