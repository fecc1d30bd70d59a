"""GLA compute backends behind one call: `chunk_gla(q, k, v, g, ...) -> (o, final_state)`, fla's contract.

* "fla":   on CUDA, fla's Triton stages with our own where they are faster (kernels/gla_chunk.py: the
           whole-chunk intra-chunk stages gla_fwd_intra.py, gla_bwd_intra.py; the backward's dq/dk/dg,
           gla_bwd_dqkg.py, and dv, gla_bwd_dv.py), reordered by lingua_zeco.sp's fused ZeCO.
* "torch": pure PyTorch chunked GLA (any device, fp32 inside, autograd).
* oracle:  lingua_zeco.kernels.naive.naive_gla, float64 token by token.
fla's own `fla.ops.gla.chunk_gla` is the reference the tests and benchmarks compare against.
`GLAOptions` holds the operator's settings (backend, kept states); `chunk_gla` is its default.
`chunk_gla_op` is the same operator as one opaque custom op for torch.compile'd code (kernels/gla_op.py).
`chunk_simple_gla` is the scalar-decay variant (g [B, T, H]; fla's chunk_simple_gla / RetNet style),
oracle naive_simple_gla.
The backend follows the device (lingua_zeco.kernels.common.pick_backend).
"""
from __future__ import annotations

from dataclasses import dataclass

from .common import BACKENDS, ChunkLayout, acc_dtype, chunk_layout, fla_available, pick_backend
from .gla_op import chunk_gla_op
from .naive import naive_gla, naive_simple_gla
from .torch_chunk import torch_chunk_gla


@dataclass(frozen=True)
class GLAOptions:
    """The GLA operator's settings, made once (lingua_zeco.sp.SPContext.gla) and passed down."""
    backend: str | None = None  # fla | torch | None: the device's (pick_backend)
    # fla backend: keep the forward's chunk states (16 bits) for the backward instead of recomputing them: one
    # state pass fewer per call, for 2·B·T·H·K·V/64 bytes held per call until its backward (128 MiB per layer
    # at 16K tokens with 16 heads of 128 × 128: 2.5 GiB over GLA-1B's 20 layers). Off only where memory is short.
    save_h: bool = True

    def __post_init__(self):
        if self.backend is not None and self.backend not in BACKENDS:
            raise ValueError(f"GLA backend must be one of {BACKENDS} or None (the device's), got {self.backend!r}")

    def chunk_gla(self, q, k, v, g, *, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None):
        """GLA over [B, T, H, *] tensors with fla's contract; returns (o, final_state or None). cu_seqlens: None,
        the boundaries of packed documents (B = 1; a long tensor), or documents planned on the host (an object
        with .cu_seqlens and .chunk_index(BT), lingua_zeco.sp.varlen.LocalSegments: no read back from the GPU)."""
        if pick_backend(q.device, self.backend) == "torch":
            cu = getattr(cu_seqlens, "cu_seqlens", cu_seqlens)
            return torch_chunk_gla(q, k, v, g, scale=scale, initial_state=initial_state,
                                   output_final_state=output_final_state, cu_seqlens=cu)
        from .gla_chunk import ChunkGLA  # imports fla and Triton
        from .zeco_stages import fla_chunk_size
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        layout = chunk_layout(fla_chunk_size(q.shape[1]), cu_seqlens)
        return ChunkGLA.apply(q, k, v, g, scale, initial_state, output_final_state, layout, self.save_h)

    def chunk_simple_gla(self, q, k, v, g, *, scale=None, initial_state=None, output_final_state=False,
                         cu_seqlens=None):
        """Scalar-decay GLA (fla's chunk_simple_gla): g [B, T, H], one log decay per head and token. fla: its
        chunk_simple_gla kernel; torch: the GLA kernel with the decay broadcast over K (exact). cu_seqlens: as
        chunk_gla's."""
        if g.shape != q.shape[:3]:
            raise ValueError(f"simple GLA: g must be [B, T, H] = {tuple(q.shape[:3])}, got {tuple(g.shape)}")
        cu = getattr(cu_seqlens, "cu_seqlens", cu_seqlens)
        if pick_backend(q.device, self.backend) == "fla":
            from fla.ops.simple_gla import chunk_simple_gla as fla_chunk_simple_gla
            return fla_chunk_simple_gla(q, k, v, g, scale=scale, initial_state=initial_state,
                                        output_final_state=output_final_state, cu_seqlens=cu)
        return torch_chunk_gla(q, k, v, g[..., None].expand_as(q), scale=scale, initial_state=initial_state,
                               output_final_state=output_final_state, cu_seqlens=cu)


DEFAULT = GLAOptions()
chunk_gla = DEFAULT.chunk_gla
chunk_simple_gla = DEFAULT.chunk_simple_gla


__all__ = ["BACKENDS", "ChunkLayout", "GLAOptions", "acc_dtype", "chunk_gla", "chunk_gla_op", "chunk_layout",
           "chunk_simple_gla", "fla_available", "naive_gla", "naive_simple_gla", "pick_backend", "torch_chunk_gla"]
