"""The GLA operator as an opaque PyTorch custom op (`torch.library`), for code compiled by torch.compile.

Inductor cannot see into fla's Triton stages (autotuners, host-side heuristics), so inside a compiled
region the operator is one node, `lingua_zeco::gla_fwd`, whose backward is a second node,
`lingua_zeco::gla_bwd`: the graph around them (norms, gates, SwiGLU, residuals, float8 casts) fuses
with no graph break. Dense sequences, no initial or final state: what one rank's training step needs
(sp_gla routes every other case outside the graph). save_h: the forward's states h are a third saved
tensor (kernels/gla_chunk.py's save_h; off CUDA, and when off, an empty one). Kernels by device:
  cuda   fla's stages with our intra-chunk stages (kernels/gla_chunk.py staged_fwd / staged_bwd)
  other  the pure-torch chunked GLA (kernels/torch_chunk.py); its backward recomputes the forward under
         torch.func.vjp, so the op is exercised by the CPU tests with the same schema and fake shapes.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .common import ChunkLayout
from .torch_chunk import torch_chunk_gla


@torch.library.custom_op("lingua_zeco::gla_fwd", mutates_args=())
def gla_fwd(q: Tensor, k: Tensor, v: Tensor, g: Tensor, scale: float,
            save_h: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(o, A, g_cs, h): the output and what the backward keeps. Off CUDA A, g_cs and h are empty."""
    with torch.no_grad():
        o, _ = torch_chunk_gla(q, k, v, g, scale=scale)
    return o.to(v.dtype), q.new_empty(0), q.new_empty(0, dtype=torch.float), q.new_empty(0)


@gla_fwd.register_kernel("cuda")
def _gla_fwd_cuda(q, k, v, g, scale, save_h):
    from .gla_chunk import staged_fwd  # imports fla and Triton
    from .zeco_stages import fla_chunk_size
    q, k, v, g = (t.contiguous() for t in (q, k, v, g))
    o, _, A, g_cs, h = staged_fwd(q, k, v, g, scale, None, False, ChunkLayout(fla_chunk_size(q.shape[1])))
    return (o, A, g_cs if g_cs is not None else q.new_empty(0, dtype=torch.float),
            h if save_h else q.new_empty(0))


@gla_fwd.register_fake
def _gla_fwd_fake(q, k, v, g, scale, save_h):
    if not q.is_cuda:
        return torch.empty_like(v), q.new_empty(0), q.new_empty(0, dtype=torch.float), q.new_empty(0)
    from .zeco_stages import fla_chunk_size
    B, T, H, K = q.shape
    BT = fla_chunk_size(T)
    A = q.new_empty(B, T, H, BT, dtype=torch.float)  # fla's chunk_gla_fwd_intra_gk
    g_cs = torch.empty_like(g, dtype=torch.float) if g.dtype == torch.float else q.new_empty(0, dtype=torch.float)
    # fla's chunk_fwd_h in the forward: states in k's dtype
    h = k.new_empty(B, -(-T // BT), H, K, v.shape[-1]) if save_h else q.new_empty(0)
    return torch.empty_like(v), A, g_cs, h


@torch.library.custom_op("lingua_zeco::gla_bwd", mutates_args=())
def gla_bwd(qkvg: list[Tensor], saved: list[Tensor], do: Tensor, scale: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dq, dk, dv, dg) of gla_fwd's output o, from its inputs qkvg = [q, k, v, g] and what it kept,
    saved = [A, g_cs, h]."""
    q, k, v, g = qkvg
    # inside an op's kernel autograd is switched off; torch.func's transform still differentiates
    _, vjp = torch.func.vjp(lambda *x: torch_chunk_gla(*x, scale=scale)[0], q, k, v, g)
    return tuple(d.to(t.dtype) for d, t in zip(vjp(do.to(q.dtype)), (q, k, v, g)))


@gla_bwd.register_kernel("cuda")
def _gla_bwd_cuda(qkvg, saved, do, scale):
    from .gla_chunk import staged_bwd
    q, k, v, g = (t.contiguous() for t in qkvg)
    A, g_cs, h = saved
    dq, dk, dv, dg, _ = staged_bwd((q, k, v, g), (g_cs if g_cs.numel() else None, None, A, h if h.numel() else None),
                                   do, None, scale, ChunkLayout(A.shape[-1]))
    return dq, dk, dv, dg.to(g.dtype)


@gla_bwd.register_fake
def _gla_bwd_fake(qkvg, saved, do, scale):
    return tuple(torch.empty_like(t) for t in qkvg)


def _setup_context(ctx, inputs, output):
    q, k, v, g, scale, _ = inputs
    _, A, g_cs, h = output
    ctx.save_for_backward(q, k, v, g, A, g_cs, h)
    ctx.scale = scale


def _backward(ctx, do, dA, dg_cs, dh):  # A, g_cs and h are saved tensors, not results: their gradients are None
    q, k, v, g, A, g_cs, h = ctx.saved_tensors
    dq, dk, dv, dg = gla_bwd([q, k, v, g], [A, g_cs, h], do, ctx.scale)
    return dq, dk, dv, dg, None, None


gla_fwd.register_autograd(_backward, setup_context=_setup_context)


def chunk_gla_op(q, k, v, g, *, scale: float | None = None, save_h: bool = True) -> Tensor:
    """o [B, T, H, V] of GLA from a zero state (fla's convention), through the custom ops above; save_h as
    GLAOptions.save_h."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return gla_fwd(q, k, v, g, scale, save_h)[0]


__all__ = ["chunk_gla_op", "gla_bwd", "gla_fwd"]
