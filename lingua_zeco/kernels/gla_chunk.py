"""The single-device GLA operator on CUDA: fla's chunk_gla rebuilt from fla's stages (kernels/fla_stages.py)
with our intra-chunk stages, which take whole chunks where the gates allow: the forward's intra-chunk
attention A (gla_fwd_intra.py), the backward's dq, dk, dg in one kernel (gla_bwd_dqkg.py: fla's dA and
inter-chunk stages fused with our intra-chunk dq/dk, gla_bwd_intra.py) and its dv (gla_bwd_dv.py: fla's stage
with its intra-chunk product on tensor cores).
Every other stage and the precisions are fla's (ChunkGLAFunction): the gate cumsum kept when g is fp32,
recomputed from 16-bit gates. `save_h` keeps the forward's chunk states h (in k's dtype: 16 bits in training)
for the backward instead of recomputing them in fp32: one state pass fewer per call for
2·B·T·H·K·V/BT bytes held from forward to backward. The backward reads h in two places: its dq product,
which rounds h to 16 bits anyway (the same values), and dg's Σ h ⊙ dh, where h then carries the forward's
16-bit rounding (a relative 2^-9 a term).
The state gradients dh pass from their kernel (an fp32 recurrence) to dv and dq/dk/dg in k's dtype (16 bits in
training), not fp32 as fla's chunk_gla keeps them: dv's and dk's products round dh to 16 bits anyway (the same
values), and dg's Σ h ⊙ dh then carries that rounding (a relative 2^-9 a term, as h under save_h); dh0 stays fp32.
Dense sequences, or packed documents (B = 1) with fla's chunk tables planned on the host (ChunkLayout), so
that no stage reads the boundaries back from the GPU as fla's own varlen path does.
Shapes as fla names them: q, k, g [B, T, H, K], v [B, T, H, V], h0 and ht [B or N documents, H, K, V].
"""
from __future__ import annotations

import torch

from . import fla_stages as fla
from .common import ChunkLayout
from .gla_bwd_dqkg import chunk_gla_bwd_dqkg
from .gla_bwd_dv import chunk_gla_bwd_dv
from .gla_fwd_intra import chunk_gla_fwd_A


def dqkg(qkvg, h, dh, do, scale: float, dtypes, layout: ChunkLayout):
    """(dq, dk, dg) in `dtypes` from qkvg = (q, k, v, g_cs), the states h, their gradients dh and do, in one
    kernel (gla_bwd_dqkg.py)."""
    return chunk_gla_bwd_dqkg(qkvg, h, dh, do, scale=scale, dtypes=dtypes, layout=layout)


def dv(k, g_cs, A, do, dh, layout: ChunkLayout):
    """dv [B, T, H, V] in do's dtype from the forward's A, the gate cumsum g_cs and the state gradients dh
    (gla_bwd_dv.py)."""
    return chunk_gla_bwd_dv(k, g_cs, A, do, dh, layout=layout)


def fwd_A(q, k, g_cs, scale: float, layout: ChunkLayout):
    """The forward's intra-chunk attention A [B, T, H, BT] fp32 (gla_fwd_intra.py)."""
    return chunk_gla_fwd_A(q, k, g_cs, scale, layout.BT, cu_seqlens=layout.cu_seqlens,
                           chunk_indices=layout.chunk_indices)


def staged_fwd(q, k, v, g, scale: float, h0, output_final_state: bool, layout: ChunkLayout):
    """The forward stages on contiguous inputs: (o, final state(s) or None, A, g_cs or None, h). A [B, T, H, BT]
    fp32 is the intra-chunk attention the backward reuses; g_cs (the fp32 gate cumsum) is returned only when g is
    fp32 (as fla: it then costs no more memory than g), else the backward recomputes it; h [B, NT, H, K, V] in
    k's dtype, for a backward that keeps it (save_h)."""
    g_cs = fla.gate_cumsum(g, layout.BT, layout.cu_seqlens, layout.chunk_indices)
    h, ht = fla.fwd_h(k, v, g_cs, h0, layout=layout, output_final_state=output_final_state)
    A = fwd_A(q, k, g_cs, scale, layout)
    o = fla.chunk_gla_fwd_o_gk(q=q, v=v, g=g_cs, A=A, h=h, scale=scale, **layout.varlen)
    return o, ht, A, g_cs if g.dtype == torch.float else None, h


def staged_bwd(qkvg, saved, do, dht, scale: float, layout: ChunkLayout):
    """The backward stages: (dq, dk, dv, dg, dh0) from staged_fwd's inputs qkvg = (q, k, v, g), what it kept,
    saved = (g_cs or None: recomputed from g, h0, A, h or None: recomputed in fp32), and the gradients of o and of
    the final state(s) (dht None: zero)."""
    q, k, v, g = qkvg
    g_cs, h0, A, h = saved
    do = do.contiguous()
    dht = None if dht is None else dht.contiguous()  # e.g. ht.sum()'s gradient: ones expanded, stride 0
    if g_cs is None:
        g_cs = fla.gate_cumsum(g, layout.BT, layout.cu_seqlens, layout.chunk_indices)
    if h is None:
        h, _ = fla.fwd_h(k, v, g_cs, h0, layout=layout, output_final_state=False, states_in_fp32=True)
    dh, dh0 = fla.bwd_dh(q, do, dht, g_cs, scale=scale, layout=layout, h0=h0)
    dv_ = dv(k, g_cs, A, do, dh, layout)
    g_dtype = (g if g is not None else g_cs).dtype  # g is None when its fp32 cumsum was kept instead
    dq, dk, dg = dqkg((q, k, v, g_cs), h, dh, do, scale, (q.dtype, k.dtype, g_dtype), layout)
    return dq, dk, dv_.to(v), dg, dh0


class ChunkGLA(torch.autograd.Function):
    """layout: the chunks (and packed documents) of the call (ChunkLayout); save_h: keep h (module doc)."""

    @staticmethod
    def forward(ctx, q, k, v, g, scale, h0, output_final_state, layout, save_h):
        # fla's kernels assume contiguous tensors (fla's own wrapper makes every input so)
        q, k, v, g = (t.contiguous() for t in (q, k, v, g))
        h0 = None if h0 is None else h0.contiguous()
        o, ht, A, g_cs, h = staged_fwd(q, k, v, g, scale, h0, output_final_state, layout)
        ctx.save_for_backward(q, k, v, None if g_cs is not None else g, g_cs, h0, A, h if save_h else None)
        ctx.scale, ctx.layout = scale, layout
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, g, g_cs, h0, A, h = ctx.saved_tensors
        dq, dk, dv, dg, dh0 = staged_bwd((q, k, v, g), (g_cs, h0, A, h), do, dht, ctx.scale, ctx.layout)
        return dq, dk, dv, dg, None, dh0, None, None, None


__all__ = ["ChunkGLA", "dqkg", "dv", "fwd_A", "staged_bwd", "staged_fwd"]
