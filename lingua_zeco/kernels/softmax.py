"""Causal softmax attention of a query block against a key/value block, beside its float64 oracle.

Layout [B, T, H, D] (as fla). A `Placement` says where the blocks sit (their global offsets) and what a
query may see: the query at global position i sees the key at global position j when

    j ≤ i  (causal),   i − window < j  (sliding window, optional),   doc(i) = doc(j)  (packed documents),

so one call serves a whole sequence (P = 1), an all-gathered prefix (allgather) or one visiting block of
a ring. A query row that sees no key gives o = 0 and lse = −inf, never NaN.

`attention(q, k, v, place, ...) -> (o, lse | None)` picks a backend:
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
from dataclasses import dataclass, replace

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


@dataclass(frozen=True, eq=False)
class Placement:
    """Where a query block and a key block sit and what a query sees: queries at global positions [q_start,
    q_start + T), keys at [k_start, k_start + S); the sliding window (None: full causal); for packed documents
    the document id of every query (doc_q_T [T]) and key (doc_k_S [S]), both or neither."""
    q_start: int = 0
    k_start: int = 0
    window: int | None = None
    doc_q_T: torch.Tensor | None = None
    doc_k_S: torch.Tensor | None = None

    @property
    def docs(self) -> bool:
        return self.doc_q_T is not None

    def with_docs(self, cu_seqlens, T_q: int, T_k: int, device) -> Placement:
        """The same blocks (T_q queries, T_k keys) with the document ids of global boundaries `cu_seqlens`
        (host ints or a tensor; None: no documents)."""
        if cu_seqlens is None:
            return self
        return replace(self, doc_q_T=doc_ids(cu_seqlens, self.q_start, T_q, device),
                       doc_k_S=doc_ids(cu_seqlens, self.k_start, T_k, device))

    def rows(self, a: int, b: int) -> Placement:
        """The query rows [a, b) of the block."""
        return replace(self, q_start=self.q_start + a, doc_q_T=None if self.doc_q_T is None else self.doc_q_T[a:b])

    def mask(self, T_q: int, T_k: int, device) -> torch.Tensor:
        """[T_q, T_k] bool, True where the query sees the key."""
        i_T1 = torch.arange(self.q_start, self.q_start + T_q, device=device)[:, None]
        j_1S = torch.arange(self.k_start, self.k_start + T_k, device=device)[None, :]
        mask_TS = j_1S <= i_T1
        if self.window is not None:
            mask_TS &= j_1S > i_T1 - self.window
        if self.doc_q_T is not None:
            mask_TS &= self.doc_q_T[:, None] == self.doc_k_S[None, :]
        return mask_TS


FULL = Placement()  # one block against itself from position 0: plain causal attention


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


def explicit_forward(q_BTHD, k_BSHD, v_BSHD, place: Placement = FULL, *, scale=None, dtype=None,
                     q_chunk: int = Q_CHUNK):
    """(o [B, T, H, Dv], lse [B, H, T]) by explicit scores in `dtype` (default: the accumulation dtype)."""
    dtype = dtype or acc_dtype(q_BTHD.dtype)
    scale = q_BTHD.shape[-1] ** -0.5 if scale is None else scale
    T, S = q_BTHD.shape[1], k_BSHD.shape[1]
    outs, lses = [], []
    for a in range(0, T, q_chunk):
        b = min(a + q_chunk, T)
        mask_TS = place.rows(a, b).mask(b - a, S, q_BTHD.device)
        o, lse = _explicit_rows(q_BTHD[:, a:b], k_BSHD, v_BSHD, mask_TS, scale, dtype)
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs, 1), torch.cat(lses, -1)


def explicit_backward(do_BTHD, q_BTHD, k_BSHD, v_BSHD, stats, place: Placement = FULL, *, scale=None,
                      q_chunk: int = Q_CHUNK):
    """(dq, dk, dv) of one key block's share, given stats = (lse, D) [B, H, T] of the *final* merged output
    (its log-sum-exp and D = rowsum(do ⊙ o); the flash-attention backward): P = exp(s − lse), dP = do·vᵀ,
    dS = P ⊙ (dP − D). Everything in do's dtype (the caller passes the accumulation dtype)."""
    lse_BHT, delta_BHT = stats
    dtype = do_BTHD.dtype
    scale = q_BTHD.shape[-1] ** -0.5 if scale is None else scale
    k, v = k_BSHD.to(dtype), v_BSHD.to(dtype)
    S = k.shape[1]
    lse_safe_BHT = torch.where(torch.isfinite(lse_BHT), lse_BHT, torch.zeros_like(lse_BHT))
    dqs, dk, dv = [], torch.zeros_like(k), torch.zeros_like(v)
    for a in range(0, q_BTHD.shape[1], q_chunk):
        b = min(a + q_chunk, q_BTHD.shape[1])
        q, do = q_BTHD[:, a:b].to(dtype), do_BTHD[:, a:b]
        mask_TS = place.rows(a, b).mask(b - a, S, q.device)
        s_BHTS = torch.einsum("bthd,bshd->bhts", q, k) * scale
        p_BHTS = torch.exp(s_BHTS.masked_fill(~mask_TS, float("-inf")) - lse_safe_BHT[..., a:b, None])
        dv += torch.einsum("bhts,bthd->bshd", p_BHTS, do)
        dp_BHTS = torch.einsum("bthd,bshd->bhts", do, v)
        ds_BHTS = p_BHTS * (dp_BHTS - delta_BHT[..., a:b, None]) * scale
        dqs.append(torch.einsum("bhts,bshd->bthd", ds_BHTS, k))
        dk += torch.einsum("bhts,bthd->bshd", ds_BHTS, q)
    return torch.cat(dqs, 1), dk, dv


def naive_attention(q_BTHD, k_BSHD, v_BSHD, place: Placement = FULL, *, scale=None, cu_seqlens=None):
    """The float64 oracle: (o [B, T, H, Dv], lse [B, H, T]), both float64, differentiable. Documents by
    the placement's ids or by global `cu_seqlens` (host ints or a tensor), not both."""
    if cu_seqlens is not None:
        if place.docs:
            raise ValueError("naive_attention: documents by cu_seqlens or by the placement's ids, not both")
        place = place.with_docs(cu_seqlens, q_BTHD.shape[1], k_BSHD.shape[1], q_BTHD.device)
    return explicit_forward(q_BTHD, k_BSHD, v_BSHD, place, scale=scale, dtype=torch.float64,
                            q_chunk=max(1, q_BTHD.shape[1]))


# ----------------------------------------------------------------------------- fused kernels

def _sdpa(q, k, v, place: Placement, scale):
    T, S = q.shape[1], k.shape[1]
    q_, k_, v_ = (t.transpose(1, 2) for t in (q, k, v))  # SDPA wants [B, H, T, D]
    plain = place.window is None and not place.docs
    if plain and place.q_start == place.k_start and T == S:
        o = F.scaled_dot_product_attention(q_, k_, v_, is_causal=True, scale=scale)
        return o.transpose(1, 2)
    if plain and place.q_start + T == place.k_start + S and S >= T:  # keys end with the queries: every row sees a key
        from torch.nn.attention.bias import causal_lower_right
        o = F.scaled_dot_product_attention(q_, k_, v_, attn_mask=causal_lower_right(T, S), scale=scale)
        return o.transpose(1, 2)
    mask_TS = place.mask(T, S, q.device)
    seen_T1 = mask_TS.any(-1, keepdim=True)
    # a row that sees nothing attends everywhere (finite, no NaN in either pass) and is zeroed after
    o = F.scaled_dot_product_attention(q_, k_, v_, attn_mask=mask_TS | ~seen_T1, scale=scale)
    return (o * seen_T1.to(o.dtype)).transpose(1, 2)


def _xformers(q, k, v, place: Placement, scale):
    import xformers.ops as xops
    from xformers.ops.fmha.attn_bias import LowerTriangularFromBottomRightMask
    T, S = q.shape[1], k.shape[1]
    if place.window is None and not place.docs and place.q_start + T == place.k_start + S and S >= T:
        return xops.memory_efficient_attention(q, k, v, attn_bias=LowerTriangularFromBottomRightMask(), scale=scale)
    mask_TS = place.mask(T, S, q.device)
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


def attention(q_BTHD, k_BSHD, v_BSHD, place: Placement = FULL, *, scale: float | None = None, backend: str = "auto"):
    """Attention of queries at global positions [q_start, q_start + T) to keys at [k_start, k_start + S)
    (`place`). Returns (o [B, T, H, Dv] in q's dtype, None); backend "naive" → the float64 oracle's (o, lse)."""
    scale = q_BTHD.shape[-1] ** -0.5 if scale is None else scale
    name = pick(backend, q_BTHD.device, place.window, place.docs)
    if name == "naive":
        return naive_attention(q_BTHD, k_BSHD, v_BSHD, place, scale=scale)
    run = _xformers if name == "xformers" else _sdpa
    return run(q_BTHD, k_BSHD, v_BSHD, place, scale), None
