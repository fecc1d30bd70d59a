"""Pure PyTorch chunked GLA (any device, computed in fp32, differentiable by autograd).

Within a chunk of C tokens with inclusive gate sums G_i (cumsum of g inside the chunk):
  intra:  o_i += Σ_{j≤i} scale · (q_i ⊙ exp(G_i − G_j))·k_j  v_j
  inter:  o_i += scale · (q_i ⊙ exp(G_i))ᵀ h            (h: state entering the chunk)
  state:  h ← diag(exp(G_C)) h + Σ_j (k_j ⊙ exp(G_C − G_j)) v_jᵀ
Every exponent is ≤ 0, so nothing overflows however strong the gates are; the price is a
[C, C, K] decay tensor per chunk, which is why the chunk is small.
"""
from __future__ import annotations

import torch

from .common import acc_dtype, by_segments

CHUNK = 8  # faster than 16 on CPU at the debug and MQAR configs (docs/results/README.md, History)


def _gla_fixed(q, k, v, g, scale, h0, chunk):
    """One batch of equal-length sequences. q, k, g [B, T, H, K], v [B, T, H, V], h0 [B, H, K, V] or None."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    acc = acc_dtype(q.dtype)
    h = q.new_zeros(B, H, K, V, dtype=acc) if h0 is None else h0.to(acc)
    if T == 0:  # an empty document (equal boundaries): no output, the state passes through
        return v.new_zeros(B, 0, H, V, dtype=acc), h
    chunk = min(chunk, 1 << (T - 1).bit_length())  # a short row (a segment, a packed document) pads to less
    pad = (-T) % chunk
    if pad:  # zero keys/values and zero gates leave the state untouched
        q, k, v, g = (torch.nn.functional.pad(t, (0, 0, 0, 0, 0, pad)) for t in (q, k, v, g))
    N = q.shape[1] // chunk
    q, k, v, g = (t.to(acc).reshape(B, N, chunk, H, -1).transpose(2, 3) for t in (q, k, v, g))  # [B, N, H, C, *]
    G = g.cumsum(-2)
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = (G[..., :, None, :] - G[..., None, :, :]).masked_fill(~causal[..., None], float("-inf")).exp()
    A = torch.einsum("bnhik,bnhjk,bnhijk->bnhij", q, k, decay) * scale
    o = A @ v
    k_to_end = k * (G[..., -1:, :] - G).exp()
    q_from_start = q * G.exp()
    outs = []
    for n in range(N):
        outs.append(scale * q_from_start[:, n] @ h)
        h = G[:, n, :, -1, :, None].exp() * h + k_to_end[:, n].transpose(-1, -2) @ v[:, n]
    o = o + torch.stack(outs, dim=1)
    o = o.transpose(2, 3).reshape(B, N * chunk, H, V)[:, :T]
    return o, h


def torch_chunk_gla(q, k, v, g, *, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None):
    """Same contract as fla.ops.gla.chunk_gla; returns (o in q's dtype, final state fp32 or None), in chunks of
    CHUNK tokens. fp32 inside whatever the autocast state, as fla's kernels accumulate (autocast would cast the
    matmuls)."""
    return by_segments(_gla_fixed, q, k, v, g, scale=scale, initial_state=initial_state,
                       output_final_state=output_final_state, cu_seqlens=cu_seqlens, chunk=CHUNK)
