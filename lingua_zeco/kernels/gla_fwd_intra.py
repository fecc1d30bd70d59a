"""The intra-chunk attention of GLA's forward, A: a Triton kernel that replaces fla's
`chunk_gla_fwd_intra_gk` (its kernels `chunk_gla_fwd_A_kernel_intra_sub_inter` and `..._sub_intra`,
fla.ops.gla.chunk), beside its torch oracle.

Inside a chunk of BT tokens, with fla's chunk-local base-2 gate cumsum g:
    A[t, j] = scale · Σ_k q_tk k_jk 2^(g_tk − g_jk)   for j ≤ t in t's chunk, 0 above the diagonal
Why a kernel of our own: fla computes A by 16×16 blocks, one program per block pair (half of them
return at once) and the diagonal blocks token by token; at 16K tokens those two kernels are 0.37 ms of
the operator's 3.1 ms and run at 27-60 % of their memory bound (docs/results/README.md, the
operator's kernels). Here one program takes a whole chunk: where every gate of the chunk stays within 2^±SPAN of
its middle token's (g_r), A = (q ⊙ 2^(g − g_r)) (k ⊙ 2^(g_r − g))ᵀ over the key blocks, 3×TF32; a
steeper chunk takes fla's scheme instead (the blocks below the diagonal through the gate at the first
token of their row block, where both factors are ≤ 1; the diagonal blocks exact, as [BC, BC, BK] tiles).
Packed documents (B = 1) with fla's chunk table, as kernels/gla_bwd_intra.py takes them.
"""
from __future__ import annotations

import torch

from .common import acc_dtype, chunked, intra_chunk_decays

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the oracle still works
    triton = None


def chunk_gla_fwd_A_torch(q, k, g_cs, scale: float, BT: int, cu_seqlens=None):
    """Oracle: A [B, T, H, BT] in at least fp32 from q, k and the chunk-local base-2 cumsum g_cs [B, T, H, K];
    row t, column j − (t's chunk start); zero above the diagonal. cu_seqlens (host ints, B = 1): packed
    documents, each chunked from its own start."""
    if cu_seqlens is not None:
        parts = [chunk_gla_fwd_A_torch(q[:, a:b], k[:, a:b], g_cs[:, a:b], scale, BT)
                 for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:]) if b > a]
        return torch.cat(parts, dim=1)
    B, T, H, K = q.shape
    acc = acc_dtype(q.dtype, g_cs.dtype)
    q_BNCHK, k_BNCHK = chunked(q, BT, acc), chunked(k, BT, acc)
    E = intra_chunk_decays(chunked(g_cs, BT, acc), T)  # [B, N, t, j, H, K]
    A = scale * torch.einsum("bnthk,bnjhk,bntjhk->bnthj", q_BNCHK, k_BNCHK, E)
    return A.reshape(B, -1, H, BT)[:, :T]


if triton is not None:
    from .triton_chunks import chunk_origin, load_rows

    @triton.jit
    def _blocks(q, k, g, A, bos, i_h, t0, T, scale, H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr,
                BC: tl.constexpr, BK: tl.constexpr):
        """A of one chunk by [BC, BC] blocks (fla's scheme: safe for any gates): below the diagonal through the
        gate at the first token of the row block, on it exact, above it zero."""
        NC: tl.constexpr = BT // BC
        o_c = tl.arange(0, BC)
        for i in tl.static_range(NC):
            t_i = t0 + i * BC + o_c
            rows_i = (bos + t_i) * H + i_h
            for j in tl.static_range(NC):
                b_A = tl.zeros([BC, BC], dtype=tl.float32)
                if j <= i:
                    t_j = t0 + j * BC + o_c
                    for i_k in range(tl.cdiv(K, BK)):
                        o_k = i_k * BK + tl.arange(0, BK)
                        m_k = o_k < K
                        q_i, m_ik = load_rows(q, t_i, bos, i_h, o_k, m_k, T, H, K)
                        g_i, _ = load_rows(g, t_i, bos, i_h, o_k, m_k, T, H, K)
                        k_j, m_jk = load_rows(k, t_j, bos, i_h, o_k, m_k, T, H, K)
                        g_j, _ = load_rows(g, t_j, bos, i_h, o_k, m_k, T, H, K)
                        if j < i:  # t after every j: 2^(g_t − g_n) ≤ 1 and 2^(g_n − g_j) ≤ 1
                            g_n = tl.sum(tl.where(o_c[:, None] == 0, g_i, 0.), axis=0)
                            qg = tl.where(m_ik, q_i * tl.exp2(g_i - g_n[None, :]), 0.)
                            kg = tl.where(m_jk, k_j * tl.exp2(g_n[None, :] - g_j), 0.)
                            b_A = tl.dot(qg, tl.trans(kg), b_A, input_precision="tf32x3")
                        else:  # the diagonal block: exact decays, j ≤ t < T (2^(g_t − g_j) past T overflows)
                            keep = (o_c[:, None] >= o_c[None, :]) & (t_i < T)[:, None]
                            E = tl.exp2(tl.where(keep[:, :, None], g_i[:, None, :] - g_j[None, :, :], float("-inf")))
                            b_A += tl.sum(q_i[:, None, :] * k_j[None, :, :] * E, axis=2)
                tl.store(A + rows_i[:, None] * BT + (j * BC + o_c)[None, :], b_A * scale, mask=(t_i < T)[:, None])

    @triton.autotune(
        configs=[triton.Config({"BK": bk}, num_warps=w, num_stages=s)
                 for bk in (32, 64) for w in (4, 8) for s in (1, 2)],
        key=["BT", "K", "IS_VARLEN"], cache_results=True)
    @triton.jit(do_not_specialize=["T"])
    def _fwd_A_kernel(q, k, g, A, cu_seqlens, chunk_indices, scale, T, H: tl.constexpr, K: tl.constexpr,
                      BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, IS_VARLEN: tl.constexpr = False,
                      SPAN: tl.constexpr = 64.0):
        i_n, i_bh = tl.program_id(0), tl.program_id(1)  # chunks on axis 0: no 65535 limit on T
        i_b, i_h = (i_bh // H).to(tl.int64), i_bh % H
        i_n, bos, T = chunk_origin(i_n, i_b, T, cu_seqlens, chunk_indices, IS_VARLEN)  # T: the document's if packed
        t0 = i_n * BT
        o_t = tl.arange(0, BT)
        t_c = t0 + o_t
        mid = tl.minimum(BT // 2, T - 1 - t0)  # the middle token, or the last one of a short last chunk
        # one pass over the key blocks: the products through the reference gate, and how far the chunk's gates reach
        # from it; past 2^±SPAN the products may have overflowed and the chunk is redone by blocks (rare)
        span = tl.zeros([], dtype=tl.float32)
        b_A = tl.zeros([BT, BT], dtype=tl.float32)
        for i_k in range(tl.cdiv(K, BK)):
            o_k = i_k * BK + tl.arange(0, BK)
            m_k = o_k < K
            g_c, m_ck = load_rows(g, t_c, bos, i_h, o_k, m_k, T, H, K)
            q_c, _ = load_rows(q, t_c, bos, i_h, o_k, m_k, T, H, K)
            k_c, _ = load_rows(k, t_c, bos, i_h, o_k, m_k, T, H, K)
            g_r = tl.sum(tl.where(o_t[:, None] == mid, g_c, 0.), axis=0)
            span = tl.maximum(span, tl.max(tl.max(tl.where(m_ck, tl.abs(g_c - g_r[None, :]), 0.), axis=1), axis=0))
            qg = tl.where(m_ck, q_c * tl.exp2(g_c - g_r[None, :]), 0.)
            kg = tl.where(m_ck, k_c * tl.exp2(g_r[None, :] - g_c), 0.)
            b_A = tl.dot(qg, tl.trans(kg), b_A, input_precision="tf32x3")
        if span <= SPAN:
            rows = (bos + t_c) * H + i_h
            keep = o_t[:, None] >= o_t[None, :]
            tl.store(A + rows[:, None] * BT + o_t[None, :], tl.where(keep, b_A * scale, 0.), mask=(t_c < T)[:, None])
        else:
            _blocks(q, k, g, A, bos, i_h, t0, T, scale, H, K, BT, BC, BK)


def chunk_gla_fwd_A(q, k, g_cs, scale: float, chunk_size: int, cu_seqlens=None, chunk_indices=None):
    """= fla's chunk_gla_fwd_intra_gk(q=q, k=k, g=g_cs, scale=scale, chunk_size=chunk_size, cu_seqlens=cu_seqlens,
    chunk_indices=chunk_indices): A [B, T, H, BT] fp32 (zero above the diagonal, which fla leaves unwritten and
    no later stage reads). Packed documents (B = 1) need fla's chunk table [NT, 2] with the boundaries."""
    B, T, H, K = q.shape
    if g_cs.dtype != torch.float:
        raise TypeError(f"fwd_A: g_cs must be fp32 (fla's cumsum gives it so), got {g_cs.dtype}")
    if (cu_seqlens is None) != (chunk_indices is None) or (cu_seqlens is not None and B != 1):
        raise ValueError("fwd_A: packed documents need cu_seqlens and chunk_indices together, with B = 1; "
                         f"got B = {B}, cu_seqlens {'set' if cu_seqlens is not None else 'None'}, "
                         f"chunk_indices {'set' if chunk_indices is not None else 'None'}")
    NT = triton.cdiv(T, chunk_size) if chunk_indices is None else chunk_indices.shape[0]
    A = q.new_empty(B, T, H, chunk_size, dtype=torch.float)
    _fwd_A_kernel[(NT, B * H)](q, k, g_cs, A, cu_seqlens, chunk_indices, scale, T, H=H, K=K, BT=chunk_size,
                               BC=min(16, chunk_size), IS_VARLEN=cu_seqlens is not None)
    return A


__all__ = ["chunk_gla_fwd_A", "chunk_gla_fwd_A_torch"]
