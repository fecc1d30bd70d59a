"""Model throughput, tokens/s/GPU (paper Tables 5-6).

Every GPU holds T_local tokens per step. From the measured single-GPU step time T0 = T_local / tok_s:
    DP      step = T0 + (1 - grad_overlap) * allreduce(grads, N)
    SP (m)  step = T0 + n_layers * (op_m(P) - op_none) + (1 - grad_overlap) * allreduce(grads, N)
Parameters are replicated over the SP ranks, so every method reduces gradients over all N GPUs.
LASP-1's per-layer cost is its full serial operator time: FSDP's per-layer all-gathers re-align the
ranks every layer, so no wavefront forms across layers.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from .inputs import assumed, missing
from .links import Topology
from .memory import ModelShapeArgs
from .op_model import OpArgs, interp_clamped, op_times
from .schedules import DeviceArgs, allreduce_big


@dataclass
class ThroughputArgs:
    # training tokens/s per GPU per T_local: measured only (metrics_dp.jsonl, bench_train JSON: calibrate.py)
    tok_s: dict[int, float] = field(default_factory=dict)
    n_layers: int = ModelShapeArgs.n_layers  # the GLA-1B shape of memory.ModelShapeArgs
    n_params: float = field(default_factory=lambda: float(ModelShapeArgs().n_params()))
    grad_bytes: int = 4  # bytes per reduced gradient: fp32, the gla_1b configs' distributed.reduce_dtype
    grad_overlap: float = assumed("tput.grad_overlap")  # share of the gradient reduction hidden under backward
    tok_s_world: int = assumed("tput.tok_s_world")  # GPUs of the tok_s measurement: its gradient sync leaves T0
    hide_op_overhead: bool = assumed("tput.hide_op_overhead")  # op.scan_op_overhead_s (host gaps) hides in training


def single_gpu_tok_s(T: int, tok_s: dict[int, float]) -> float:
    """Linear in T between the measured lengths, flat outside them (throughput saturates)."""
    if not tok_s:
        raise missing("tput.tok_s")
    return interp_clamped(T, tok_s, 0.0)


def tokens_per_gpu(N: int, T_local: int, args: ThroughputArgs, op: OpArgs, topo: Topology,
                   dev: DeviceArgs, sp: int | None = None) -> dict:
    """tokens/s/GPU per method with N GPUs, SP groups of `sp` (default: all N) ranks."""
    P = sp or N
    if N % P:
        raise ValueError(f"sp={P} must divide N={N}")
    ar = lambda n: (1 - args.grad_overlap) * allreduce_big(args.n_params * args.grad_bytes, n, topo)  # noqa: E731
    T0 = T_local / single_gpu_tok_s(T_local, args.tok_s) - ar(args.tok_s_world)
    grad = ar(N)
    if args.hide_op_overhead:
        op = replace(op, scan_op_overhead_s=0.0)
    ops = op_times(P, T_local, op, topo, dev)
    sp_methods = {m: T_local / (T0 + args.n_layers * (ops[m] - ops["none"]) + grad)
                  for m in ("zeco", "zeco_chain", "lasp1", "lasp2")}
    return dict(dp=T_local / (T0 + grad), **sp_methods, grad_sync_ms=grad * 1e3, scan=ops["scan_algo"])


def throughput_rows(N_list: list[int], T_list: list[int], args: ThroughputArgs, op: OpArgs,
                    topo: Topology, dev: DeviceArgs) -> list[dict]:
    rows = []
    for T in T_list:
        for N in N_list:
            r = tokens_per_gpu(N, T, args, op, topo, dev)
            rows.append(dict(T_local=T, N=N, scan=r["scan"], grad_ms=r["grad_sync_ms"],
                             **{f"{m}_ktok_s": r[m] / 1e3 for m in ("dp", "zeco", "zeco_chain", "lasp1", "lasp2")}))
    return rows
