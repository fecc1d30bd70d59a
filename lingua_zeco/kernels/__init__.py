"""GLA compute backends behind one call: `chunk_gla(q, k, v, g, ...) -> (o, final_state)`.

* "fla":   fla's Triton kernels (CUDA). Fast; its internal stages (kernels/fla_stages.py) are reordered
           by lingua_zeco.sp's fused ZeCO, and dense sequences and packed documents run them with our
           intra-chunk dq/dk stage (kernels/gla_chunk.py, kernels/gla_bwd_intra.py;
           `bwd_intra="fla"`: fla's chunk_gla).
* "torch": pure PyTorch chunked GLA (any device, fp32 inside, autograd).
* oracle:  lingua_zeco.kernels.naive.naive_gla, float64 token by token.
`chunk_gla_op` is the same operator as one opaque custom op for torch.compile'd code (kernels/gla_op.py).
`chunk_simple_gla` is the scalar-decay variant (g [B, T, H]; fla's chunk_simple_gla / RetNet style),
oracle naive_simple_gla.

The backend follows the device (lingua_zeco.kernels.common.pick_backend).
"""
from __future__ import annotations

from .common import BACKENDS, BWD_INTRA, acc_dtype, check_bwd_intra, fla_available, pick_backend
from .gla_op import chunk_gla_op
from .naive import naive_gla, naive_simple_gla
from .torch_chunk import torch_chunk_gla


def chunk_gla(q, k, v, g, *, scale=None, initial_state=None, output_final_state=False,
              cu_seqlens=None, backend: str | None = None, bwd_intra: str = "zeco", chunk_tables=None,
              save_h: bool = False):
    """GLA over [B, T, H, *] tensors with fla's contract; returns (o, final_state or None).
    fla backend: fla's stages with the intra-chunk dq/dk stage `bwd_intra` (kernels/gla_chunk.py), dense
    or packed (`chunk_tables(BT)`: fla's chunk tables planned on the host, as LocalSegments.chunk_index
    gives them; planned from cu_seqlens when None); bwd_intra="fla": fla's chunk_gla itself. save_h: the
    staged operator keeps the forward's states for the backward (kernels/gla_chunk.py; other backends
    recompute or keep what they always do)."""
    check_bwd_intra(bwd_intra)
    name = pick_backend(q.device, backend)
    if name == "fla" and bwd_intra != "fla":
        from .gla_chunk import chunk_gla_staged
        return chunk_gla_staged(q, k, v, g, scale=scale, initial_state=initial_state,
                                output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                                bwd_intra=bwd_intra, chunk_tables=chunk_tables, save_h=save_h)
    if name == "fla":
        from fla.ops.gla import chunk_gla as fla_chunk_gla
        return fla_chunk_gla(q, k, v, g, scale=scale, initial_state=initial_state,
                             output_final_state=output_final_state, cu_seqlens=cu_seqlens)
    return torch_chunk_gla(q, k, v, g, scale=scale, initial_state=initial_state,
                           output_final_state=output_final_state, cu_seqlens=cu_seqlens)


def chunk_simple_gla(q, k, v, g, *, scale=None, initial_state=None, output_final_state=False,
                     cu_seqlens=None, backend: str | None = None):
    """Scalar-decay GLA (fla's chunk_simple_gla): g [B, T, H], one log decay per head and token.
    fla: its chunk_simple_gla kernel; torch: the GLA kernel with the decay broadcast over K (exact)."""
    if g.shape != q.shape[:3]:
        raise ValueError(f"simple GLA: g must be [B, T, H] = {tuple(q.shape[:3])}, got {tuple(g.shape)}")
    name = pick_backend(q.device, backend)
    if name == "fla":
        from fla.ops.simple_gla import chunk_simple_gla as fla_chunk_simple_gla
        return fla_chunk_simple_gla(q, k, v, g, scale=scale, initial_state=initial_state,
                                    output_final_state=output_final_state, cu_seqlens=cu_seqlens)
    return torch_chunk_gla(q, k, v, g[..., None].expand_as(q), scale=scale, initial_state=initial_state,
                           output_final_state=output_final_state, cu_seqlens=cu_seqlens)


__all__ = ["BACKENDS", "BWD_INTRA", "acc_dtype", "check_bwd_intra", "chunk_gla", "chunk_gla_op", "chunk_simple_gla",
           "fla_available", "naive_gla", "naive_simple_gla", "pick_backend", "torch_chunk_gla"]
