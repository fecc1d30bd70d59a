"""LASP-1: the serial hand-over of the state from rank to rank (GLA and the gated delta rule alike).

Rank p waits for S_in from rank p−1, runs its slice from it with the whole kernel and sends its final
state S_out on to rank p+1; the backward hands ∂L/∂S_out back the same way. The ranks run one after
another: nothing overlaps (the baseline the paper measures against).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from lingua_zeco.comm import global_rank, group_rank_size
from lingua_zeco.kernels import acc_dtype

from .varlen import LocalSegments


class RecvPrevFn(torch.autograd.Function):
    """Forward: wait for the previous rank's final state; backward: send it its gradient.
    The inputs q, k, v, g, ... only tie this node into the graph so that its backward runs."""

    @staticmethod
    def forward(ctx, shape, group, *anchors):
        rank, _ = group_rank_size(group)
        S_BHKV = anchors[0].new_zeros(shape, dtype=acc_dtype(anchors[0].dtype))  # the sender's S_out dtype
        if rank > 0:
            dist.recv(S_BHKV, src=global_rank(group, rank - 1), group=group)
        ctx.group, ctx.rank, ctx.n = group, rank, len(anchors)
        return S_BHKV

    @staticmethod
    def backward(ctx, dS_BHKV):
        if ctx.rank > 0:
            dist.send(dS_BHKV.to(acc_dtype(dS_BHKV.dtype)).contiguous(), dst=global_rank(ctx.group, ctx.rank - 1),
                      group=ctx.group)
        return (None, None) + (None,) * ctx.n


class SendNextFn(torch.autograd.Function):
    """Send the final state on; pass o through. Backward: receive ∂L/∂S_out from the next rank."""

    @staticmethod
    def forward(ctx, o_BTHV, S_out_BHKV, group):
        rank, P = group_rank_size(group)
        if rank < P - 1:
            dist.send(S_out_BHKV.to(acc_dtype(S_out_BHKV.dtype)).contiguous(), dst=global_rank(group, rank + 1),
                      group=group)
        ctx.group, ctx.rank, ctx.P = group, rank, P
        ctx.shape, ctx.dtype = S_out_BHKV.shape, S_out_BHKV.dtype
        return o_BTHV.view_as(o_BTHV)

    @staticmethod
    def backward(ctx, do_BTHV):
        G_BHKV = do_BTHV.new_zeros(ctx.shape, dtype=acc_dtype(ctx.dtype))
        if ctx.rank < ctx.P - 1:
            dist.recv(G_BHKV, src=global_rank(ctx.group, ctx.rank + 1), group=ctx.group)
        return do_BTHV, G_BHKV.to(ctx.dtype), None


def lasp1(kernel, q_BTHK, k_BTHK, v_BTHV, *gates, scale, group, seg: LocalSegments):
    """This rank's slice under LASP-1. `kernel`: a backend call with fla's contract (GLAOptions.chunk_gla, the
    gated delta rule's); `gates`: its per-token inputs after v (g; or g and beta)."""
    B, _, H, K = q_BTHK.shape
    S_in_BHKV = RecvPrevFn.apply((B, H, K, v_BTHV.shape[-1]), group, q_BTHK, k_BTHK, v_BTHV, *gates)
    h0_NHKV = S_in_BHKV
    if seg.cu_seqlens is not None:
        # one initial state per local document: only the first may continue from the previous rank
        first_1HKV = S_in_BHKV if seg.continues else S_in_BHKV * 0  # keep S_in in the graph: its backward sends
        h0_NHKV = torch.cat([first_1HKV, first_1HKV.new_zeros(seg.n_segments - 1, *first_1HKV.shape[1:])])
    o_BTHV, S_out_NHKV = kernel(q_BTHK, k_BTHK, v_BTHV, *gates, scale=scale, initial_state=h0_NHKV,
                                output_final_state=True, cu_seqlens=seg.cu_seqlens)
    S_out_BHKV = S_out_NHKV[-1:] if seg.cu_seqlens is not None else S_out_NHKV
    return SendNextFn.apply(o_BTHV, S_out_BHKV, group)
