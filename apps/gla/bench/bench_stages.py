"""The stages of our own alone: time and effective bandwidth of `zeco_dS_in` (the backward's
local ∂L/∂S_in, memory-bound: it reads q, the gates and dO once) at several `runs` (programs per
call, i.e. chunks per program), from fla's fp32 chunk-local cumsum and from the raw 16-bit gates;
and the intra-chunk dq/dk stage of the backward, ours (`intra_zeco`, `intra_zeco_chunk`: kernels/gla_bwd_intra.py)
beside fla's (`intra_fla`) on the same inputs, with the largest difference between them; the forward's
intra-chunk attention A, fla's (`fwdA_fla`) and ours by whole chunks (`fwdA_zeco_chunk`, kernels/gla_fwd_intra.py);
ZeCO's output stage plain (`fwdO_plain`) and writing the true states back for save_h (`fwdO_store_h`).

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
    # fla and Triton: imported on the GPU only
    from lingua_zeco.kernels import BWD_INTRA, fla_stages, gla_chunk, zeco_stages
    q, _, _, g, do = (t.detach() for t in inputs)
    BT = zeco_stages.fla_chunk_size(T)
    g_cs = fla_stages.gate_cumsum(g, BT)  # base 2, as FusedZeCOGLA
    Gx, _ = zeco_stages.chunk_decay_prefix(g_cs, BT)
    dS_in = zeco_stages.zeco_dS_in
    fns = {f"dS_in_runs{r}": (lambda r=r: dS_in(q, g_cs, Gx, do, 0.1, BT, runs=r)) for r in args.runs}
    fns |= {f"dS_in_raw_runs{r}": (lambda r=r: dS_in(q, None, Gx, do, 0.1, BT, runs=r, g=g))
            for r in args.runs}  # from the raw 16-bit gates (what FusedZeCOGLA's backward calls)
    dA = fla_stages.chunk_gla_bwd_dA(v=inputs[2].detach(), do=do, scale=0.1, chunk_size=BT)
    k = inputs[1].detach()
    fns |= {f"intra_{name}": (lambda name=name: gla_chunk.dqk_intra(q, k, g_cs, dA, BT, name))
            for name in BWD_INTRA}
    # the forward's intra-chunk attention A: fla's two block kernels, ours by whole chunks
    fns |= {f"fwdA_{name}": (lambda name=name: gla_chunk.fwd_A(q, k, g_cs, 0.1, BT, name))
            for name in ("fla", "zeco_chunk")}
    # ZeCO's output stage, plain and storing the true states (what save_h costs it); each replay folds S_in into
    # h_store again: the values drift, the traffic does not
    v = inputs[2].detach()
    h, _ = fla_stages.chunk_fwd_h(k=k, v=v, gk=g_cs, h0=None, output_final_state=False, chunk_size=BT)
    A, h_store = gla_chunk.fwd_A(q, k, g_cs, 0.1, BT, "zeco_chunk"), h.clone()
    S_in = 0.01 * h[:, -1].clone()  # bf16, as fused_zeco passes it
    fns |= {f"fwdO_{name}": (lambda hh=hh, st=st: zeco_stages.zeco_fwd_o(q, v, g_cs, A, hh, S_in, Gx, 0.1, BT,
                                                                      store_h=st))
            for name, hh, st in (("plain", h, False), ("store_h", h_store, True))}
    timed_us = _median_us(fns, q.device, args.warmup, args.iters)
    row = dict(T_local=T, BT=BT, best_config=zeco_stages.dS_in_best_config())
    ours, theirs = (gla_chunk.dqk_intra(q, k, g_cs, dA, BT, name) for name in ("zeco", "fla"))
    row["intra_max_rel_diff"] = max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(ours, theirs))
    for name, us in timed_us.items():
        if name.startswith(("intra_", "fwdA_", "fwdO_")):
            row[f"{name}_us"] = round(us, 2)
            continue
        nbytes = q.nbytes + (g if "raw" in name else g_cs).nbytes + do.nbytes + Gx.nbytes
        row[f"{name}_us"] = round(us, 2)
        row[f"{name}_TBps"] = round(nbytes / us * 1e-6, 3)
    if args.per_config:  # every autotune candidate alone, on the raw gates, partial sums only, at the default runs
        per_config_us = _median_us(zeco_stages.dS_in_candidates(q, g, Gx, do, 0.1, BT), q.device, 2, 20)
        row["per_config_us"] = {n: round(us, 2) for n, us in sorted(per_config_us.items(), key=lambda kv: kv[1])}
    return row


main = slices_main(BenchStagesArgs, "bench_stages", measure_one, check_args)


if __name__ == "__main__":
    with reliability.clean_exit():  # bad input: one `error: ...` line, exit code 2
        main()
