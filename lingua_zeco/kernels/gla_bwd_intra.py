"""The intra-chunk part of GLA's dq and dk: a Triton kernel that replaces fla's
`chunk_gla_bwd_dqk_intra` (its `chunk_gla_bwd_kernel_intra`, fla.ops.gla.chunk), beside its torch oracle.

Inside a chunk of BT tokens, with fla's chunk-local base-2 gate cumsum g and dA[t, j] = ∂L/∂A_tj
(scale included; fla's `chunk_gla_bwd_dA`):
    dq_t = Σ_{j≤t} dA_tj · k_j ⊙ 2^(g_t − g_j)          dk_j = Σ_{t≥j} dA_tj · q_t ⊙ 2^(g_t − g_j)
Why a kernel of our own: fla's is the slowest stage of chunk_gla's backward on H200 (its share of the
fwd+bwd: docs/results/README.md, "One H200: the GLA operator"). It runs one program per
16-token sub-chunk and walks the diagonal block token by token, once for dq and again for dk, each
step a strided row load and a [16, BK] exp2. Here one program takes a whole chunk for BK keys, and
each 16-token block s is a few tensor-core products through one reference gate, the gate g_r at s's
middle token: 2^(g_t − g_j) = 2^(g_t − g_r)·2^(g_r − g_j).
Off the diagonal block one factor is ≤ 1 (g falls along the chunk) and the other within s's own span;
inside it both are within 2^±span. Where the gates fall so steeply that the span passes 2^±SPAN (64:
far from fp32's 2^±126), the block takes an exact path instead (exact decays on the diagonal block as
one [BC, BC, BK] tile for dq and dk, references at the block's edges off it), so no input overflows.
Products run in fp32 (fla's choice for this stage; its comment: bf16 here loses precision): 3×TF32 on
the diagonal block, which holds the largest terms, TF32 off it as fla's off-diagonal products.
Whole chunks first: one reference gate for the whole chunk (its middle token) where the chunk's gates stay
within 2^±SPAN of it, as they do at GLA-1B's gate normalizer: dq and dk are then two [BT, BT] x [BT, BK]
products in 3×TF32 (each input tile read and each exp2 taken once, instead of once per sub-chunk pair); only
chunks with steeper gates take the sub-chunk path above.
Packed documents (B = 1) come as fla's varlen stages take them, with its chunk table: a program's chunk
is (document, chunk in document), and it reads that document's rows as one sequence of its own length.
It is faster than fla's stage on H200: docs/results/README.md, "History".
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
    from .triton_chunks import chunk_origin, load_rows

    @triton.jit
    def _dA_block(dA, t_rows, c0, T, bos, i_h, o_c, H: tl.constexpr, BT: tl.constexpr, CAUSAL: tl.constexpr):
        """dA[t_rows, c0 : c0 + BC] [BC, BC]; CAUSAL (a diagonal block): only j ≤ t counts."""
        m = (t_rows < T)[:, None] & ((o_c[:, None] >= o_c[None, :]) if CAUSAL else (o_c[None, :] >= 0))
        rows = (bos + t_rows) * H + i_h
        return tl.load(dA + rows[:, None] * BT + (c0 + o_c)[None, :], mask=m, other=0.)

    @triton.jit
    def _sub_chunks(q, k, g, dA, dq, dk, bos, i_h, o_k, m_k, t0, T, H: tl.constexpr, K: tl.constexpr,
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

    @triton.autotune(
        configs=[triton.Config({"BK": bk}, num_warps=w, num_stages=s)
                 for bk in (32, 64) for w in (2, 4, 8) for s in (1, 2)],
        key=["BT", "K", "IS_VARLEN"], cache_results=True)
    @triton.jit(do_not_specialize=["T"])
    def _dqk_intra_kernel(q, k, g, dA, dq, dk, cu_seqlens, chunk_indices, T, H: tl.constexpr, K: tl.constexpr,
                          BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, IS_VARLEN: tl.constexpr = False,
                          SPAN: tl.constexpr = 64.0):
        NK: tl.constexpr = (K + BK - 1) // BK
        i_kn, i_bh = tl.program_id(0), tl.program_id(1)  # chunks on axis 0: no 65535 limit on T
        i_k, i_n = i_kn % NK, i_kn // NK
        i_b, i_h = (i_bh // H).to(tl.int64), i_bh % H
        i_n, bos, T = chunk_origin(i_n, i_b, T, cu_seqlens, chunk_indices, IS_VARLEN)  # T: the document's if packed
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        t0 = i_n * BT
        # the whole chunk through one reference gate (its middle token), when the gates allow
        o_t = tl.arange(0, BT)
        t_c = t0 + o_t
        g_c, m_ck = load_rows(g, t_c, bos, i_h, o_k, m_k, T, H, K)
        mid = tl.minimum(BT // 2, T - 1 - t0)
        g_r = tl.sum(tl.where(o_t[:, None] == mid, g_c, 0.), axis=0)
        span = tl.max(tl.max(tl.where(m_ck, tl.abs(g_c - g_r[None, :]), 0.), axis=1), axis=0)
        if span <= SPAN:  # two [BT, BT] x [BT, BK] products, 3xTF32: the diagonal's largest terms are in them
            q_c, _ = load_rows(q, t_c, bos, i_h, o_k, m_k, T, H, K)
            k_c, _ = load_rows(k, t_c, bos, i_h, o_k, m_k, T, H, K)
            kg_c = tl.where(m_ck, k_c * tl.exp2(g_r[None, :] - g_c), 0.)
            qg_c = tl.where(m_ck, q_c * tl.exp2(g_c - g_r[None, :]), 0.)
            dA_c = _dA_block(dA, t_c, 0, T, bos, i_h, o_t, H, BT, True)
            b_dq = tl.dot(dA_c, kg_c, input_precision="tf32x3") * tl.exp2(
                tl.where(m_ck, g_c - g_r[None, :], 0.))
            b_dk = tl.dot(tl.trans(dA_c), qg_c, input_precision="tf32x3") * tl.exp2(
                tl.where(m_ck, g_r[None, :] - g_c, 0.))
            rows_c = (bos + t_c) * H + i_h
            tl.store(dq + rows_c[:, None] * K + o_k[None, :], b_dq, mask=m_ck)
            tl.store(dk + rows_c[:, None] * K + o_k[None, :], b_dk, mask=m_ck)
        else:
            _sub_chunks(q, k, g, dA, dq, dk, bos, i_h, o_k, m_k, t0, T, H, K, BT, BC, BK, SPAN)


def chunk_gla_bwd_dqk_intra(q, k, g_cs, dA, chunk_size: int, cu_seqlens=None, chunk_indices=None):
    """= fla's chunk_gla_bwd_dqk_intra(q=q, k=k, g=g_cs, dA=dA, chunk_size=chunk_size, cu_seqlens=cu_seqlens,
    chunk_indices=chunk_indices): (dq, dk) [B, T, H, K] in fp32. Packed documents (B = 1) need fla's
    chunk table [NT, 2] (document, chunk in document) as well as the boundaries: it sizes the grid,
    so nothing is read back from the GPU. A chunk whose gates stay within 2^±SPAN of its middle token's runs as
    two [BT, BT] products through that one reference, a steeper one by 16-token sub-chunks (module doc)."""
    B, T, H, K = q.shape
    if g_cs.dtype != torch.float or dA.dtype != torch.float:
        raise TypeError(f"dqk_intra: g_cs and dA must be fp32 (fla's stages give them so), "
                        f"got {g_cs.dtype}, {dA.dtype}")
    if (cu_seqlens is None) != (chunk_indices is None) or (cu_seqlens is not None and B != 1):
        raise ValueError("dqk_intra: packed documents need cu_seqlens and chunk_indices together, with B = 1; "
                         f"got B = {B}, cu_seqlens {'set' if cu_seqlens is not None else 'None'}, "
                         f"chunk_indices {'set' if chunk_indices is not None else 'None'}")
    NT = triton.cdiv(T, chunk_size) if chunk_indices is None else chunk_indices.shape[0]
    dq = torch.empty_like(q, dtype=torch.float)
    dk = torch.empty_like(k, dtype=torch.float)

    def grid(meta):
        return (triton.cdiv(K, meta["BK"]) * NT, B * H)

    _dqk_intra_kernel[grid](q, k, g_cs, dA, dq, dk, cu_seqlens, chunk_indices, T, H=H, K=K, BT=chunk_size,
                            BC=min(16, chunk_size), IS_VARLEN=cu_seqlens is not None)
    return dq, dk


__all__ = ["chunk_gla_bwd_dqk_intra", "chunk_gla_bwd_dqk_intra_torch"]
