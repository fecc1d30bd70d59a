"""The single-device GLA operator on CUDA: fla's chunk_gla rebuilt from fla's stages
(kernels/fla_stages.py) with the intra-chunk dq/dk stage chosen by `bwd_intra`:
  "zeco"  ours (kernels/gla_bwd_intra.py), one program per chunk
  "fla"   fla's chunk_gla_bwd_dqk_intra
  "zeco_chunk"  ours, whole chunks where the gates allow: the backward's dq/dk (gla_bwd_intra.py) and the
               forward's intra-chunk attention A (gla_fwd_intra.py) instead of fla's
Every other stage, the saved tensors and the precisions are fla's (ChunkGLAFunction): h in 16 bits in
the forward, recomputed in fp32 in the backward; the gate cumsum kept when g is fp32, recomputed from
16-bit gates. `save_h` keeps the forward's h (in k's dtype: 16 bits in training) for the backward
instead of recomputing it: one chunk_fwd_h fewer, 2·B·T·H·K·V/BT bytes held from forward to backward in
16 bits. The backward reads h in two places: its dq product, which rounds h to 16 bits anyway (the same
values), and dg's Σ h ⊙ dh, where h then carries the forward's 16-bit rounding (a relative 2^-9 a term).
Dense sequences, or packed documents (B = 1) with fla's chunk tables planned on the host
(`chunk_tables`), so that no stage reads the boundaries back from the GPU as fla's own varlen path does.
Shapes as fla names them: q, k, g [B, T, H, K], v [B, T, H, V], h0 and ht [B or N documents, H, K, V].
"""
from __future__ import annotations

import torch

from . import fla_stages as fla
from .common import check_bwd_intra, varlen_chunk_tables
from .gla_bwd_intra import chunk_gla_bwd_dqk_intra
from .gla_fwd_intra import chunk_gla_fwd_A
from .zeco_stages import fla_chunk_size


def dqk_intra(q, k, g_cs, dA, BT: int, bwd_intra: str = "zeco", cu_seqlens=None, chunk_indices=None):
    """The intra-chunk parts of (dq, dk), fp32, by the chosen stage (one of BWD_INTRA); packed documents
    with fla's chunk table."""
    check_bwd_intra(bwd_intra)
    if bwd_intra in ("zeco", "zeco_chunk"):
        return chunk_gla_bwd_dqk_intra(q, k, g_cs, dA, BT, cu_seqlens=cu_seqlens, chunk_indices=chunk_indices,
                                       whole=bwd_intra == "zeco_chunk")
    return fla.chunk_gla_bwd_dqk_intra(q=q, k=k, g=g_cs, dA=dA, chunk_size=BT, cu_seqlens=cu_seqlens,
                                       chunk_indices=chunk_indices)


def fwd_A(q, k, g_cs, scale: float, BT: int, intra: str = "zeco", cu_seqlens=None, chunk_indices=None):
    """The forward's intra-chunk attention A [B, T, H, BT] fp32 by the intra stages chosen (one of BWD_INTRA):
    ours for "zeco_chunk", fla's otherwise; packed documents with fla's chunk table."""
    check_bwd_intra(intra)
    if intra == "zeco_chunk":
        return chunk_gla_fwd_A(q, k, g_cs, scale, BT, cu_seqlens=cu_seqlens, chunk_indices=chunk_indices)
    return fla.chunk_gla_fwd_intra_gk(q=q, k=k, g=g_cs, scale=scale, cu_seqlens=cu_seqlens, chunk_size=BT,
                                      chunk_indices=chunk_indices)


def _states(k, v, g_cs, h0, BT, packed, final: bool, fp32: bool):
    """(h [B, NT, H, K, V], final states or None): fla's chunk_fwd_h, dense or over the packed documents."""
    if packed is None:
        return fla.chunk_fwd_h(k=k, v=v, gk=g_cs, h0=h0, output_final_state=final, chunk_size=BT,
                               states_in_fp32=fp32)
    cu, _, co, NT = packed
    return fla.chunk_fwd_h_packed(k, v, g_cs, h0, cu_seqlens=cu, chunk_offsets=co, n_chunks=NT, chunk_size=BT,
                                  output_final_state=final, states_in_fp32=fp32)


def staged_fwd(q, k, v, g, scale: float, h0, output_final_state: bool, packed, intra: str = "zeco",
               save_h: bool = False):
    """The forward stages on contiguous inputs: (o, final state(s) or None, A, g_cs or None, h or None). A
    [B, T, H, BT] fp32 is the intra-chunk attention the backward reuses (by the stage `intra` picks: fwd_A);
    g_cs (the fp32 gate cumsum) is kept only when g is fp32 (as fla: it then costs no more memory than g), else
    the backward recomputes it; h [B, NT, H, K, V] (k's dtype) is returned for the backward when save_h."""
    BT = fla_chunk_size(q.shape[1])
    cu, ci = (None, None) if packed is None else packed[:2]
    g_cs = fla.gate_cumsum(g, BT, cu, ci)
    h, ht = _states(k, v, g_cs, h0, BT, packed, output_final_state, fp32=False)
    A = fwd_A(q, k, g_cs, scale, BT, intra, cu_seqlens=cu, chunk_indices=ci)
    o = fla.chunk_gla_fwd_o_gk(q=q, v=v, g=g_cs, A=A, h=h, scale=scale, cu_seqlens=cu, chunk_size=BT,
                               chunk_indices=ci)
    return o, ht, A, g_cs if g.dtype == torch.float else None, h if save_h else None


def staged_bwd(q, k, v, g, g_cs, h0, A, do, dht, scale: float, bwd_intra: str, packed, h=None):
    """The backward stages: (dq, dk, dv, dg, dh0) from staged_fwd's inputs and saved tensors (g_cs None:
    recomputed from g; h None: recomputed in fp32) and the gradients of o and of the final state(s) (dht None:
    zero)."""
    BT = fla_chunk_size(q.shape[1])
    cu, ci = (None, None) if packed is None else packed[:2]
    vl = dict(cu_seqlens=cu, chunk_size=BT, chunk_indices=ci)
    do = do.contiguous()
    dht = None if dht is None else dht.contiguous()  # e.g. ht.sum()'s gradient: ones expanded, stride 0
    if g_cs is None:
        g_cs = fla.gate_cumsum(g, BT, cu, ci)
    if h is None:
        h, _ = _states(k, v, g_cs, h0, BT, packed, final=False, fp32=True)
    if packed is None:
        dh, dh0 = fla.chunk_bwd_dh(q=q, k=k, v=v, do=do, h0=h0, dht=dht, scale=scale, gk=g_cs, chunk_size=BT,
                                   states_in_fp32=True)
    else:
        dh, dh0 = fla.chunk_bwd_dh_packed(q, k, v, do, dht, g_cs, h0=h0, scale=scale, cu_seqlens=cu,
                                          chunk_offsets=packed[2], n_chunks=packed[3], chunk_size=BT)
    dv = fla.chunk_gla_bwd_dv(k=k, g=g_cs, A=A, do=do, dh=dh, **vl)
    dA = fla.chunk_gla_bwd_dA(v=v, do=do, scale=scale, **vl)
    dq, dk = dqk_intra(q, k, g_cs, dA, BT, bwd_intra, cu_seqlens=cu, chunk_indices=ci)
    g_dtype = (g if g is not None else g_cs).dtype  # g is None when its fp32 cumsum was kept instead
    dq, dk, dg = fla.chunk_gla_bwd_dqkg_to(q=q, k=k, v=v, h=h, g=g_cs, do=do, dh=dh, dq=dq, dk=dk, scale=scale,
                                           dtypes=(q.dtype, k.dtype, g_dtype), **vl)
    return dq, dk, dv.to(v), dg, dh0


class ChunkGLA(torch.autograd.Function):
    """packed: None (dense) or (cu_seqlens, chunk_indices, chunk_offsets, NT) for chunk size BT."""

    @staticmethod
    def forward(ctx, q, k, v, g, scale, h0, output_final_state, bwd_intra, packed, save_h):
        # fla's kernels assume contiguous tensors (fla's own wrapper makes every input so)
        q, k, v, g = (t.contiguous() for t in (q, k, v, g))
        h0 = None if h0 is None else h0.contiguous()
        o, ht, A, g_cs, h = staged_fwd(q, k, v, g, scale, h0, output_final_state, packed, bwd_intra, save_h)
        ctx.save_for_backward(q, k, v, None if g_cs is not None else g, g_cs, h0, A, h)
        ctx.scale, ctx.bwd_intra, ctx.packed = scale, bwd_intra, packed
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, g, g_cs, h0, A, h = ctx.saved_tensors
        dq, dk, dv, dg, dh0 = staged_bwd(q, k, v, g, g_cs, h0, A, do, dht, ctx.scale, ctx.bwd_intra, ctx.packed, h)
        return dq, dk, dv, dg, None, dh0, None, None, None, None


def chunk_gla_staged(q, k, v, g, *, scale=None, initial_state=None, output_final_state=False,
                     bwd_intra: str = "zeco", cu_seqlens=None, chunk_tables=None, save_h: bool = False):
    """fla's chunk_gla contract: (o [B, T, H, V], final state(s) or None). Packed documents: cu_seqlens
    (a long tensor on q's device) and `chunk_tables(BT) -> (chunk_indices, chunk_offsets, NT)` planned on
    the host (lingua_zeco.sp.varlen.LocalSegments.chunk_index); without it they are planned here from
    cu_seqlens, which reads it back once. save_h: keep the forward's states for the backward (module doc)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    packed = None
    if cu_seqlens is not None:
        BT = fla_chunk_size(q.shape[1])
        tables = (chunk_tables(BT) if chunk_tables is not None
                  else varlen_chunk_tables([int(b) for b in cu_seqlens.tolist()], BT, q.device))
        packed = (cu_seqlens, *tables)
    return ChunkGLA.apply(q, k, v, g, scale, initial_state, output_final_state, bwd_intra, packed, save_h)


__all__ = ["ChunkGLA", "chunk_gla_staged", "dqk_intra", "fwd_A", "staged_bwd", "staged_fwd"]
