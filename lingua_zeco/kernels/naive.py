"""Float64 token-by-token GLA recurrence: the oracle every backend is checked against.

    S_t = diag(exp(g_t)) S_{t-1} + k_t v_tᵀ,   o_t = scale · S_tᵀ q_t     (fla's convention)
"""
from __future__ import annotations

import torch


def naive_gla(q, k, v, g, *, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None):
    """q, k, g [B, T, H, K]; v [B, T, H, V]; initial_state [N, H, K, V]. Returns (o in q's dtype, final states fp64)."""
    B, T, H, K = q.shape
    scale = K ** -0.5 if scale is None else scale
    if cu_seqlens is None:
        segments = [(b, 0, T) for b in range(B)]
    else:
        bounds = [int(c) for c in cu_seqlens.tolist()]
        segments = [(0, s, e) for s, e in zip(bounds[:-1], bounds[1:])]
    q64, k64, v64, g64 = (t.double() for t in (q, k, v, g))
    o = torch.zeros(*v.shape, dtype=torch.float64, device=q.device)
    finals = []
    for n, (b, s, e) in enumerate(segments):
        S = torch.zeros(H, K, v.shape[-1], dtype=torch.float64, device=q.device)
        if initial_state is not None:
            S = S + initial_state[n].double()
        for t in range(s, e):
            S = g64[b, t].exp()[..., None] * S + k64[b, t][..., None] * v64[b, t][:, None, :]
            o[b, t] = scale * torch.einsum("hk,hkv->hv", q64[b, t], S)
        finals.append(S)
    final = torch.stack(finals) if output_final_state else None
    return o.to(q.dtype), final


def naive_simple_gla(q, k, v, g, *, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None):
    """Scalar-decay GLA (RetNet style, fla's chunk_simple_gla): g [B, T, H], one log decay per head
    and token.  S_t = exp(g_t) S_{t-1} + k_t v_tᵀ,  o_t = scale · S_tᵀ q_t.  float64, token by token."""
    B, T, H, K = q.shape
    scale = K ** -0.5 if scale is None else scale
    bounds = [0, T] if cu_seqlens is None else [int(c) for c in cu_seqlens.tolist()]
    rows = range(B) if cu_seqlens is None else [0]
    o = torch.zeros(*v.shape, dtype=torch.float64, device=q.device)
    finals = []
    for b in rows:
        for n, (s, e) in enumerate(zip(bounds[:-1], bounds[1:])):
            S = torch.zeros(H, K, v.shape[-1], dtype=torch.float64, device=q.device)
            if initial_state is not None:
                S = S + initial_state[b if cu_seqlens is None else n].double()
            for t in range(s, e):
                S = g[b, t].double().exp()[:, None, None] * S + torch.einsum("hk,hv->hkv", k[b, t].double(),
                                                                              v[b, t].double())
                o[b, t] = scale * torch.einsum("hk,hkv->hv", q[b, t].double(), S)
            finals.append(S)
    return o.to(q.dtype), (torch.stack(finals) if output_final_state else None)
