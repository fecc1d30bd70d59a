"""GLA compute backends behind one call: `chunk_gla(q, k, v, g, ...) -> (o, final_state)`.

* "fla":   fla's Triton kernels (CUDA). Fast; its internal stages (kernels/fla_stages.py) are reordered
           by lingua_zeco.sp's fused ZeCO, and dense sequences run them with our intra-chunk stages
           (kernels/gla_chunk.py, kernels/gla_intra.py) as `stages` (GLAStages) says; all fla's and no
           side stream: fla's chunk_gla itself.
* "torch": pure PyTorch chunked GLA (any device, fp32 inside, autograd).
* oracle:  lingua_zeco.kernels.naive.naive_gla, float64 token by token.
`chunk_simple_gla` is the scalar-decay variant (g [B, T, H]; fla's chunk_simple_gla / RetNet style),
oracle naive_simple_gla.

The backend follows the device (lingua_zeco.kernels.common.pick_backend).
"""
from __future__ import annotations

from .common import BACKENDS, INTRA_STAGES, GLAStages, acc_dtype, fla_available, pick_backend
from .naive import naive_gla, naive_simple_gla
from .torch_chunk import torch_chunk_gla


def chunk_gla(q, k, v, g, *, scale=None, initial_state=None, output_final_state=False,
              cu_seqlens=None, backend: str | None = None, stages: GLAStages = GLAStages()):
    """GLA over [B, T, H, *] tensors with fla's contract; returns (o, final_state or None).
    fla backend, dense: fla's stages as `stages` says (kernels/gla_chunk.py); stages.fla_only and
    packed documents: fla's chunk_gla itself. The torch backend has no stages to choose."""
    if not isinstance(stages, GLAStages):
        raise TypeError(f"stages must be a GLAStages, got {type(stages).__name__}")
    name = pick_backend(q.device, backend)
    if name == "fla" and cu_seqlens is None and not stages.fla_only:
        from .gla_chunk import chunk_gla_staged
        return chunk_gla_staged(q, k, v, g, scale=scale, initial_state=initial_state,
                                output_final_state=output_final_state, stages=stages)
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


__all__ = ["BACKENDS", "INTRA_STAGES", "GLAStages", "acc_dtype", "chunk_gla", "chunk_simple_gla", "fla_available",
           "naive_gla", "naive_simple_gla", "pick_backend", "torch_chunk_gla"]
