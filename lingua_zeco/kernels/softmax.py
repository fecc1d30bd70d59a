"""Causal softmax attention of a query block against a key/value block, beside its float64 oracle.

Layout [B, T, H, D] (as fla). The blocks carry their global offsets: the query at global position i sees
the key at global position j when

    j ≤ i  (causal),   i − window < j  (sliding window, optional),   doc(i) = doc(j)  (packed documents),

so one call serves a whole sequence (P = 1), an all-gathered prefix (allgather) or one visiting block of
a ring. A query row that sees no key gives o = 0 and lse = −inf, never NaN.

`attention(...) -> (o, lse | None)` picks a backend:
* "sdpa"      torch.nn.functional.scaled_dot_product_attention (CUDA: flash / cuDNN / efficient; CPU:
              its own kernels). is_causal when the blocks line up, causal_lower_right when the keys end
              with the queries (allgather), a boolean mask otherwise. Returns no lse.
* "xformers"  xformers.ops.memory_efficient_attention, only once a probe has run its CUDA kernels
              (never on CPU). Returns no lse.
* "auto"      xformers where it is usable and sdpa could not use its flash kernel (a window or
              documents make sdpa fall back to a materialised mask), sdpa otherwise.
* "naive"     the oracle: explicit scores and softmax in float64, returns (o, lse) in float64.
The ring of lingua_zeco/sp/softmax.py merges partial results by their log-sum-exp, so it takes the explicit
path in the accumulation dtype (fp32, fp64 for fp64 inputs; explicit_forward / explicit_backward, queries in
row chunks so the scores stay [B, H, q_chunk, S]): SDPA does not return the lse and its CUDA-only siblings
that do (aten._scaled_dot_product_efficient_attention with compute_log_sumexp) cannot be verified on the CPU
suite.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from .common import acc_dtype, doc_ids

BACKENDS = ("auto", "sdpa", "xformers", "naive")
Q_CHUNK = 1024  # query rows per explicit block: bounds the materialised scores


def check_backend(backend: str, where: str = "attention") -> None:
    if backend not in BACKENDS:
        raise ValueError(f"{where}: softmax attention backend must be one of {BACKENDS}, got {backend!r}")


@functools.lru_cache(maxsize=None)
def xformers_available() -> tuple[bool, str]:
    """(usable, why not): import xformers and run its memory-efficient kernel once on a tiny CUDA input.
    A CPU-only torch, a missing wheel or kernels built for another torch/CUDA all end here."""
    if not torch.cuda.is_available():
        return False, "xformers needs CUDA (this torch sees no GPU)"
    try:
        import xformers.ops as xops
        x = torch.zeros(1, 8, 1, 16, device="cuda", dtype=torch.float16)
        xops.memory_efficient_attention(x, x, x)
        torch.cuda.synchronize()
    except Exception as e:  # ImportError, NotImplementedError (no operator), CUDA errors
        return False, f"xformers unusable: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return True, ""


def visible_mask(q_start: int, T_q: int, k_start: int, T_k: int, device, window: int | None = None,
                 doc_q_T: torch.Tensor | None = None, doc_k_S: torch.Tensor | None = None) -> torch.Tensor:
    """[T_q, T_k] bool, True where the query sees the key."""
    i_T1 = torch.arange(q_start, q_start + T_q, device=device)[:, None]
    j_1S = torch.arange(k_start, k_start + T_k, device=device)[None, :]
    mask_TS = j_1S <= i_T1
    if window is not None:
        mask_TS &= j_1S > i_T1 - window
    if doc_q_T is not None:
        mask_TS &= doc_q_T[:, None] == doc_k_S[None, :]
    return mask_TS


# ----------------------------------------------------------------------------- explicit (oracle, ring)

def _explicit_rows(q_BTHD, k_BSHD, v_BSHD, mask_TS, scale, dtype):
    """o [B, T, H, Dv], lse [B, H, T] in `dtype`; empty rows: o = 0, lse = −inf. No NaN is formed,
    in the forward or in autograd's backward (the oracle is differentiated by the tests)."""
    s_BHTS = torch.einsum("bthd,bshd->bhts", q_BTHD.to(dtype), k_BSHD.to(dtype)) * scale
    s_BHTS = s_BHTS.masked_fill(~mask_TS, float("-inf"))
    m_BHT = s_BHTS.amax(-1)
    m_BHT = torch.where(torch.isfinite(m_BHT), m_BHT, torch.zeros_like(m_BHT)).detach()
    e_BHTS = torch.exp(s_BHTS - m_BHT[..., None])  # masked entries: exp(−inf) = 0
    z_BHT = e_BHTS.sum(-1)
    p_BHTS = e_BHTS / torch.where(z_BHT > 0, z_BHT, torch.ones_like(z_BHT))[..., None]
    o_BTHD = torch.einsum("bhts,bshd->bthd", p_BHTS, v_BSHD.to(dtype))
    return o_BTHD, torch.log(z_BHT) + m_BHT


def explicit_forward(q_BTHD, k_BSHD, v_BSHD, *, q_start=0, k_start=0, scale=None, window=None, doc_q_T=None,
                     doc_k_S=None, dtype=None, q_chunk: int = Q_CHUNK):
    """(o [B, T, H, Dv], lse [B, H, T]) by explicit scores in `dtype` (default: the accumulation dtype)."""
    dtype = dtype or acc_dtype(q_BTHD.dtype)
    scale = q_BTHD.shape[-1] ** -0.5 if scale is None else scale
    T, S = q_BTHD.shape[1], k_BSHD.shape[1]
    outs, lses = [], []
    for a in range(0, T, q_chunk):
        b = min(a + q_chunk, T)
        mask_TS = visible_mask(q_start + a, b - a, k_start, S, q_BTHD.device, window,
                               None if doc_q_T is None else doc_q_T[a:b], doc_k_S)
        o, lse = _explicit_rows(q_BTHD[:, a:b], k_BSHD, v_BSHD, mask_TS, scale, dtype)
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs, 1), torch.cat(lses, -1)


def explicit_backward(do_BTHD, q_BTHD, k_BSHD, v_BSHD, lse_BHT, delta_BHT, *, q_start=0, k_start=0, scale=None,
                      window=None, doc_q_T=None, doc_k_S=None, q_chunk: int = Q_CHUNK):
    """(dq, dk, dv) of one key block's share, given the *final* lse and D = rowsum(do ⊙ o) of the
    merged output (the flash-attention backward): P = exp(s − lse), dP = do·vᵀ, dS = P ⊙ (dP − D).
    Everything in do's dtype (the caller passes the accumulation dtype)."""
    dtype = do_BTHD.dtype
    scale = q_BTHD.shape[-1] ** -0.5 if scale is None else scale
    k, v = k_BSHD.to(dtype), v_BSHD.to(dtype)
    S = k.shape[1]
    lse_safe_BHT = torch.where(torch.isfinite(lse_BHT), lse_BHT, torch.zeros_like(lse_BHT))
    dqs, dk, dv = [], torch.zeros_like(k), torch.zeros_like(v)
    for a in range(0, q_BTHD.shape[1], q_chunk):
        b = min(a + q_chunk, q_BTHD.shape[1])
        q, do = q_BTHD[:, a:b].to(dtype), do_BTHD[:, a:b]
        mask_TS = visible_mask(q_start + a, b - a, k_start, S, q.device, window,
                               None if doc_q_T is None else doc_q_T[a:b], doc_k_S)
        s_BHTS = torch.einsum("bthd,bshd->bhts", q, k) * scale
        p_BHTS = torch.exp(s_BHTS.masked_fill(~mask_TS, float("-inf")) - lse_safe_BHT[..., a:b, None])
        dv += torch.einsum("bhts,bthd->bshd", p_BHTS, do)
        dp_BHTS = torch.einsum("bthd,bshd->bhts", do, v)
        ds_BHTS = p_BHTS * (dp_BHTS - delta_BHT[..., a:b, None]) * scale
        dqs.append(torch.einsum("bhts,bshd->bthd", ds_BHTS, k))
        dk += torch.einsum("bhts,bthd->bshd", ds_BHTS, q)
    return torch.cat(dqs, 1), dk, dv


def naive_attention(q_BTHD, k_BSHD, v_BSHD, *, q_start=0, k_start=0, scale=None, window=None, cu_seqlens=None,
                    doc_q_T=None, doc_k_S=None):
    """The float64 oracle: (o [B, T, H, Dv], lse [B, H, T]), both float64, differentiable. Documents
    by global `cu_seqlens` (host ints or a tensor) or by explicit document ids."""
    if cu_seqlens is not None:
        doc_q_T = doc_ids(cu_seqlens, q_start, q_BTHD.shape[1], q_BTHD.device)
        doc_k_S = doc_ids(cu_seqlens, k_start, k_BSHD.shape[1], q_BTHD.device)
    return explicit_forward(q_BTHD, k_BSHD, v_BSHD, q_start=q_start, k_start=k_start, scale=scale, window=window,
                            doc_q_T=doc_q_T, doc_k_S=doc_k_S, dtype=torch.float64, q_chunk=max(1, q_BTHD.shape[1]))


# ----------------------------------------------------------------------------- fused kernels

def _sdpa(q, k, v, q_start, k_start, scale, window, doc_q_T, doc_k_S):
    T, S = q.shape[1], k.shape[1]
    q_, k_, v_ = (t.transpose(1, 2) for t in (q, k, v))  # SDPA wants [B, H, T, D]
    plain = window is None and doc_q_T is None
    if plain and q_start == k_start and T == S:
        o = F.scaled_dot_product_attention(q_, k_, v_, is_causal=True, scale=scale)
        return o.transpose(1, 2)
    if plain and q_start + T == k_start + S and S >= T:  # keys end with the queries: every row sees a key
        from torch.nn.attention.bias import causal_lower_right
        o = F.scaled_dot_product_attention(q_, k_, v_, attn_mask=causal_lower_right(T, S), scale=scale)
        return o.transpose(1, 2)
    mask_TS = visible_mask(q_start, T, k_start, S, q.device, window, doc_q_T, doc_k_S)
    seen_T1 = mask_TS.any(-1, keepdim=True)
    # a row that sees nothing attends everywhere (finite, no NaN in either pass) and is zeroed after
    o = F.scaled_dot_product_attention(q_, k_, v_, attn_mask=mask_TS | ~seen_T1, scale=scale)
    return (o * seen_T1.to(o.dtype)).transpose(1, 2)


def _xformers(q, k, v, q_start, k_start, scale, window, doc_q_T, doc_k_S):
    import xformers.ops as xops
    from xformers.ops.fmha.attn_bias import LowerTriangularFromBottomRightMask
    T, S = q.shape[1], k.shape[1]
    if window is None and doc_q_T is None and q_start + T == k_start + S and S >= T:
        return xops.memory_efficient_attention(q, k, v, attn_bias=LowerTriangularFromBottomRightMask(), scale=scale)
    mask_TS = visible_mask(q_start, T, k_start, S, q.device, window, doc_q_T, doc_k_S)
    seen_T1 = mask_TS.any(-1, keepdim=True)
    # an additive bias [B, H, T, S] whose storage rows are padded to a multiple of 8 (xformers' alignment)
    S8 = -(-S // 8) * 8
    bias = q.new_zeros(q.shape[0], q.shape[2], T, S8)[..., :S]
    bias.masked_fill_(~(mask_TS | ~seen_T1), float("-inf"))
    o = xops.memory_efficient_attention(q, k, v, attn_bias=bias, scale=scale)
    return o * seen_T1.to(o.dtype)[None, :, :, None]  # [1, T, 1, 1]


def pick(backend: str, device: torch.device, window=None, docs=False) -> str:
    check_backend(backend)
    if backend == "xformers":
        ok, why = xformers_available()
        if device.type != "cuda" or not ok:
            raise RuntimeError(f"softmax attention backend 'xformers' is unavailable here: "
                               f"{why or 'the tensors are not on CUDA'}; use backend='sdpa' or 'auto'")
    if backend == "auto":
        masked = window is not None or docs  # sdpa's flash kernel takes no mask: xformers keeps a fused kernel
        return "xformers" if masked and device.type == "cuda" and xformers_available()[0] else "sdpa"
    return backend


def attention(q_BTHD, k_BSHD, v_BSHD, *, q_start: int = 0, k_start: int = 0, scale: float | None = None,
              window: int | None = None, doc_q_T=None, doc_k_S=None, backend: str = "auto"):
    """Attention of queries at global positions [q_start, q_start + T) to keys at [k_start, k_start + S).
    Returns (o [B, T, H, Dv] in q's dtype, None); backend "naive" → the float64 oracle's (o, lse)."""
    scale = q_BTHD.shape[-1] ** -0.5 if scale is None else scale
    kw = dict(q_start=q_start, k_start=k_start, scale=scale, window=window, doc_q_T=doc_q_T, doc_k_S=doc_k_S)
    name = pick(backend, q_BTHD.device, window, doc_q_T is not None)
    if name == "naive":
        return naive_attention(q_BTHD, k_BSHD, v_BSHD, **kw)
    run = _xformers if name == "xformers" else _sdpa
    return run(q_BTHD, k_BSHD, v_BSHD, **kw), None
