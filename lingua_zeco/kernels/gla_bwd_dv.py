"""GLA's dv in one Triton kernel: fla's `chunk_gla_bwd_dv` with its intra-chunk product on tensor cores and the
value block free to span all of V.

Per chunk of BT rows (fla's base-2 chunk-local gate cumsum g, the chunk's last row n, the forward's intra-chunk
attention A [BT, BT] fp32 and the gradient dh of the chunk's state):
    dv = Aᵀ do + (k ⊙ 2^(g_n − g)) dh          (16-bit k and dh into the second product, as fla)
fla's stage takes Aᵀ do in fp32 on the CUDA cores, and tiles V in blocks smaller than V (its autotuner prunes a
block equal to V: each program reads A, k and the gates again per value block). Here Aᵀ do is three TF32 products
(tf32x3, fp32's accuracy), as the intra-chunk products of gla_bwd_dqkg.py, and the autotuner may also take one value
block over all of V (A, k, g read once per chunk) where that is faster.
"""
from __future__ import annotations

import torch

from .common import ChunkLayout

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None


if triton is not None:
    from .triton_chunks import chunk_origin

    @triton.autotune(
        configs=[triton.Config({"BK": bk, "BV": bv}, num_warps=w, num_stages=s)
                 for bk in (32, 64) for bv in (64, 128) for w in (4, 8) for s in (2, 3)],
        key=["BT", "K", "V", "IS_VARLEN"], cache_results=True)
    @triton.jit(do_not_specialize=["T"])
    def _dv_kernel(k, g, A, do, dh, dv, cu_seqlens, chunk_indices, T, H: tl.constexpr, K: tl.constexpr,
                   V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                   IS_VARLEN: tl.constexpr = False):
        NV: tl.constexpr = (V + BV - 1) // BV
        i_vn, i_bh = tl.program_id(0), tl.program_id(1)
        i_v, i_c = i_vn % NV, i_vn // NV  # i_c: the chunk among all of the call's (its row of dh)
        i_b, i_h = (i_bh // H).to(tl.int64), i_bh % H
        i_n, bos, T_seq = chunk_origin(i_c, i_b, T, cu_seqlens, chunk_indices, IS_VARLEN)
        i_s = i_c if IS_VARLEN else i_b * tl.cdiv(T, BT) + i_c  # the chunk's state row: [B, NT] flattened
        o_t = tl.arange(0, BT)
        t0 = i_n * BT
        m_t = t0 + o_t < T_seq
        rows = (bos + t0 + o_t) * H + i_h  # int64
        o_v = i_v * BV + tl.arange(0, BV)
        m_tv = m_t[:, None] & (o_v < V)[None, :]

        # Aᵀ: [j, t] = A[t, j], kept for j ≤ t
        b_At = tl.load(A + rows[None, :] * BT + o_t[:, None], mask=m_t[None, :], other=0.)
        b_At = tl.where(o_t[:, None] <= o_t[None, :], b_At, 0.)
        b_do = tl.load(do + rows[:, None] * V + o_v[None, :], mask=m_tv, other=0.)
        b_dv = tl.dot(b_At, b_do.to(tl.float32), input_precision="tf32x3")

        last = (bos + t0 + tl.minimum(BT, T_seq - t0) - 1) * H + i_h  # the chunk's last row
        p_dh = dh + (i_s * H + i_h).to(tl.int64) * K * V + o_v[None, :]
        for i_k in range(tl.cdiv(K, BK)):
            o_k = i_k * BK + tl.arange(0, BK)
            m_k = o_k < K
            m_tk = m_t[:, None] & m_k[None, :]
            b_k = tl.load(k + rows[:, None] * K + o_k[None, :], mask=m_tk, other=0.)
            b_g = tl.load(g + rows[:, None] * K + o_k[None, :], mask=m_tk, other=0.)
            b_gn = tl.load(g + last * K + o_k, mask=m_k, other=0.)
            b_kd = (b_k * tl.exp2(b_gn[None, :] - b_g)).to(b_k.dtype)
            b_dh = tl.load(p_dh + o_k[:, None] * V, mask=m_k[:, None] & (o_v < V)[None, :], other=0.)
            b_dv = tl.dot(b_kd, b_dh.to(b_k.dtype), b_dv)
        tl.store(dv + rows[:, None] * V + o_v[None, :], b_dv.to(dv.dtype.element_ty), mask=m_tv)


def chunk_gla_bwd_dv(k, g_cs, A, do, dh, *, layout: ChunkLayout):
    """dv [B, T, H, V] in do's dtype from k, fla's fp32 chunk-local gate cumsum g_cs, the forward's intra-chunk
    attention A [B, T, H, BT] fp32, the output gradient do and the state gradients dh [B, NT, H, K, V]: what fla's
    chunk_gla_bwd_dv gives (module doc). Packed documents (B = 1) with the layout's chunk tables."""
    B, T, H, K, V = *k.shape, do.shape[-1]
    BT = layout.BT
    if g_cs.dtype != torch.float or A.dtype != torch.float:
        raise TypeError(f"dv: g_cs and A must be fla's fp32 gate cumsum and attention, got {g_cs.dtype}, {A.dtype}")
    NT = layout.chunks(T)
    dv = torch.empty_like(do)
    _dv_kernel[lambda meta: (triton.cdiv(V, meta["BV"]) * NT, B * H)](
        k, g_cs, A, do, dh, dv, layout.cu_seqlens, layout.chunk_indices, T, H=H, K=K, V=V, BT=BT,
        IS_VARLEN=layout.packed)
    return dv


def dv_best_config() -> str:
    """The autotuner's pick for the shapes timed last (for the benchmarks' records)."""
    return str(getattr(_dv_kernel, "best_config", None))


__all__ = ["chunk_gla_bwd_dv", "dv_best_config"]
