"""The single-device GLA operator on CUDA: fla's chunk_gla rebuilt from fla's stages
(kernels/fla_stages.py) with the intra-chunk dq/dk stage chosen by `bwd_intra`:
  "zeco"  ours (kernels/gla_bwd_intra.py), one program per chunk
  "fla"   fla's chunk_gla_bwd_dqk_intra
Every other stage, the saved tensors and the precisions are fla's (ChunkGLAFunction): h in 16 bits in
the forward, recomputed in fp32 in the backward; the gate cumsum kept when g is fp32, recomputed from
16-bit gates. Dense sequences only (fla's contract without cu_seqlens); packed documents keep fla's
chunk_gla. Shapes as fla names them: q, k, g [B, T, H, K], v [B, T, H, V], h0 and ht [B, H, K, V].
"""
from __future__ import annotations

import torch

from . import fla_stages as fla
from .common import check_bwd_intra
from .gla_bwd_intra import chunk_gla_bwd_dqk_intra
from .zeco_stages import fla_chunk_size


def dqk_intra(q, k, g_cs, dA, BT: int, bwd_intra: str = "zeco"):
    """The intra-chunk parts of (dq, dk), fp32, by the chosen stage (one of BWD_INTRA)."""
    check_bwd_intra(bwd_intra)
    if bwd_intra == "zeco":
        return chunk_gla_bwd_dqk_intra(q, k, g_cs, dA, BT)
    return fla.chunk_gla_bwd_dqk_intra(q=q, k=k, g=g_cs, dA=dA, chunk_size=BT)


class ChunkGLA(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, scale, h0, output_final_state, bwd_intra):
        q, k, v, g = (t.contiguous() for t in (q, k, v, g))
        BT = fla_chunk_size(q.shape[1])
        g_cs = fla.gate_cumsum(g, BT)
        h, ht = fla.chunk_fwd_h(k=k, v=v, gk=g_cs, h0=h0, output_final_state=output_final_state, chunk_size=BT)
        A = fla.chunk_gla_fwd_intra_gk(q=q, k=k, g=g_cs, scale=scale, chunk_size=BT)
        o = fla.chunk_gla_fwd_o_gk(q=q, v=v, g=g_cs, A=A, h=h, scale=scale, chunk_size=BT)
        keep_cs = g.dtype == torch.float  # as fla: the fp32 cumsum costs no more memory than fp32 g
        ctx.save_for_backward(q, k, v, None if keep_cs else g, g_cs if keep_cs else None, h0, A)
        ctx.scale, ctx.BT, ctx.bwd_intra = scale, BT, bwd_intra
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, g, g_cs, h0, A = ctx.saved_tensors
        scale, BT = ctx.scale, ctx.BT
        do = do.contiguous()
        if g_cs is None:
            g_cs = fla.gate_cumsum(g, BT)
        h, _ = fla.chunk_fwd_h(k=k, v=v, gk=g_cs, h0=h0, output_final_state=False, chunk_size=BT,
                               states_in_fp32=True)
        dh, dh0 = fla.chunk_bwd_dh(q=q, k=k, v=v, do=do, h0=h0, dht=dht, scale=scale, gk=g_cs, chunk_size=BT,
                                   states_in_fp32=True)
        dv = fla.chunk_gla_bwd_dv(k=k, g=g_cs, A=A, do=do, dh=dh, chunk_size=BT)
        dA = fla.chunk_gla_bwd_dA(v=v, do=do, scale=scale, chunk_size=BT)
        dq, dk = dqk_intra(q, k, g_cs, dA, BT, ctx.bwd_intra)
        dq, dk, dg = fla.chunk_gla_bwd_dqkg(q=q, k=k, v=v, h=h, g=g_cs, do=do, dh=dh, dq=dq, dk=dk, scale=scale,
                                            chunk_size=BT)
        return dq.to(q), dk.to(k), dv.to(v), dg, None, dh0, None, None


def chunk_gla_staged(q, k, v, g, *, scale=None, initial_state=None, output_final_state=False,
                     bwd_intra: str = "zeco"):
    """fla's chunk_gla contract (dense): (o [B, T, H, V], final state [B, H, K, V] or None)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return ChunkGLA.apply(q, k, v, g, scale, initial_state, output_final_state, bwd_intra)


__all__ = ["ChunkGLA", "chunk_gla_staged", "dqk_intra"]
