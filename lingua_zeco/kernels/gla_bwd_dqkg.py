"""GLA's dq, dk and dg in one Triton kernel: fla's intra-chunk score gradient (`chunk_gla_bwd_dA`), our
intra-chunk dq/dk (gla_bwd_intra.py) and fla's inter-chunk stage with the gate gradient
(`chunk_gla_bwd_kernel_inter`), fused. All three run one program per (chunk, key block, head) over the same
rows: fused, dA [BT, BT] and the intra-chunk dq, dk stay in registers instead of making an fp32 round trip
through memory each (at T = 16K, H = 16, K = V = 128: 67 MB of dA and 268 MB of dq, dk written and read back),
and two launches go.

Per chunk of BT rows and key block, as fla's stages compute it (fla's base-2 chunk-local gate cumsum g, the
chunk's last row n, states h and their gradients dh of the chunk, 16-bit operands into fp32 products):
    dA     = scale · do vᵀ, causal                                  (fla's chunk_gla_bwd_dA)
    dq     = scale · (do hᵀ) ⊙ 2^g + intra_dq(dA)                  (intra: gla_bwd_intra.py, whole chunk when
    dk     = (v dhᵀ) ⊙ 2^(g_n − g) + intra_dk(dA)                    the gates allow, else by sub-chunks)
    dg     = reverse cumsum of (q ⊙ dq − k ⊙ dk) + 2^g_n ⊙ Σ h ⊙ dh + Σ_t (v dhᵀ ⊙ 2^(g_n − g)) ⊙ k
Chunks too steep for one reference gate (never at GLA-1B's gate normalizer) take gla_bwd_intra.py's
sub-chunk path, which reads dA from memory and writes dq, dk there: those chunks alone go through the
scratch buffers the launcher allocates (no traffic otherwise).
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
    from .gla_bwd_intra import dqk_sub_chunks
    from .triton_chunks import chunk_origin

    @triton.autotune(
        # around the configs fla's inter-chunk stage and our intra-chunk one picked on H200 (BV 64, 4 warps, 2 stages)
        configs=[triton.Config({"BK": bk, "BV": bv}, num_warps=w, num_stages=2)
                 for bk in (32, 64) for bv in (32, 64) for w in (4, 8)],
        key=["BT", "K", "V", "IS_VARLEN"], cache_results=True)
    @triton.jit(do_not_specialize=["T"])
    def _dqkg_kernel(q, k, v, g, h, dh, do, dq, dk, dg, dA_s, dq_s, dk_s, cu_seqlens, chunk_indices, scale, T,
                     H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
                     BK: tl.constexpr, BV: tl.constexpr, IS_VARLEN: tl.constexpr = False, SPAN: tl.constexpr = 64.0):
        NK: tl.constexpr = (K + BK - 1) // BK
        i_kn, i_bh = tl.program_id(0), tl.program_id(1)
        i_k, i_c = i_kn % NK, i_kn // NK  # i_c: the chunk among all of the call's (its row of h and dh)
        i_b, i_h = (i_bh // H).to(tl.int64), i_bh % H
        i_n, bos, T_seq = chunk_origin(i_c, i_b, T, cu_seqlens, chunk_indices, IS_VARLEN)
        i_s = i_c if IS_VARLEN else i_b * tl.cdiv(T, BT) + i_c  # the chunk's state row: [B, NT] flattened
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        o_t = tl.arange(0, BT)
        t0 = i_n * BT
        m_t = t0 + o_t < T_seq
        m_tk = m_t[:, None] & m_k[None, :]
        rows = (bos + t0 + o_t) * H + i_h  # int64
        p_hk = (i_s * H + i_h).to(tl.int64) * K * V + o_k[None, :] * V  # h, dh [.., K, V] read as [BV, BK] tiles

        # inter-chunk parts and dA over the value blocks: each v, do tile read once for both
        b_dq = tl.zeros([BT, BK], dtype=tl.float32)
        b_dk = tl.zeros([BT, BK], dtype=tl.float32)
        b_dA = tl.zeros([BT, BT], dtype=tl.float32)
        b_dgk = tl.zeros([BK], dtype=tl.float32)
        for i_v in range(tl.cdiv(V, BV)):
            o_v = i_v * BV + tl.arange(0, BV)
            m_v = o_v < V
            m_tv = m_t[:, None] & m_v[None, :]
            m_vk = m_v[:, None] & m_k[None, :]
            b_v = tl.load(v + rows[:, None] * V + o_v[None, :], mask=m_tv, other=0.)
            b_do = tl.load(do + rows[:, None] * V + o_v[None, :], mask=m_tv, other=0.)
            b_h = tl.load(h + p_hk + o_v[:, None], mask=m_vk, other=0.)
            b_dh = tl.load(dh + p_hk + o_v[:, None], mask=m_vk, other=0.)
            b_dgk += tl.sum(b_h.to(tl.float32) * b_dh.to(tl.float32), axis=0)  # h, dh may be 16-bit
            b_dq = tl.dot(b_do, b_h.to(b_do.dtype), b_dq)
            b_dk = tl.dot(b_v, b_dh.to(b_v.dtype), b_dk)
            b_dA = tl.dot(b_do, tl.trans(b_v), b_dA)
        b_dA = tl.where((o_t[:, None] >= o_t[None, :]) & m_t[:, None], b_dA * scale, 0.)

        b_g = tl.load(g + rows[:, None] * K + o_k[None, :], mask=m_tk, other=0.).to(tl.float32)
        b_q = tl.load(q + rows[:, None] * K + o_k[None, :], mask=m_tk, other=0.)
        b_k = tl.load(k + rows[:, None] * K + o_k[None, :], mask=m_tk, other=0.)
        last = tl.minimum(BT, T_seq - t0) - 1
        b_gn = tl.sum(tl.where(o_t[:, None] == last, b_g, 0.), axis=0)

        # intra-chunk dq, dk: the whole chunk through its middle token's gate (gla_bwd_intra.py), when the gates allow
        mid = tl.minimum(BT // 2, last)
        g_r = tl.sum(tl.where(o_t[:, None] == mid, b_g, 0.), axis=0)
        span = tl.max(tl.max(tl.where(m_tk, tl.abs(b_g - g_r[None, :]), 0.), axis=1), axis=0)
        if span <= SPAN:
            kg = tl.where(m_tk, b_k.to(tl.float32) * tl.exp2(g_r[None, :] - b_g), 0.)
            qg = tl.where(m_tk, b_q.to(tl.float32) * tl.exp2(b_g - g_r[None, :]), 0.)
            b_dq_i = tl.dot(b_dA, kg, input_precision="tf32x3") * tl.exp2(tl.where(m_tk, b_g - g_r[None, :], 0.))
            b_dk_i = tl.dot(tl.trans(b_dA), qg, input_precision="tf32x3") * tl.exp2(
                tl.where(m_tk, g_r[None, :] - b_g, 0.))
        else:  # steep gates: the sub-chunk path, through the scratch buffers (this program's rows and keys only)
            tl.store(dA_s + rows[:, None] * BT + o_t[None, :], b_dA, mask=m_t[:, None])
            tl.debug_barrier()
            dqk_sub_chunks(q, k, g, dA_s, dq_s, dk_s, bos, i_h, o_k, m_k, t0, T_seq, H, K, BT, BC, BK, SPAN)
            tl.debug_barrier()
            b_dq_i = tl.load(dq_s + rows[:, None] * K + o_k[None, :], mask=m_tk, other=0.)
            b_dk_i = tl.load(dk_s + rows[:, None] * K + o_k[None, :], mask=m_tk, other=0.)

        # fla's inter-chunk stage from here on, its intra-chunk inputs from registers
        b_dgk *= tl.exp2(b_gn)
        b_dq = b_dq * scale * tl.exp2(b_g)
        b_dk = b_dk * tl.exp2(b_gn[None, :] - b_g)
        b_dgk += tl.sum(b_dk * b_k, axis=0)
        b_dq += b_dq_i
        b_dk += b_dk_i
        b_dg = b_q * b_dq - b_k * b_dk
        b_dg = b_dg - tl.cumsum(b_dg, axis=0) + tl.sum(b_dg, axis=0)[None, :] + b_dgk[None, :]
        p = rows[:, None] * K + o_k[None, :]
        tl.store(dq + p, b_dq.to(dq.dtype.element_ty), mask=m_tk)
        tl.store(dk + p, b_dk.to(dk.dtype.element_ty), mask=m_tk)
        tl.store(dg + p, b_dg.to(dg.dtype.element_ty), mask=m_tk)


def chunk_gla_bwd_dqkg(qkvg, h, dh, do, *, scale: float, dtypes, layout: ChunkLayout):
    """(dq, dk, dg) in `dtypes` (16 bits in training) from the forward's inputs qkvg = (q, k, v, g_cs) with g_cs
    fla's fp32 chunk-local gate cumsum, the chunk states h and their gradients dh [B, NT, H, K, V] and the output
    gradient do: what fla's chunk_gla_bwd_dA, our intra-chunk dq/dk and fla's chunk_gla_bwd_dqkg give, with
    fla's precisions, in one launch. Packed documents (B = 1) with the layout's chunk tables."""
    q, k, v, g_cs = qkvg
    B, T, H, K, V = *k.shape, v.shape[-1]
    BT = layout.BT
    if g_cs.dtype != torch.float:
        raise TypeError(f"dqkg: g_cs must be fla's fp32 gate cumsum, got {g_cs.dtype}")
    NT = layout.chunks(T)
    dq, dk, dg = (torch.empty_like(x, dtype=d) for x, d in zip((q, k, g_cs), dtypes))
    # written only for chunks whose gates are too steep for one reference (module doc)
    dA_s = q.new_empty(B, T, H, BT, dtype=torch.float)
    dq_s, dk_s = torch.empty_like(q, dtype=torch.float), torch.empty_like(k, dtype=torch.float)
    _dqkg_kernel[lambda meta: (triton.cdiv(K, meta["BK"]) * NT, B * H)](
        q, k, v, g_cs, h, dh, do, dq, dk, dg, dA_s, dq_s, dk_s, layout.cu_seqlens, layout.chunk_indices, scale, T,
        H=H, K=K, V=V, BT=BT, BC=min(16, BT), IS_VARLEN=layout.packed)
    return dq, dk, dg


__all__ = ["chunk_gla_bwd_dqkg"]
