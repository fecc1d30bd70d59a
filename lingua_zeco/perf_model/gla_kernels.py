"""Bytes and FLOPs of each kernel of the GLA operator (fla's chunk_gla stages and ours), for the roofline
table (apps/gla/bench/roofline.py; docs/results/README.md, "One H200: the GLA operator").

One call of each kernel on [B, T, H, K] / [B, T, H, V] inputs in 16-bit, chunks of BT tokens (NT = T / BT):
the least DRAM traffic the kernel can do (each input read once, each output written once; what a program
reuses stays on chip) and the FLOPs of its matrix products (2·m·n·k, a causal chunk counted whole, as the
kernels compute it; elementwise work left out). Sizes: N_K = B·T·H·K and N_V = B·T·H·V elements of the
inputs, N_S = B·NT·H·K·V chunk states, N_A = B·T·H·BT intra-chunk scores (fp32), the gate cumsum g_cs fp32.
`chunk_fwd_kernel_h` runs twice per forward+backward: in the forward with 16-bit states, in the backward's
recompute with fp32 states; the profiler averages the two calls, and so does its entry here. The state
gradients dh: fp32 in fla's chunk_gla, 16-bit in ours (kernels/gla_chunk.py): `dh16`.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KernelCost:
    bytes: float  # DRAM bytes of one call, read + written
    flops: float  # FLOPs of one call's matrix products

    @property
    def intensity(self) -> float:
        """FLOPs per DRAM byte."""
        return self.flops / self.bytes


def gla_kernel_costs(B: int, T: int, H: int, K: int, V: int, BT: int = 64, e: int = 2,
                     stores_h: bool = False, dh16: bool = True) -> dict[str, KernelCost]:
    """Kernel name (as the profiler shows a Triton kernel: its function's name) -> cost of one call. e: bytes
    of an input element (q, k, v, g, do and the outputs o, dq, dk, dv). stores_h: ZeCO's output stage writes the
    true states back (save_h). dh16: the state gradients in e bytes (ours), else fp32 (fla's chunk_gla)."""
    NT = -(-T // BT)
    NK, NV, NS, NA = B * T * H * K, B * T * H * V, B * NT * H * K * V, B * T * H * BT
    state = 2 * B * T * H * K * V  # FLOPs of one product through the K×V states (k^T v, q h, do h^T, ...)
    scores_k, scores_v = 2 * NA * K, 2 * NA * V  # one product inside the chunks over K (q k^T) or V (do v^T)
    fwd_h = dict(r=e * NK + e * NV + 4 * NK, f=state)
    dh = e if dh16 else 4  # bytes of a state gradient
    NC = max(1, BT // 16)
    below = NC * (NC - 1) / 2 / NC ** 2  # the share of a chunk's sub-chunk blocks strictly below the diagonal
    costs = {
        "chunk_local_cumsum_vector_kernel": (e * NK + 4 * NK, 0),
        # h: 16-bit in the forward, fp32 in the backward's recompute (the average of the two calls)
        "chunk_fwd_kernel_h": (fwd_h["r"] + (e * NS + 4 * NS) / 2, fwd_h["f"]),
        # fla's A in 16-token sub-chunks (NC per chunk): the blocks below the diagonal, then the diagonal ones
        "chunk_gla_fwd_A_kernel_intra_sub_inter": (2 * e * NK + 4 * NK + 4 * NA * below, scores_k * below),
        "chunk_gla_fwd_A_kernel_intra_sub_intra": (2 * e * NK + 4 * NK + 4 * NA / NC, scores_k / NC),
        # ours: the whole chunk's A at once (gla_fwd_intra.py), every score computed (the upper triangle too)
        "_fwd_A_kernel": (2 * e * NK + 4 * NK + 4 * NA, scores_k),
        "chunk_gla_fwd_kernel_o": (e * NK + 4 * NK + e * NS + 4 * NA + e * NV + e * NV, state + scores_v),
        "_fwd_o_kernel": (e * NK + 4 * NK + e * NS * (2 if stores_h else 1) + 4 * NA + e * NV + e * NV,
                          state + scores_v),  # + S_in: tiny
        "_decay_prefix_kernel": (8 * B * NT * H * K, 0),
        "_dS_in_kernel": (e * NK + e * NK + e * NV, state),  # the raw 16-bit gates, their cumsum made inside
        "chunk_bwd_kernel_dh": (e * NK + e * NV + 4 * NK + dh * NS, state),
        "chunk_gla_bwd_kernel_dA": (2 * e * NV + 4 * NA, scores_v),
        "chunk_gla_bwd_kernel_dv": (e * NK + 4 * NK + 4 * NA + e * NV + 4 * NS + e * NV, scores_v + state),
        # ours (gla_bwd_dv.py): the same products and inputs, dh as the operator keeps it
        "_dv_kernel": (e * NK + 4 * NK + 4 * NA + e * NV + dh * NS + e * NV, scores_v + state),
        "chunk_gla_bwd_kernel_intra": (2 * e * NK + 4 * NK + 4 * NA + 2 * 4 * NK, 2 * scores_k),
        # dq += do h^T, dk += v dh^T; reads h and dh in fp32 and the intra parts of dq, dk; writes dq, dk, dg
        "chunk_gla_bwd_kernel_inter": (2 * e * NK + e * NV + 4 * NS + 4 * NK + e * NV + 4 * NS + 2 * 4 * NK
                                       + 2 * e * NK + 4 * NK, 2 * state),
        # ours: dA, the intra-chunk dq, dk and the inter stage in one (gla_bwd_dqkg.py): reads q, k, g, v, do, the
        # kept 16-bit h and dh; writes dq, dk, dg in the inputs' dtype
        "_dqkg_kernel": (2 * e * NK + 4 * NK + 2 * e * NV + e * NS + dh * NS + 3 * e * NK,
                         2 * state + scores_v + 2 * scores_k),
    }
    return {name: KernelCost(float(b), float(f)) for name, (b, f) in costs.items()}


def match_kernel(name: str, costs: dict[str, KernelCost]) -> str | None:
    """The cost entry of a profiled kernel name (Triton kernels keep their function's name; an entry may
    prefix a longer name), or None."""
    if name in costs:
        return name
    return next((c for c in sorted(costs, key=len, reverse=True) if name.startswith(c)), None)


def roofline_row(name: str, cost: KernelCost, seconds: float, copy_Bps: float, gemm_flops: float) -> dict:
    """What one kernel achieves against the GPU's measured ceilings: TB/s, TFLOP/s, their fractions, and which
    ceiling bounds it (its intensity against the ridge point gemm_flops / copy_Bps)."""
    bound = "compute" if cost.intensity > gemm_flops / copy_Bps else "memory"
    floor_s = max(cost.bytes / copy_Bps, cost.flops / gemm_flops)
    return dict(kernel=name, us=round(seconds * 1e6, 2), MB=round(cost.bytes / 1e6, 1),
                GFLOP=round(cost.flops / 1e9, 2), flop_per_byte=round(cost.intensity, 1),
                TBps=round(cost.bytes / seconds / 1e12, 2), TFLOPs=round(cost.flops / seconds / 1e12, 1),
                bound=bound, of_bound_pct=round(100 * floor_s / seconds, 1))


__all__ = ["KernelCost", "gla_kernel_costs", "match_kernel", "roofline_row"]
