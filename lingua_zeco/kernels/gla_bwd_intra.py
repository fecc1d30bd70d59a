"""The intra-chunk part of GLA's dq and dk, as the backward's fused kernel computes it (gla_bwd_dqkg.py, which
replaces fla's `chunk_gla_bwd_dqk_intra` with it), beside its torch oracle.

Inside a chunk of BT tokens, with fla's chunk-local base-2 gate cumsum g and dA[t, j] = ∂L/∂A_tj
(scale included; fla's `chunk_gla_bwd_dA`):
    dq_t = Σ_{j≤t} dA_tj · k_j ⊙ 2^(g_t − g_j)          dk_j = Σ_{t≥j} dA_tj · q_t ⊙ 2^(g_t − g_j)
fla's kernel runs one program per 16-token sub-chunk and walks the diagonal block token by token, once for dq
and again for dk. Ours takes a whole chunk for BK keys through one reference gate, its middle token's g_r:
2^(g_t − g_j) = 2^(g_t − g_r)·2^(g_r − g_j), two [BT, BT] x [BT, BK] products in 3×TF32 (fla's choice of fp32
for this stage; its comment: bf16 here loses precision), where the chunk's gates stay within 2^±SPAN (64: far
from fp32's 2^±126) of g_r, as they do at GLA-1B's gate normalizer. A steeper chunk goes by 16-token sub-chunks
(`dqk_sub_chunks` here): each block s a few tensor-core products through the gate at s's middle token (off the
diagonal block one factor is ≤ 1, as g falls along the chunk, and the other within s's own span; 3×TF32 on the
diagonal block, which holds the largest terms, TF32 off it as fla's off-diagonal products), or where even that
would pass 2^±SPAN exact decays on the diagonal block as one [BC, BC, BK] tile, with references at the block's
edges off it, so that no input overflows.
Packed documents (B = 1) come as fla's varlen stages take them, with its chunk table: a program's chunk is
(document, chunk in document), and it reads that document's rows as one sequence of its own length.
"""
from __future__ import annotations

import torch

from .common import acc_dtype, chunked, intra_chunk_decays

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the oracle still works
    triton = None


def chunk_gla_bwd_dqk_intra_torch(q, k, g_cs, dA, BT: int, cu_seqlens=None):
    """Oracle: (dq, dk) [B, T, H, K] in at least fp32 from q, k, the chunk-local base-2 cumsum g_cs
    [B, T, H, K] and dA [B, T, H, BT] (row t, column j of t's chunk). cu_seqlens (host ints, B = 1):
    packed documents, each chunked from its own start as fla's varlen stages do."""
    if cu_seqlens is not None:
        parts = [chunk_gla_bwd_dqk_intra_torch(q[:, a:b], k[:, a:b], g_cs[:, a:b], dA[:, a:b], BT)
                 for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:]) if b > a]
        return tuple(torch.cat(p, dim=1) for p in zip(*parts))
    B, T, H, K = q.shape
    acc = acc_dtype(q.dtype, g_cs.dtype, dA.dtype)
    q_BNCHK, k_BNCHK, dA_BNCHJ = (chunked(x, BT, acc) for x in (q, k, dA))
    E = intra_chunk_decays(chunked(g_cs, BT, acc), T)  # [B, N, t, j, H, K]
    W = dA_BNCHJ.permute(0, 1, 2, 4, 3)[..., None] * E  # dA[t, j] · 2^(g_t − g_j)
    dq = torch.einsum("bntjhk,bnjhk->bnthk", W, k_BNCHK)
    dk = torch.einsum("bntjhk,bnthk->bnjhk", W, q_BNCHK)
    return dq.reshape(B, -1, H, K)[:, :T], dk.reshape(B, -1, H, K)[:, :T]


if triton is not None:
    from .triton_chunks import load_rows

    @triton.jit
    def _dA_block(dA, t_rows, c0, T, bos, i_h, o_c, H: tl.constexpr, BT: tl.constexpr, CAUSAL: tl.constexpr):
        """dA[t_rows, c0 : c0 + BC] [BC, BC]; CAUSAL (a diagonal block): only j ≤ t counts."""
        m = (t_rows < T)[:, None] & ((o_c[:, None] >= o_c[None, :]) if CAUSAL else (o_c[None, :] >= 0))
        rows = (bos + t_rows) * H + i_h
        return tl.load(dA + rows[:, None] * BT + (c0 + o_c)[None, :], mask=m, other=0.)

    @triton.jit
    def dqk_sub_chunks(q, k, g, dA, dq, dk, bos, i_h, o_k, m_k, t0, T, H: tl.constexpr, K: tl.constexpr,
                    BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, SPAN: tl.constexpr):
        """One chunk (rows t0 ..., keys o_k) in 16-token sub-chunks, each through its own reference gate, or
        exact where even that would leave 2^±SPAN."""
        NC: tl.constexpr = BT // BC
        o_c = tl.arange(0, BC)
        for s in tl.static_range(NC):
            t_s = t0 + s * BC + o_c
            g_s, m_sk = load_rows(g, t_s, bos, i_h, o_k, m_k, T, H, K)
            # reference: the gate at the middle token of s (the last one when T ends before it)
            mid = tl.minimum(BC // 2, T - 1 - (t0 + s * BC))
            g_r = tl.sum(tl.where(o_c[:, None] == mid, g_s, 0.), axis=0)
            span = tl.max(tl.max(tl.where(m_sk, tl.abs(g_s - g_r[None, :]), 0.), axis=1), axis=0)
            if span <= SPAN:  # 2^(g_t − g_j) = 2^(g_t − g_r)·2^(g_r − g_j), every factor within 2^±SPAN
                acc = tl.zeros([BC, BK], dtype=tl.float32)
                for j in tl.static_range(s + 1):  # dq_t: the keys j ≤ t of this and the earlier sub-chunks
                    k_j, m_jk = load_rows(k, t0 + j * BC + o_c, bos, i_h, o_k, m_k, T, H, K)
                    g_j, _ = load_rows(g, t0 + j * BC + o_c, bos, i_h, o_k, m_k, T, H, K)
                    kg_j = tl.where(m_jk, k_j * tl.exp2(g_r[None, :] - g_j), 0.)
                    dA_sj = _dA_block(dA, t_s, j * BC, T, bos, i_h, o_c, H, BT, j == s)
                    acc = tl.dot(dA_sj, kg_j, acc, input_precision="tf32x3" if j == s else "tf32")
                b_dq = acc * tl.exp2(tl.where(m_sk, g_s - g_r[None, :], 0.))
                acc = tl.zeros([BC, BK], dtype=tl.float32)
                for u in tl.static_range(s, NC):  # dk_j: the queries t ≥ j of this and the later sub-chunks
                    t_u = t0 + u * BC + o_c
                    q_u, m_uk = load_rows(q, t_u, bos, i_h, o_k, m_k, T, H, K)
                    g_u, _ = load_rows(g, t_u, bos, i_h, o_k, m_k, T, H, K)
                    qg_u = tl.where(m_uk, q_u * tl.exp2(g_u - g_r[None, :]), 0.)
                    dA_us = _dA_block(dA, t_u, s * BC, T, bos, i_h, o_c, H, BT, u == s)
                    acc = tl.dot(tl.trans(dA_us), qg_u, acc, input_precision="tf32x3" if u == s else "tf32")
                b_dk = acc * tl.exp2(tl.where(m_sk, g_r[None, :] - g_s, 0.))
            else:  # steep gates: exact decays on the diagonal block, boundary references off it
                q_s, _ = load_rows(q, t_s, bos, i_h, o_k, m_k, T, H, K)
                k_s, _ = load_rows(k, t_s, bos, i_h, o_k, m_k, T, H, K)
                dA_ss = _dA_block(dA, t_s, s * BC, T, bos, i_h, o_c, H, BT, True)
                keep = (o_c[:, None] >= o_c[None, :]) & (t_s < T)[:, None]  # j ≤ t < T (2^(0 - g_j) past T overflows)
                E = tl.exp2(tl.where(keep[:, :, None], g_s[:, None, :] - g_s[None, :, :], float("-inf")))
                W = dA_ss[:, :, None] * E  # one [t, j, k] tile of decays for both gradients
                b_dq = tl.sum(W * k_s[None, :, :], axis=1)
                b_dk = tl.sum(W * q_s[:, None, :], axis=0)
                if s > 0:  # through the gate at s's first token
                    g_first = tl.sum(tl.where(o_c[:, None] == 0, g_s, 0.), axis=0)
                    acc = tl.zeros([BC, BK], dtype=tl.float32)
                    for j in tl.static_range(s):
                        k_j, m_jk = load_rows(k, t0 + j * BC + o_c, bos, i_h, o_k, m_k, T, H, K)
                        g_j, _ = load_rows(g, t0 + j * BC + o_c, bos, i_h, o_k, m_k, T, H, K)
                        kg_j = tl.where(m_jk, k_j * tl.exp2(g_first[None, :] - g_j), 0.)
                        acc = tl.dot(_dA_block(dA, t_s, j * BC, T, bos, i_h, o_c, H, BT, False), kg_j, acc)
                    b_dq += acc * tl.exp2(tl.where(m_sk, g_s - g_first[None, :], 0.))
                if s < NC - 1:  # through the gate at s's last token
                    last = tl.minimum(BC - 1, T - 1 - (t0 + s * BC))
                    g_last = tl.sum(tl.where(o_c[:, None] == last, g_s, 0.), axis=0)
                    acc = tl.zeros([BC, BK], dtype=tl.float32)
                    for u in tl.static_range(s + 1, NC):
                        t_u = t0 + u * BC + o_c
                        q_u, m_uk = load_rows(q, t_u, bos, i_h, o_k, m_k, T, H, K)
                        g_u, _ = load_rows(g, t_u, bos, i_h, o_k, m_k, T, H, K)
                        qg_u = tl.where(m_uk, q_u * tl.exp2(g_u - g_last[None, :]), 0.)
                        acc = tl.dot(tl.trans(_dA_block(dA, t_u, s * BC, T, bos, i_h, o_c, H, BT, False)), qg_u, acc)
                    b_dk += acc * tl.exp2(tl.where(m_sk, g_last[None, :] - g_s, 0.))
            rows_s = (bos + t_s) * H + i_h
            tl.store(dq + rows_s[:, None] * K + o_k[None, :], b_dq, mask=m_sk)
            tl.store(dk + rows_s[:, None] * K + o_k[None, :], b_dk, mask=m_sk)


__all__ = ["chunk_gla_bwd_dqk_intra_torch", "dqk_sub_chunks"]
