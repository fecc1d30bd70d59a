"""The three stages ZeCO adds to fla's chunk_gla, each a Triton kernel beside its torch oracle.

fla keeps, per chunk of BT tokens, the gate cumsum *local to the chunk* in base 2 (`g_cs`, fla's
`chunk_local_cumsum(g, BT, scale=log2 e)`) and the state entering chunk n, h_n [B, NT, H, K, V].
ZeCO runs a rank's slice from a zero state (so its final state is ready for the All-Scan early)
and lets the true incoming state S_in and the gradient arriving from the next rank enter through
stages that read the same data anyway, so no pass rewrites all chunk states:

* `chunk_decay_prefix`  Gx [B, NT, H, K]: base-2 gate sum from the slice start to the start of
                        chunk n (exclusive), and b_end [B, H, K] = 2^(sum over the slice) for the scan.
* `zeco_fwd_o`          replaces fla's `chunk_gla_fwd_o_gk`: the same output stage with S_in folded
                        into each chunk's state in registers:
                        o_t = scale·(q_t ⊙ 2^g_cs_t)·(h_n + diag(2^Gx_n)·S_in) + Σ_{j≤t in chunk} A_tj v_j;
                        with store_h it also writes those true states back into h (kept for a backward
                        that does not recompute them: one more write of h, no second read)
* `zeco_dS_in`          D = ∂L/∂S_in from this slice's outputs, scale·Σ_t (q_t ⊙ b_t)ᵀ do_t with
                        b_t = 2^(Gx_n + g_cs_t): one read of q, g_cs, do, before dh is computed, so that
                        fla's dh stage can then run once with the final-state gradient G from the
                        reverse All-Scan (no fold of G into dh afterwards).
Indices are int64 wherever a product can pass 2^31 (1M tokens × H = 16 × K = 128 already does).
"""
from __future__ import annotations

import math

import torch

from .common import acc_dtype

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the oracles still work
    triton = None

LOG2E = 1.0 / math.log(2.0)


def fla_chunk_size(T: int) -> int:
    """fla chunk_gla's rule for its chunk size (ChunkGLAFunction): 64, smaller for short sequences."""
    return min(64, max(16, 1 << max(0, (T - 1).bit_length())))


# ----------------------------------------------------------------------------------- oracles
def chunk_local_cumsum_torch(g_BTHK, BT):
    """fla's chunk-local, base-2 cumsum of the log gates (fp32, at least the input's precision)."""
    B, T, H, K = g_BTHK.shape
    acc = acc_dtype(g_BTHK.dtype)
    pad = (-T) % BT
    g = torch.nn.functional.pad(g_BTHK.to(acc), (0, 0, 0, 0, 0, pad))
    return (g.view(B, -1, BT, H, K).cumsum(2) * LOG2E).view(B, -1, H, K)[:, :T].contiguous()


def chunk_decay_prefix_torch(g_cs_BTHK, BT):
    """(Gx [B, NT, H, K], b_end [B, H, K]) from the chunk-local base-2 cumsum."""
    T = g_cs_BTHK.shape[1]
    ends = torch.arange(BT - 1, T + BT - 1, BT, device=g_cs_BTHK.device).clamp_(max=T - 1)
    tot_BNHK = g_cs_BTHK[:, ends]
    incl_BNHK = tot_BNHK.cumsum(1)
    return incl_BNHK - tot_BNHK, torch.exp2(incl_BNHK[:, -1])


def _chunk_index(T, BT, device):
    return torch.arange(T, device=device) // BT


def zeco_fwd_o_torch(q, v, g_cs, A, h, fold, scale):
    """Oracle of `zeco_fwd_o` (computes in at least fp32). A [B, T, H, BT] as fla's intra stage gives it
    (row t, column j of t's chunk); h [B, NT, H, K, V] from a zero state; fold = (S_in [B, H, K, V], Gx)."""
    S_in, Gx = fold
    B, T, H, K = q.shape
    BT = A.shape[-1]
    acc = acc_dtype(q.dtype)
    n_T = _chunk_index(T, BT, q.device)
    h_true = _fold(h, S_in, Gx, acc)
    qg = q.to(acc) * torch.exp2(g_cs.to(acc))
    o = scale * torch.einsum("bthk,bthkv->bthv", qg, h_true[:, n_T])
    col_T = torch.arange(T, device=q.device) % BT
    causal = col_T[:, None] >= torch.arange(BT, device=q.device)[None, :]  # [T, BT]
    A = A.to(acc).masked_fill(~causal[None, :, None, :], 0)
    v_pad = torch.nn.functional.pad(v.to(acc), (0, 0, 0, 0, 0, (-T) % BT)).view(B, -1, BT, H, v.shape[-1])
    o = o + torch.einsum("bthj,btjhv->bthv", A, v_pad[:, n_T])
    return o.to(v.dtype)


def _fold(h, S_in, Gx, acc):
    return h.to(acc) + torch.exp2(Gx.to(acc))[..., None] * S_in.to(acc)[:, None]


def fold_S_in_torch(h, S_in, Gx):
    """Oracle of the states `zeco_fwd_o(store_h=True)` leaves in h: h + diag(2^Gx_n)·S_in for every chunk n, in
    h's dtype (computed in at least fp32)."""
    return _fold(h, S_in, Gx, acc_dtype(h.dtype)).to(h.dtype)


def zeco_dS_in_torch(q, g_cs, Gx, do, scale, BT):
    """Oracle of `zeco_dS_in`: scale·Σ_t (q_t ⊙ 2^(Gx_n + g_cs_t))ᵀ do_t, [B, H, K, V] in at least fp32."""
    acc = acc_dtype(q.dtype)
    b = torch.exp2(Gx.to(acc)[:, _chunk_index(q.shape[1], BT, q.device)] + g_cs.to(acc))
    return scale * torch.einsum("bthk,bthv->bhkv", q.to(acc) * b, do.to(acc))


# ----------------------------------------------------------------------------------- Triton
if triton is not None:
    @triton.jit(do_not_specialize=["T", "NT"])
    def _decay_prefix_kernel(g_cs, gx, b_end, T, NT, H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr,
                             BK: tl.constexpr, BN: tl.constexpr):
        i_k, i_bh = tl.program_id(0), tl.program_id(1)
        i_b, i_h = (i_bh // H).to(tl.int64), i_bh % H
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        carry = tl.zeros([BK], dtype=tl.float32)
        for i0 in range(0, NT, BN):  # BN chunk ends at a time: a short scan in registers, carried over
            o_n = i0 + tl.arange(0, BN)
            m = (o_n < NT)[:, None] & m_k[None, :]
            t_end = tl.minimum(o_n * BT + BT - 1, T - 1).to(tl.int64)
            tot = tl.load(g_cs + ((i_b * T + t_end) * H + i_h)[:, None] * K + o_k[None, :], mask=m, other=0.)
            excl = tl.cumsum(tot, axis=0) - tot + carry[None, :]
            tl.store(gx + ((i_b * NT + o_n.to(tl.int64)) * H + i_h)[:, None] * K + o_k[None, :], excl, mask=m)
            carry += tl.sum(tot, axis=0)
        tl.store(b_end + (i_b * H + i_h) * K + o_k, tl.exp2(carry), mask=m_k)

    @triton.autotune(
        configs=[triton.Config({"BK": bk, "BV": bv}, num_warps=w, num_stages=s)
                 for bk in (32, 64) for bv in (64, 128) for w in (2, 4, 8) for s in (2, 3, 4)],
        # STORE_H writes h in place: the autotuner restores it between its trial runs
        key=["BT", "K", "V", "STORE_H"], restore_value=["h"], cache_results=True)
    @triton.jit(do_not_specialize=["T"])
    def _fwd_o_kernel(q, v, g, A, h, s_in, gx, o, scale, T, H: tl.constexpr, K: tl.constexpr,
                      V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                      STORE_H: tl.constexpr):
        # one program per (V block, chunk, sequence·head): each [K, BV] slice of a chunk's state is read (and,
        # with STORE_H, written back with S_in folded in) by exactly one program
        i_v, i_n, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        i_b, i_h = (i_bh // H).to(tl.int64), i_bh % H
        NT = tl.cdiv(T, BT)
        o_i = tl.arange(0, BT)
        o_t = i_n * BT + o_i
        m_t = o_t < T
        row = (i_b * T + o_t.to(tl.int64)) * H + i_h        # [BT] rows of q, g, v, o, A
        hrow = (i_b * NT + i_n) * H + i_h                    # this chunk's state in h and Gx
        srow = i_b * H + i_h                                 # S_in of this sequence and head
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        acc = tl.zeros([BT, BV], dtype=tl.float32)
        for i_k in range(tl.cdiv(K, BK)):
            o_k = i_k * BK + tl.arange(0, BK)
            m_k = o_k < K
            m_tk = m_t[:, None] & m_k[None, :]
            m_kv = m_k[:, None] & m_v[None, :]
            b_q = tl.load(q + row[:, None] * K + o_k[None, :], mask=m_tk, other=0.)
            b_g = tl.load(g + row[:, None] * K + o_k[None, :], mask=m_tk, other=0.).to(tl.float32)
            b_qg = (b_q * tl.exp2(b_g)).to(b_q.dtype)
            p_h = h + (hrow * K + o_k[:, None]) * V + o_v[None, :]
            b_h = tl.load(p_h, mask=m_kv, other=0.).to(tl.float32)
            b_s = tl.load(s_in + (srow * K + o_k[:, None]) * V + o_v[None, :], mask=m_kv, other=0.).to(tl.float32)
            b_gx = tl.load(gx + hrow * K + o_k, mask=m_k, other=0.)
            b_h += tl.exp2(b_gx)[:, None] * b_s              # the true state entering this chunk
            if STORE_H:  # kept for the backward: the value this chunk's output used, in h's dtype
                tl.store(p_h, b_h.to(h.dtype.element_ty), mask=m_kv)
            acc = tl.dot(b_qg, b_h.to(b_q.dtype), acc)
        acc *= scale
        b_A = tl.load(A + row[:, None] * BT + o_i[None, :], mask=m_t[:, None], other=0.)
        b_A = tl.where(o_i[:, None] >= o_i[None, :], b_A, 0.)
        b_v = tl.load(v + row[:, None] * V + o_v[None, :], mask=m_t[:, None] & m_v[None, :], other=0.)
        acc = tl.dot(b_A.to(b_v.dtype), b_v, acc)
        tl.store(o + row[:, None] * V + o_v[None, :], acc.to(o.dtype.element_ty), mask=m_t[:, None] & m_v[None, :])

    @triton.autotune(
        # the four fastest of 32 candidates at 16K and 32K on H200 (bench_stages' per_config_us): a short
        # list, so that the autotuner's noisy pick cannot land far off the best (docs/results/README.md,
        # "History")
        configs=[triton.Config({"BK": 64, "BV": 128, "CPI": c, "HF": hf}, num_warps=4, num_stages=s)
                 for c, s in ((1, 3), (2, 2)) for hf in (0, 1)],
        key=["BT", "K", "V", "RAW"], cache_results=True)
    @triton.jit(do_not_specialize=["T", "NT", "CPS"])
    def _dS_in_kernel(q, g_cs, gx, do, dp, scale, T, NT, CPS, B, H: tl.constexpr, K: tl.constexpr,
                      V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, CPI: tl.constexpr,
                      HF: tl.constexpr, RAW: tl.constexpr):
        # CPI chunks per iteration: larger loads in flight per program; each chunk's Gx row is broadcast
        # over its BT tokens by a reshape, not gathered per token. HF (heads fastest in the launch
        # order): programs running together read all heads of the same tokens, i.e. whole rows of
        # [B, T, H, K] in DRAM, instead of 128-256 B pieces of rows far apart. RAW: `g_cs` holds the raw
        # 16-bit log gates and the chunk-local base-2 cumsum is made here, as one product with a
        # lower-triangular 0/1 matrix (exact products, fp32 sums): half the bytes of reading fla's fp32
        # cumsum, and the backward can start the scan before that cumsum exists.
        if HF:
            i_bh, i_s, i_kv = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        else:
            i_kv, i_s, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        i_k, i_v = i_kv // tl.cdiv(V, BV), i_kv % tl.cdiv(V, BV)
        i_b, i_h = (i_bh // H).to(tl.int64), i_bh % H
        o_k = i_k * BK + tl.arange(0, BK)
        o_v = i_v * BV + tl.arange(0, BV)
        m_k, m_v = o_k < K, o_v < V
        n_end = tl.minimum(i_s * CPS + CPS, NT)                 # this program's run of chunks ends here
        t_end = tl.minimum(n_end * BT, T)
        acc = tl.zeros([BK, BV], dtype=tl.float32)
        o_r = tl.arange(0, CPI * BT)
        tri = ((o_r[:, None] >= o_r[None, :]) & (o_r[:, None] // BT == o_r[None, :] // BT)).to(q.dtype.element_ty)
        for i_n in range(i_s * CPS, n_end, CPI):
            o_c = i_n + tl.arange(0, CPI)
            o_t = i_n * BT + tl.arange(0, CPI * BT)
            m_t = o_t < t_end
            row = (i_b * T + o_t.to(tl.int64)) * H + i_h
            m_tk = m_t[:, None] & m_k[None, :]
            b_q = tl.load(q + row[:, None] * K + o_k[None, :], mask=m_tk, other=0.)
            b_g = tl.load(g_cs + row[:, None] * K + o_k[None, :], mask=m_tk, other=0.)
            if RAW:
                b_g = tl.dot(tri, b_g) * 1.4426950408889634  # per-chunk cumsum, to base 2 (× LOG2E)
            b_gx = tl.load(gx + ((i_b * NT + o_c) * H + i_h)[:, None] * K + o_k[None, :],
                           mask=(o_c < n_end)[:, None] & m_k[None, :], other=0.)
            b_gx = tl.reshape(tl.broadcast_to(b_gx[:, None, :], (CPI, BT, BK)), (CPI * BT, BK))
            b_qb = (b_q * tl.exp2(b_g + b_gx)).to(b_q.dtype)
            b_do = tl.load(do + row[:, None] * V + o_v[None, :], mask=m_t[:, None] & m_v[None, :], other=0.)
            acc = tl.dot(tl.trans(b_qb), b_do, acc)
        p = dp + (((i_s * B + i_b) * H + i_h) * K + o_k[:, None]) * V + o_v[None, :]
        tl.store(p, acc * scale, mask=m_k[:, None] & m_v[None, :])


def _cuda(*ts):
    """True when the Triton kernels run: CUDA tensors, contiguous (the kernels index them densely)."""
    if triton is None or not all(t.is_cuda for t in ts):
        return False
    if not all(t.is_contiguous() for t in ts):
        raise ValueError("zeco_stages: the Triton stages index their inputs densely; pass contiguous tensors")
    return True


def chunk_decay_prefix(g_cs_BTHK, BT):
    """(Gx [B, NT, H, K] fp32, b_end [B, H, K] fp32) from fla's chunk-local base-2 cumsum. One launch."""
    if not _cuda(g_cs_BTHK):
        return chunk_decay_prefix_torch(g_cs_BTHK, BT)
    B, T, H, K = g_cs_BTHK.shape
    NT = triton.cdiv(T, BT)
    gx = g_cs_BTHK.new_empty(B, NT, H, K, dtype=torch.float32)
    b_end = g_cs_BTHK.new_empty(B, H, K, dtype=torch.float32)
    BK = min(32, triton.next_power_of_2(K))
    _decay_prefix_kernel[(triton.cdiv(K, BK), B * H)](g_cs_BTHK, gx, b_end, T, NT, H=H, K=K, BT=BT, BK=BK, BN=64)
    return gx, b_end


def zeco_fwd_o(q, v, g_cs, A, h, fold, scale, store_h: bool = False):
    """fla's output stage (chunk_gla_fwd_o_gk) with the incoming state folded into each chunk's state:
    fold = (S_in [B, H, K, V], Gx [B, NT, H, K] from chunk_decay_prefix); the chunk size is A's last dimension.
    S_in is read by every chunk (from L2): pass it in h's dtype (bf16 halves that traffic; h itself is bf16).
    store_h: h [B, NT, H, K, V] (the chunk states from a zero state) is overwritten with the states from S_in,
    in h's dtype, as the output used them (the backward then reads them instead of recomputing)."""
    S_in, Gx = fold
    BT = A.shape[-1]
    if not _cuda(q, v, g_cs, A, h, S_in, Gx):
        o = zeco_fwd_o_torch(q, v, g_cs, A, h, fold, scale)
        if store_h:
            h.copy_(fold_S_in_torch(h, S_in, Gx))
        return o
    B, T, H, K = q.shape
    V = v.shape[-1]
    o = torch.empty_like(v)

    def grid(meta):
        return triton.cdiv(V, meta["BV"]), triton.cdiv(T, BT), B * H
    _fwd_o_kernel[grid](q, v, g_cs, A, h, S_in, Gx, o, scale, T, H=H, K=K, V=V, BT=BT, STORE_H=store_h)
    return o


def dS_in_reads_raw_gates(q, g) -> bool:
    """True when zeco_dS_in makes the gates' cumsum itself (16-bit gates in q's dtype, on CUDA)."""
    return g.is_cuda and triton is not None and g.dtype in (torch.bfloat16, torch.float16) and g.dtype == q.dtype


def zeco_dS_in(q, g_cs, Gx, do, scale, BT, runs: int = 264, g=None):
    """D = ∂L/∂S_in of this slice's outputs, [B, H, K, V] fp32 (fp64 from fp64 inputs). The chunks are
    split into runs so that about `runs` (sequence, head, run) programs fill the GPU (times the K×V tiles
    the autotuner picks); each run's partial sum is written, and the partials summed. With the raw gates
    `g` in 16 bits, the kernel reads them instead of `g_cs` (which may then be None)."""
    raw = g is not None and dS_in_reads_raw_gates(q, g)
    if not _cuda(q, g if raw else g_cs, Gx, do):
        g_cs = chunk_local_cumsum_torch(g, BT) if g_cs is None else g_cs
        return zeco_dS_in_torch(q, g_cs, Gx, do, scale, BT)  # fp32 (fp64 for the exactness checks)
    B, T, H, K, V = *q.shape, do.shape[-1]
    NT, CPS, NS, dp, grid = _dS_in_plan(q, do, BT, runs)
    _dS_in_kernel[grid](q, g if raw else g_cs, Gx, do, dp, scale, T, NT, CPS, B, H=H, K=K, V=V, BT=BT, RAW=raw)
    return dp[0] if NS == 1 else dp.sum(0)


def _dS_in_plan(q, do, BT, runs):
    """(chunks NT, chunks per run CPS, runs NS, the partial sums [NS, B, H, K, V] fp32, the launch grid)."""
    B, T, H, K, V = *q.shape, do.shape[-1]
    NT = triton.cdiv(T, BT)
    CPS = triton.cdiv(NT, max(1, min(NT, triton.cdiv(runs, B * H))))  # chunks per run
    NS = triton.cdiv(NT, CPS)

    def grid(meta):
        tiles = triton.cdiv(K, meta["BK"]) * triton.cdiv(V, meta["BV"])
        return (B * H, NS, tiles) if meta["HF"] else (tiles, NS, B * H)
    return NT, CPS, NS, q.new_empty(NS, B, H, K, V, dtype=torch.float32), grid


def dS_in_candidates(q, g, Gx, do, scale, BT, runs: int = 264) -> dict:
    """{autotune config: a call of zeco_dS_in's kernel with that config alone, on the raw 16-bit gates
    `g`, partial sums only}: every candidate timed apart (apps/gla/bench/bench_stages.py)."""
    B, T, H, K, V = *q.shape, do.shape[-1]
    NT, CPS, _, dp, grid = _dS_in_plan(q, do, BT, runs)
    kws = {str(c): dict(c.kwargs, num_warps=c.num_warps, num_stages=c.num_stages) for c in _dS_in_kernel.configs}
    return {name: (lambda kw=kw: _dS_in_kernel.fn[grid(kw)](q, g, Gx, do, dp, scale, T, NT, CPS, B, H=H, K=K, V=V,
                                                            BT=BT, RAW=True, **kw)) for name, kw in kws.items()}


def dS_in_best_config() -> str:
    """The autotuner's pick for zeco_dS_in's kernel at the last shape it tuned."""
    return str(_dS_in_kernel.best_config)


__all__ = ["chunk_decay_prefix", "chunk_decay_prefix_torch", "chunk_local_cumsum_torch", "dS_in_best_config",
           "dS_in_candidates", "dS_in_reads_raw_gates", "fold_S_in_torch", "fla_chunk_size", "zeco_dS_in",
           "zeco_dS_in_torch", "zeco_fwd_o", "zeco_fwd_o_torch"]
