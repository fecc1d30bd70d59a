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
# the intra-chunk parts of dq, dk, from dA (fla's; ours, gla_bwd_intra.py, replaces it: the reference of benchmarks)
from fla.ops.gla.chunk import chunk_gla_bwd_dqk_intra
# dv = Aᵀ do (intra) + (k ⊙ 2^(g_cs_end − g_cs)) dh_n (inter)
from fla.ops.gla.chunk import chunk_gla_bwd_dv
# the inter-chunk parts of dq, dk (from h, dh) added to the intra ones, and dg (fp32; chunk_gla_bwd_dqkg_to below
# stores them in the gradients' own dtypes instead)
from fla.ops.gla.chunk import chunk_gla_bwd_dqkg, chunk_gla_bwd_kernel_inter
from fla.ops.utils.constant import RCP_LN2
from fla.ops.utils.cumsum import chunk_local_cumsum
# ---- the kernels behind chunk_fwd_h / chunk_bwd_dh, launched directly for packed documents
from fla.ops.common.chunk_h import chunk_bwd_kernel_dh, chunk_fwd_kernel_h


def gate_cumsum(g, BT: int, cu_seqlens=None, chunk_indices=None):
    """g_cs: the cumsum of the log gates inside each chunk (per document with cu_seqlens), in base 2
    (× log2 e), fp32: fla's first stage."""
    return chunk_local_cumsum(g, BT, scale=RCP_LN2, cu_seqlens=cu_seqlens, chunk_indices=chunk_indices)


# Packed documents: fla's chunk_fwd_h / chunk_bwd_dh size h and dh with `chunk_offsets[-1].item()`, a
# host sync in every call. With the chunk table planned once per step on the host
# (lingua_zeco.sp.varlen.LocalSegments.chunk_index) the same kernels are launched as fla's wrappers
# launch them (GLA: per-key gates gk only, states [K, V]), without the sync.
def _state_grid(K, V, N, H):
    return lambda meta: (triton.cdiv(K, meta["BK"]) * triton.cdiv(V, meta["BV"]) * N * H,)


def chunk_fwd_h_packed(k, v, gk, h0, *, layout: ChunkLayout, output_final_state: bool, states_in_fp32: bool = False):
    """= chunk_fwd_h(k=k, v=v, gk=gk, h0=h0, cu_seqlens=layout.cu_seqlens, chunk_size=layout.BT, ...)."""
    B, T, H, K, V = *k.shape, v.shape[-1]
    N = layout.cu_seqlens.numel() - 1
    h = k.new_empty(B, layout.n_chunks, H, K, V, dtype=torch.float if states_in_fp32 else k.dtype)
    ht = k.new_empty(N, H, K, V, dtype=torch.float) if output_final_state else None
    chunk_fwd_kernel_h[_state_grid(K, V, N, H)](
        k=k, v=v, h=h, g=None, g_gamma=None, gk=gk, gv=None, h0=h0, ht=ht, cu_seqlens=layout.cu_seqlens,
        split_offsets=layout.chunk_offsets, T=T, H=H, K=K, V=V, BT=layout.BT, BS=layout.BT, USE_G=False,
        USE_G_GAMMA=False, USE_GK=True, USE_GV=False, STATE_V_FIRST=False)
    return h, ht


def chunk_bwd_dh_packed(q, do, dht, gk, *, scale, layout: ChunkLayout, h0=None):
    """= chunk_bwd_dh(q=q, k=q, v=do, do=do, h0=h0, dht=dht, scale=scale, gk=gk, cu_seqlens=layout.cu_seqlens,
    chunk_size=layout.BT, states_in_fp32=True): (dh [B, NT, H, K, V] in fp32, dh0 [N, H, K, V] or None); the
    kernel reads neither k nor v (only their sizes, which q and do have)."""
    B, T, H, K, V = *q.shape, do.shape[-1]
    N = layout.cu_seqlens.numel() - 1
    dh = q.new_empty(B, layout.n_chunks, H, K, V, dtype=torch.float)
    dh0 = None if h0 is None else torch.empty_like(h0, dtype=torch.float)
    chunk_bwd_kernel_dh[_state_grid(K, V, N, H)](
        q=q, g=None, g_gamma=None, gk=gk, gv=None, do=do, dh=dh, dht=dht, dh0=dh0, cu_seqlens=layout.cu_seqlens,
        split_offsets=layout.chunk_offsets, scale=scale, T=T, HQ=H, H=H, K=K, V=V, BT=layout.BT, BS=layout.BT,
        NG=1, USE_G=False, USE_G_GAMMA=False, USE_GK=True, USE_GV=False, STATE_V_FIRST=False)
    return dh, dh0


def chunk_gla_bwd_dqkg_to(qkvg, h, dh, do, dqk, *, scale, dtypes, layout: ChunkLayout):
    """= (x.to(d) for x, d in zip(chunk_gla_bwd_dqkg(q, k, v, h, g_cs, do, dh, dq, dk, scale, ...), dtypes)) with
    (q, k, v, g_cs) = qkvg and the intra-chunk parts (dq, dk) = dqk, without the three casts: fla's kernel already
    rounds each output to its buffer's dtype as it stores it, so buffers in the dtypes the caller returns (dq's,
    dk's and the raw gate's: 16 bits in training) hold the same values up to rounding (Triton lowers the fp32
    arithmetic differently per output dtype: a few values land on the other 16-bit neighbour) while the fp32
    buffers, and the three cast kernels that read them back, are not needed."""
    q, k, v, g = qkvg
    dq, dk = dqk
    B, T, H, K, V = *k.shape, v.shape[-1]
    NT = triton.cdiv(T, layout.BT) if not layout.packed else layout.n_chunks
    dq2, dk2 = torch.empty_like(dq, dtype=dtypes[0]), torch.empty_like(dk, dtype=dtypes[1])
    dg = torch.empty_like(g, dtype=dtypes[2])
    chunk_gla_bwd_kernel_inter[lambda meta: (triton.cdiv(K, meta["BK"]) * NT, B * H)](
        q=q, k=k, v=v, g=g, h=h, do=do, dh=dh, dq=dq, dk=dk, dq2=dq2, dk2=dk2, dg=dg, cu_seqlens=layout.cu_seqlens,
        chunk_indices=layout.chunk_indices, scale=scale, T=T, H=H, K=K, V=V, BT=layout.BT, STATE_V_FIRST=False)
    return dq2, dk2, dg


__all__ = ["chunk_bwd_dh", "chunk_bwd_dh_packed", "chunk_fwd_h", "chunk_fwd_h_packed", "chunk_gla_bwd_dA",
           "chunk_gla_bwd_dqk_intra", "chunk_gla_bwd_dqkg", "chunk_gla_bwd_dqkg_to", "chunk_gla_bwd_dv",
           "chunk_gla_fwd_intra_gk", "chunk_gla_fwd_o_gk", "gate_cumsum"]
