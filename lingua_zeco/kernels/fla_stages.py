"""fla's chunk_gla, stage by stage: the one door to fla's private modules (their paths move between
fla versions; pin and test them here). Importing this module imports fla and Triton.

lingua_zeco/sp/fused_zeco.py and fused_packed.py reorder these stages around the All-Scan. fla's
layout: [B, T, H, *] tensors; chunks of BT tokens; h [B, NT, H, K, V] (or [N, NT...] per document
with cu_seqlens); gates kept as the chunk-local base-2 cumsum g_cs; every stage takes chunk_size=BT.
"""
from __future__ import annotations

import torch
import triton

from .common import ChunkLayout

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
# the inter-chunk parts of dq, dk (from h, dh) added to the intra ones, and dg (fp32)
# (dA, the intra and the inter stage: our one kernel replaces the three, gla_bwd_dqkg.py; fla's stay its reference)
from fla.ops.gla.chunk import chunk_gla_bwd_dqkg
from fla.ops.utils.constant import RCP_LN2
# ---- the kernels behind chunk_local_cumsum, chunk_fwd_h and chunk_bwd_dh, which we launch ourselves (below:
# gate_cumsum, fwd_h, bwd_dh; fla's three wrappers stay the references the GPU tests compare them with)
from fla.ops.common.chunk_h import chunk_bwd_kernel_dh, chunk_fwd_kernel_h
from fla.ops.utils.cumsum import chunk_local_cumsum, chunk_local_cumsum_vector_kernel


# We launch three of fla's kernels ourselves, as fla's wrappers launch them for GLA (per-key gates gk only, states
# [K, V]): for packed documents fla's chunk_fwd_h / chunk_bwd_dh size h and dh with `chunk_offsets[-1].item()`, a
# host sync in every call, where our chunk table is planned once per step on the host (ChunkLayout, from
# lingua_zeco.sp.varlen.LocalSegments.chunk_index); dense rows take the same launches (one path for both). Skipping
# fla's wrappers (dispatch, input_guard) did not shorten the host's time per operator call (measured, 2026-12-05).
# Callers pass contiguous tensors (fla's input_guard made them so).
def gate_cumsum(g, BT: int, cu_seqlens=None, chunk_indices=None):
    """g_cs: the cumsum of the log gates g [B, T, H, K] inside each chunk (per document with cu_seqlens and its
    chunk_indices), in base 2 (× log2 e), fp32: fla's first stage (= fla's chunk_local_cumsum(g, BT,
    scale=RCP_LN2, ...))."""
    if (cu_seqlens is None) != (chunk_indices is None):
        raise ValueError("gate_cumsum: packed documents need both cu_seqlens and their chunk_indices (ChunkLayout)")
    B, T, H, K = g.shape
    g = g.contiguous()
    NT = triton.cdiv(T, BT) if cu_seqlens is None else chunk_indices.shape[0]
    g_cs = torch.empty_like(g, dtype=torch.float)
    chunk_local_cumsum_vector_kernel[lambda meta: (triton.cdiv(K, meta["BS"]) * NT, B * H)](
        s=g, o=g_cs, scale=RCP_LN2, cu_seqlens=cu_seqlens, chunk_indices=chunk_indices, T=T, B=B, H=H, S=K, BT=BT,
        REVERSE=False, USE_GRAPH=False)
    return g_cs


def _state_grid(K, V, N, H):
    return lambda meta: (triton.cdiv(K, meta["BK"]) * triton.cdiv(V, meta["BV"]) * N * H,)


def _sequences(B: int, layout: ChunkLayout) -> int:
    """N, the sequences with a state each: the B rows, or the packed documents of the layout."""
    return layout.cu_seqlens.numel() - 1 if layout.packed else B


def fwd_h(k, v, gk, h0, *, layout: ChunkLayout, output_final_state: bool, states_in_fp32: bool = False):
    """= fla's chunk_fwd_h(k=k, v=v, gk=gk, h0=h0, cu_seqlens=layout.cu_seqlens, chunk_size=layout.BT, ...): (h [B,
    NT, H, K, V] in k's dtype or fp32, the final states [N, H, K, V] fp32 or None), N the rows or the documents."""
    B, T, H, K, V = *k.shape, v.shape[-1]
    N, NT = _sequences(B, layout), layout.chunks(T)
    h = k.new_empty(B, NT, H, K, V, dtype=torch.float if states_in_fp32 else k.dtype)
    ht = k.new_empty(N, H, K, V, dtype=torch.float) if output_final_state else None
    h0 = None if h0 is None else h0.contiguous()
    chunk_fwd_kernel_h[_state_grid(K, V, N, H)](
        k=k, v=v, h=h, g=None, g_gamma=None, gk=gk, gv=None, h0=h0, ht=ht, cu_seqlens=layout.cu_seqlens,
        split_offsets=layout.chunk_offsets, T=T, H=H, K=K, V=V, BT=layout.BT, BS=layout.BT, USE_G=False,
        USE_G_GAMMA=False, USE_GK=True, USE_GV=False, STATE_V_FIRST=False)
    return h, ht


def bwd_dh(q, do, dht, gk, *, scale, layout: ChunkLayout, h0=None, states_in_fp32: bool = False):
    """= fla's chunk_bwd_dh(q=q, k=q, v=do, do=do, h0=h0, dht=dht, scale=scale, gk=gk,
    cu_seqlens=layout.cu_seqlens, chunk_size=layout.BT, states_in_fp32=states_in_fp32): (dh [B, NT, H, K, V] in
    q's dtype or fp32, dh0 [N, H, K, V] fp32 or None); the kernel reads neither k nor v (only their sizes, which q
    and do have)."""
    B, T, H, K, V = *q.shape, do.shape[-1]
    N, NT = _sequences(B, layout), layout.chunks(T)
    dh = q.new_empty(B, NT, H, K, V, dtype=torch.float if states_in_fp32 else q.dtype)
    dh0 = None if h0 is None else torch.empty_like(h0, dtype=torch.float)
    dht = None if dht is None else dht.contiguous()  # e.g. ht.sum()'s gradient: ones expanded, stride 0
    chunk_bwd_kernel_dh[_state_grid(K, V, N, H)](
        q=q, g=None, g_gamma=None, gk=gk, gv=None, do=do, dh=dh, dht=dht, dh0=dh0, cu_seqlens=layout.cu_seqlens,
        split_offsets=layout.chunk_offsets, scale=scale, T=T, HQ=H, H=H, K=K, V=V, BT=layout.BT, BS=layout.BT,
        NG=1, USE_G=False, USE_G_GAMMA=False, USE_GK=True, USE_GV=False, STATE_V_FIRST=False)
    return dh, dh0


__all__ = ["RCP_LN2", "bwd_dh", "chunk_bwd_dh", "chunk_fwd_h", "chunk_gla_bwd_dA", "chunk_gla_bwd_dqk_intra",
           "chunk_gla_bwd_dqkg", "chunk_gla_bwd_dv", "chunk_gla_fwd_intra_gk", "chunk_gla_fwd_o_gk",
           "chunk_local_cumsum", "fwd_h", "gate_cumsum"]
