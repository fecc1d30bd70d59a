"""Fold an incoming state into per-chunk states: h[b, n, h] += diag(decay[b, n, h]) · S[b, h].

ZeCO's fused path computes fla's chunk states from a zero state (so the local final state is ready
early for the All-Scan) and adds the true incoming state afterwards. The same pass folds the
gradient arriving from the next rank into dh in the backward. One read and one write of h: it is
memory-bound, so a Triton kernel does it in one pass; `fold_state_torch_` is its oracle.
"""
from __future__ import annotations


try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None


def fold_state_torch_(h_BNHKV, decay_BNHK, S_BHKV):
    h_BNHKV.add_((decay_BNHK[..., None] * S_BHKV[:, None]).to(h_BNHKV.dtype))
    return h_BNHKV


if triton is not None:
    @triton.jit
    def _fold_kernel(h, d, s, NT, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                     BK: tl.constexpr, BV: tl.constexpr):
        i_v, i_n, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        i_b, i_h = i_bh // H, i_bh % H
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        row = (i_b * NT + i_n) * H + i_h          # index of [b, n, h] in h and decay
        for i_k in range(0, tl.cdiv(K, BK)):
            o_k = i_k * BK + tl.arange(0, BK)
            m_k = o_k < K
            m = m_k[:, None] & m_v[None, :]
            dec = tl.load(d + row * K + o_k, mask=m_k, other=0.)
            sv = tl.load(s + ((i_b * H + i_h) * K + o_k[:, None]) * V + o_v[None, :], mask=m, other=0.)
            p = h + (row * K + o_k[:, None]) * V + o_v[None, :]
            acc = tl.load(p, mask=m, other=0.).to(tl.float32) + dec[:, None] * sv
            tl.store(p, acc.to(p.dtype.element_ty), mask=m)


def fold_state_(h_BNHKV, decay_BNHK, S_BHKV):
    """In place; h in any float dtype, decay and S in fp32. Triton on CUDA, torch elsewhere."""
    if triton is None or not h_BNHKV.is_cuda:
        return fold_state_torch_(h_BNHKV, decay_BNHK, S_BHKV)
    B, NT, H, K, V = h_BNHKV.shape
    assert h_BNHKV.is_contiguous() and decay_BNHK.shape == (B, NT, H, K) and S_BHKV.shape == (B, H, K, V)
    BK = min(64, triton.next_power_of_2(K))
    BV = min(128, triton.next_power_of_2(V))
    grid = (triton.cdiv(V, BV), NT, B * H)
    _fold_kernel[grid](h_BNHKV, decay_BNHK.contiguous(), S_BHKV.contiguous(), NT, H=H, K=K, V=V, BK=BK, BV=BV)
    return h_BNHKV
