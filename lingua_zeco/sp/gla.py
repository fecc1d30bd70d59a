"""GLA across an SP group: sp_gla (a gate per key), sp_simple_gla (one decay per head and token) and
sp_gla_carry (either, from a carried incoming state, returning the final state; carry.py). The package
docstring (lingua_zeco/sp/__init__.py) lists the methods; `sp` (SPContext) carries every setting."""
from __future__ import annotations

import torch

from lingua_zeco import kernels

from .carry import add_carried, one_rank_carry
from .context import SPContext
from .graph import outside_graph
from .lasp1 import lasp1
from .reference import scan_then_correct
from .validate import check_across_ranks, check_local
from .varlen import as_packing, local_segments

_DEFAULT = SPContext()


def sp_gla(q, k, v, g, *, sp: SPContext | None = None, scale: float | None = None, cu_seqlens=None):
    """q, k, g [B, T_local, H, K]; v [B, T_local, H, V]; g = log forget gate (≤ 0). Returns o [B, T_local, H, V].
    sp: the group, method, All-Scan settings and operator options (None: SPContext(), ZeCO over the default
    group). cu_seqlens: None (one sequence), the boundaries of the whole packed sequence (a tensor or ints, the
    same on every rank; planned on every call), or the step's `Packing` from `pack` (planned once).
    Inside torch.compile: one dense sequence on one rank is the opaque custom op kernels.chunk_gla_op (no
    graph break); the exchange with other ranks and packed documents run outside the graph (one break)."""
    sp = sp or _DEFAULT
    if (torch.compiler.is_compiling() and cu_seqlens is None and sp.rank_size[1] == 1
            and sp.gla.backend in (None, kernels.pick_backend(q.device))):
        check_local(q, k, v, g, sp.method, None, 1)  # shapes and dtypes: decided while tracing
        return kernels.chunk_gla_op(q, k, v, g, scale=scale, save_h=sp.gla.save_h)
    return _sp_gla(q, k, v, g, sp, scale, cu_seqlens)


@outside_graph
def _sp_gla(q, k, v, g, sp: SPContext, scale, cu_seqlens):
    rank, P = sp.rank_size
    packing = as_packing(cu_seqlens, rank=rank, P=P, T_local=q.shape[1], device=q.device)
    check_local(q, k, v, g, sp.method, packing, P)
    check_across_ranks(q, v, g, packing, sp.group, P)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    # the step's LocalSegments: its boundaries leave zero-length documents out (the same output) and its chunk
    # tables are planned once per step for every layer
    seg = local_segments(None, rank, q.shape[1], q.device) if packing is None else packing.seg
    if P == 1:  # nothing to exchange: every method is plain GLA
        return sp.gla.chunk_gla(q, k, v, g, scale=scale, cu_seqlens=seg)[0]
    if sp.method == "lasp1":
        return lasp1(sp.gla.chunk_gla, q, k, v, g, scale=scale, group=sp.group, seg=seg)
    if sp.method == "local":  # diagnostic: no state passing at all (wrong on purpose; never a default)
        return sp.gla.chunk_gla(q, k, v, g, scale=scale, cu_seqlens=seg)[0]
    # fla's stages reordered around the exchange: dense slices and slices inside one document take
    # fused_zeco's operator, slices where a document starts fused_packed's
    if sp.fused and kernels.pick_backend(q.device, sp.gla.backend) == "fla":
        from .fused_zeco import fused_zeco_apply  # imports fla's stages
        return fused_zeco_apply(q, k, v, g, scale, sp, seg)
    return scan_then_correct(q, k, v, g, scale=scale, sp=sp, seg=seg)


@outside_graph  # fla's kernel or the exchange
def sp_simple_gla(q, k, v, g, *, sp: SPContext | None = None, scale: float | None = None, cu_seqlens=None):
    """Scalar-decay GLA (RetNet style, fla's chunk_simple_gla): g [B, T_local, H], one log decay per
    head and token. Its transition diag(exp(g)·1) is GLA's with the decay broadcast over K, so the
    same exchange is exact: one K×V state per head, the same All-Scan operator (the scanned decay
    a = b_end is constant over K). P = 1 runs the variant's own kernel (fla's chunk_simple_gla on
    CUDA); P > 1 runs sp_gla on the broadcast gate (a [B, T, H, K] view; dg sums over K by autograd)."""
    sp = sp or _DEFAULT
    if g.dim() != 3 or g.shape != q.shape[:3]:
        raise ValueError(f"sp_simple_gla: g must be [B, T_local, H] = {tuple(q.shape[:3])}, got {tuple(g.shape)}")
    rank, P = sp.rank_size
    if P == 1:
        packing = as_packing(cu_seqlens, rank=rank, P=P, T_local=q.shape[1], device=q.device)
        check_local(q, k, v, g[..., None].expand_as(q), sp.method, packing, 1)
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        seg = None if packing is None else packing.seg  # zero-length documents left out, as in sp_gla
        return sp.gla.chunk_simple_gla(q, k, v, g, scale=scale, cu_seqlens=seg)[0]
    return sp_gla(q, k, v, g[..., None].expand_as(q), sp=sp, scale=scale, cu_seqlens=cu_seqlens)


def sp_gla_carry(q, k, v, g, S0, *, sp: SPContext | None = None, scale: float | None = None, cu_seqlens=None):
    """sp_gla (g [B, T_local, H, K]) or sp_simple_gla (g [B, T_local, H]) from the incoming state S0
    [B, H, K, V] (None: zeros) of the whole group's segment. Returns (o, S_end): S_end [B, H, K, V] (fp32 at
    least) the state after the segment's last token, on every rank. Packed documents (B = 1): S0 enters the
    first document, S_end is the last one's (lingua_zeco/sp/carry.py)."""
    sp = sp or _DEFAULT
    rank, P = sp.rank_size
    packing = as_packing(cu_seqlens, rank=rank, P=P, T_local=q.shape[1], device=q.device)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if P == 1:
        return one_rank_carry((q, k, v, g), S0, packing, scale, sp.gla)
    simple = g.dim() == 3
    o = (sp_simple_gla if simple else sp_gla)(q, k, v, g, sp=sp, scale=scale, cu_seqlens=packing)
    return add_carried((q, k, v, g[..., None].expand_as(q) if simple else g), S0, o, packing, scale, sp)
