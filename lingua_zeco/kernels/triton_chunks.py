"""Triton helpers shared by our chunk-wise GLA kernels (gla_bwd_intra.py, gla_fwd_intra.py): where a program's
chunk lies (dense [B, T] or fla's packed-document layout) and the loading of its rows."""
from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: nothing here is needed
    triton = None

if triton is not None:
    @triton.jit
    def chunk_origin(i_n, i_b, T, cu_seqlens, chunk_indices, IS_VARLEN: tl.constexpr):
        """(the chunk's index inside its sequence, the sequence's first row, its length) for the program's chunk
        i_n of row i_b; packed documents (B = 1): fla's chunk table gives the document and the place in it."""
        if IS_VARLEN:
            i_d = tl.load(chunk_indices + i_n * 2).to(tl.int32)
            i_n = tl.load(chunk_indices + i_n * 2 + 1).to(tl.int32)
            bos = tl.load(cu_seqlens + i_d).to(tl.int64)
            T = (tl.load(cu_seqlens + i_d + 1).to(tl.int64) - bos).to(tl.int32)
        else:
            bos = i_b * T
        return i_n, bos, T

    @triton.jit
    def load_rows(x, t_x, bos, i_h, o_k, m_k, T, H: tl.constexpr, K: tl.constexpr):
        """Rows t_x of x [B·T, H, K] (the sequence starting at row bos, T long) for keys o_k, in fp32, zero past
        T and outside m_k; and that mask."""
        m = (t_x < T)[:, None] & m_k[None, :]
        rows = (bos + t_x) * H + i_h  # int64
        return tl.load(x + rows[:, None] * K + o_k[None, :], mask=m, other=0.).to(tl.float32), m

__all__ = ["chunk_origin", "load_rows"]
