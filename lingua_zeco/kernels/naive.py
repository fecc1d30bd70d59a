"""Float64 token-by-token recurrences: the oracles every backend is checked against.

    S_t = diag(exp(g_t)) S_{t-1} + k_t v_tᵀ,   o_t = scale · S_tᵀ q_t     (GLA, fla's convention)
"""
from __future__ import annotations

import torch

from .common import segments


def naive_recurrence(step, q, v, *, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None):
    """o_t = scale · S_tᵀ q_t with S_t = step(S_{t-1}, b, t) [H, K, V], float64, token by token, from
    initial_state [N, H, K, V] (or zeros) per sequence. Returns (o in q's dtype, final states fp64 or None)."""
    B, T, H, K = q.shape
    scale = K ** -0.5 if scale is None else scale
    q64 = q.double()
    o = torch.zeros(*v.shape, dtype=torch.float64, device=q.device)
    finals = []
    for n, (b, s, e) in enumerate(segments(B, T, cu_seqlens)):
        S = torch.zeros(H, K, v.shape[-1], dtype=torch.float64, device=q.device)
        if initial_state is not None:
            S = S + initial_state[n].double()
        for t in range(s, e):
            S = step(S, b, t)
            o[b, t] = scale * torch.einsum("hk,hkv->hv", q64[b, t], S)
        finals.append(S)
    return o.to(q.dtype), (torch.stack(finals) if output_final_state else None)


def naive_gla(q, k, v, g, *, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None):
    """q, k, g [B, T, H, K]; v [B, T, H, V]; initial_state [N, H, K, V]. Returns (o in q's dtype, final states fp64)."""
    k64, v64, g64 = (t.double() for t in (k, v, g))

    def step(S, b, t):
        return g64[b, t].exp()[..., None] * S + k64[b, t][..., None] * v64[b, t][:, None, :]
    return naive_recurrence(step, q, v, scale=scale, initial_state=initial_state,
                            output_final_state=output_final_state, cu_seqlens=cu_seqlens)


def naive_simple_gla(q, k, v, g, *, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None):
    """Scalar-decay GLA (RetNet style, fla's chunk_simple_gla): g [B, T, H], one log decay per head
    and token.  S_t = exp(g_t) S_{t-1} + k_t v_tᵀ,  o_t = scale · S_tᵀ q_t.  float64, token by token."""
    def step(S, b, t):
        return g[b, t].double().exp()[:, None, None] * S + torch.einsum("hk,hv->hkv", k[b, t].double(),
                                                                         v[b, t].double())
    return naive_recurrence(step, q, v, scale=scale, initial_state=initial_state,
                            output_final_state=output_final_state, cu_seqlens=cu_seqlens)
