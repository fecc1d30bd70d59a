"""fla's chunk_gla, stage by stage: the one door to fla's private modules (their paths move between
fla versions; pin and test them here). Importing this module imports fla and Triton.

lingua_zeco/sp/fused_zeco.py and fused_packed.py reorder these stages around the All-Scan. fla's
layout: [B, T, H, *] tensors; chunks of BT tokens; h [B, NT, H, K, V] (or [N, NT...] per document
with cu_seqlens); gates kept as the chunk-local base-2 cumsum g_cs; every stage takes chunk_size=BT.
"""
from __future__ import annotations

# ---- forward
# h_n = the state entering chunk n from h0 (None: zero), and the final state(s) if asked
from fla.ops.common.chunk_h import chunk_fwd_h
# A [B, T, H, BT] = the intra-chunk attention scale·(q_t ⊙ 2^g_cs_t)·(k_j ⊙ 2^-g_cs_j), j ≤ t in t's chunk
from fla.ops.gla.chunk import chunk_gla_fwd_intra_gk
# o_t = scale·(q_t ⊙ 2^g_cs_t)ᵀ h_n + Σ_j A_tj v_j: the output stage (ZeCO replaces it with zeco_fwd_o)
from fla.ops.gla.chunk import chunk_gla_fwd_o_gk
# ---- backward
# dh_n = ∂L/∂h_n from do, the final-state gradient dht and the gates (and dh0)
from fla.ops.common.chunk_h import chunk_bwd_dh
# dA = scale · do vᵀ inside each chunk, causal (the gradient of the intra-chunk scores, scale included)
from fla.ops.gla.chunk import chunk_gla_bwd_dA
# the intra-chunk parts of dq, dk, from dA
from fla.ops.gla.chunk import chunk_gla_bwd_dqk_intra
# dv = Aᵀ do (intra) + (k ⊙ 2^(g_cs_end − g_cs)) dh_n (inter)
from fla.ops.gla.chunk import chunk_gla_bwd_dv
# the inter-chunk parts of dq, dk (from h, dh) added to the intra ones, and dg
from fla.ops.gla.chunk import chunk_gla_bwd_dqkg
from fla.ops.utils.constant import RCP_LN2
from fla.ops.utils.cumsum import chunk_local_cumsum


def gate_cumsum(g, BT: int, cu_seqlens=None):
    """g_cs: the cumsum of the log gates inside each chunk (per document with cu_seqlens), in base 2
    (× log2 e), fp32: fla's first stage."""
    return chunk_local_cumsum(g, BT, scale=RCP_LN2, cu_seqlens=cu_seqlens)


__all__ = ["chunk_bwd_dh", "chunk_fwd_h", "chunk_gla_bwd_dA", "chunk_gla_bwd_dqk_intra", "chunk_gla_bwd_dqkg",
           "chunk_gla_bwd_dv", "chunk_gla_fwd_intra_gk", "chunk_gla_fwd_o_gk", "gate_cumsum"]
