"""GLA across an SP group: sp_gla (a gate per key), sp_simple_gla (one decay per head and token) and
sp_gla_carry (either, from a carried incoming state, returning the final state; carry.py). The package
docstring (lingua_zeco/sp/__init__.py) lists the methods."""
from __future__ import annotations

import torch

from lingua_zeco import kernels
from lingua_zeco.comm import AllScanArgs, group_rank_size

from .carry import add_carried, one_rank_carry
from .graph import outside_graph
from .lasp1 import lasp1
from .reference import scan_then_correct
from .split import segments_for, split_gla, split_gla_op
from .validate import check_across_ranks, check_local
from .varlen import as_packing, local_segments


def sp_gla(q, k, v, g, *, group=None, method: str = "zeco", scale: float | None = None, cu_seqlens=None,
           backend: str | None = None, fused: bool = True, scan: AllScanArgs | None = None,
           bwd_intra: str = "zeco", split: int = 1, save_h: bool = False):
    """q, k, g [B, T_local, H, K]; v [B, T_local, H, V]; g = log forget gate (≤ 0). Returns o [B, T_local, H, V].
    cu_seqlens: None (one sequence), the boundaries of the whole packed sequence (a tensor or ints, the
    same on every rank; planned on every call), or the step's `Packing` from `pack` (planned once).
    bwd_intra: the intra-chunk dq/dk stage of fla's backward, ours or fla's (kernels.BWD_INTRA), on one
    rank and on the fused dense paths.
    split: segments per sequence (or per rank's slice) run as one batch with the scan between them inside the
    GPU (sp/split.py; fla's stages, dense slices): 1 = off, 0 = auto (split_rule), S = S segments.
    save_h: the operator keeps the forward's chunk states h for the backward instead of recomputing them: on one
    rank (kernels/gla_chunk.py) and on the fused ZeCO / LASP-2 dense slices (S_in folded in, sp/fused_zeco.py);
    the split operator and slices where a packed document starts recompute theirs.
    Inside torch.compile: one dense sequence on one rank is the opaque custom op kernels.chunk_gla_op (no
    graph break); the exchange with other ranks and packed documents run outside the graph (one break)."""
    if (torch.compiler.is_compiling() and cu_seqlens is None and group_rank_size(group)[1] == 1
            and backend in (None, kernels.pick_backend(q.device))):
        check_local(q, k, v, g, method, None, 1)  # shapes and dtypes: decided while tracing
        S = segments_for(split, q, v) if q.is_cuda else 1
        if S > 1:
            return split_gla_op(q, k, v, g, scale=scale, segments=S, bwd_intra=bwd_intra)
        return kernels.chunk_gla_op(q, k, v, g, scale=scale, bwd_intra=bwd_intra, save_h=save_h)
    return _sp_gla(q, k, v, g, group=group, method=method, scale=scale, cu_seqlens=cu_seqlens, backend=backend,
                   fused=fused, scan=scan, bwd_intra=bwd_intra, split=split, save_h=save_h)


@outside_graph
def _sp_gla(q, k, v, g, *, group, method, scale, cu_seqlens, backend, fused, scan, bwd_intra, split, save_h):
    kernels.check_bwd_intra(bwd_intra)
    rank, P = group_rank_size(group)
    packing = as_packing(cu_seqlens, rank=rank, P=P, T_local=q.shape[1], device=q.device)
    check_local(q, k, v, g, method, packing, P)
    check_across_ranks(q, v, g, packing, group, P)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    name = kernels.pick_backend(q.device, backend)
    # the split operator takes dense slices: no boundary inside (a slice inside one document, or on one rank a
    # packed batch that is one document)
    one_doc = packing is None or packing.seg.carries or (P == 1 and packing.seg.n_segments == 1)
    split = segments_for(split, q, v) if name == "fla" and one_doc else 1
    if P == 1:  # nothing to exchange: every method is plain GLA
        if split > 1:
            return split_gla(q, k, v, g, scale=scale, segments=split, bwd_intra=bwd_intra)[0]
        if packing is None:
            return kernels.chunk_gla(q, k, v, g, scale=scale, backend=name, bwd_intra=bwd_intra, save_h=save_h)[0]
        seg = packing.seg  # its boundaries leave zero-length documents out (the same output) and its chunk
        # tables are planned once per step for every layer
        return kernels.chunk_gla(q, k, v, g, scale=scale, cu_seqlens=seg.cu_seqlens, chunk_tables=seg.chunk_index,
                                 backend=name, bwd_intra=bwd_intra, save_h=save_h)[0]
    seg = local_segments(None, rank, q.shape[1], q.device) if packing is None else packing.seg
    scan = scan or AllScanArgs()
    if method == "lasp1":
        return lasp1(kernels.chunk_gla, q, k, v, g, scale=scale, group=group, seg=seg, backend=name)
    if method == "local":  # diagnostic: no state passing at all (wrong on purpose; never a default)
        return kernels.chunk_gla(q, k, v, g, scale=scale, cu_seqlens=seg.cu_seqlens, backend=name)[0]
    # fla's stages reordered around the exchange: dense slices and slices inside one document take
    # fused_zeco's operator, slices where a document starts fused_packed's
    if method in ("zeco", "lasp2") and fused and name == "fla":
        from .fused_zeco import fused_zeco_apply, lasp2_scan_fn, zeco_scan_fn  # imports fla's stages
        scan_fn = lasp2_scan_fn(group) if method == "lasp2" else zeco_scan_fn(group, scan)
        if split > 1 and seg.carries:  # a dense slice (or one inside one document): its segments, then the ranks
            return split_gla(q, k, v, g, scale=scale, segments=split, scan_fn=scan_fn, bwd_intra=bwd_intra)[0]
        return fused_zeco_apply(q, k, v, g, scale, scan_fn, seg, bwd_intra, save_h)
    return scan_then_correct(q, k, v, g, scale=scale, group=group, method=method, seg=seg,
                             backend=name, scan_args=scan)


@outside_graph  # fla's kernel or the exchange
def sp_simple_gla(q, k, v, g, *, group=None, method: str = "zeco", scale: float | None = None, cu_seqlens=None,
                  backend: str | None = None, fused: bool = True, scan: AllScanArgs | None = None,
                  bwd_intra: str = "zeco"):
    """Scalar-decay GLA (RetNet style, fla's chunk_simple_gla): g [B, T_local, H], one log decay per
    head and token. Its transition diag(exp(g)·1) is GLA's with the decay broadcast over K, so the
    same exchange is exact: one K×V state per head, the same All-Scan operator (the scanned decay
    a = b_end is constant over K). P = 1 runs the variant's own kernel (fla's chunk_simple_gla on
    CUDA); P > 1 runs sp_gla on the broadcast gate (a [B, T, H, K] view; dg sums over K by autograd)."""
    if g.dim() != 3 or g.shape != q.shape[:3]:
        raise ValueError(f"sp_simple_gla: g must be [B, T_local, H] = {tuple(q.shape[:3])}, got {tuple(g.shape)}")
    rank, P = group_rank_size(group)
    if P == 1:
        packing = as_packing(cu_seqlens, rank=rank, P=P, T_local=q.shape[1], device=q.device)
        check_local(q, k, v, g[..., None].expand_as(q), method, packing, 1)
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        cu = None if packing is None else packing.seg.cu_seqlens  # zero-length documents left out, as in sp_gla
        return kernels.chunk_simple_gla(q, k, v, g, scale=scale, cu_seqlens=cu, backend=backend)[0]
    return sp_gla(q, k, v, g[..., None].expand_as(q), group=group, method=method, scale=scale,
                  cu_seqlens=cu_seqlens, backend=backend, fused=fused, scan=scan, bwd_intra=bwd_intra)


def sp_gla_carry(q, k, v, g, S0, *, group=None, method: str = "zeco", scale: float | None = None, cu_seqlens=None,
                 backend: str | None = None, fused: bool = True, scan: AllScanArgs | None = None,
                 bwd_intra: str = "zeco", split: int = 1, save_h: bool = False):
    """sp_gla (g [B, T_local, H, K]) or sp_simple_gla (g [B, T_local, H]) from the incoming state S0
    [B, H, K, V] (None: zeros) of the whole group's segment. Returns (o, S_end): S_end [B, H, K, V] (fp32 at
    least) the state after the segment's last token, on every rank. Packed documents (B = 1): S0 enters the
    first document, S_end is the last one's (lingua_zeco/sp/carry.py). split, save_h: as sp_gla's."""
    rank, P = group_rank_size(group)
    packing = as_packing(cu_seqlens, rank=rank, P=P, T_local=q.shape[1], device=q.device)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if P == 1:
        return one_rank_carry(q, k, v, g, S0, packing, scale, backend, bwd_intra, split, save_h)
    simple = g.dim() == 3
    sp = dict(group=group, method=method, scale=scale, cu_seqlens=packing, backend=backend, fused=fused, scan=scan,
              bwd_intra=bwd_intra)
    o = sp_simple_gla(q, k, v, g, **sp) if simple else sp_gla(q, k, v, g, split=split, save_h=save_h, **sp)
    return add_carried(q, k, v, g[..., None].expand_as(q) if simple else g, S0, o, packing, scale, group, rank, P)
