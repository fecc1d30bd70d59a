"""Autograd wrappers for passing recurrent states between the ranks of an SP group.

* AllScanFn        ZeCO: forward All-Scan; backward the reverse All-Scan of the gradient.
* all_gather_scan  LASP-2: all-gather every rank's (decay, state), scan locally.
* RecvPrevFn / SendNextFn  LASP-1: blocking hand-over to the next rank, gradients handed back.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from lingua_zeco.comm import AllScanArgs, all_scan


def group_rank_size(group):
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _acc(dtype):
    """Exchange dtype of states and their gradients: fp32 at least (fp64 stays fp64)."""
    return torch.promote_types(dtype, torch.float32)


def _global(group, r):
    return dist.get_global_rank(group, r) if group is not None and group is not dist.group.WORLD else r


class AllScanFn(torch.autograd.Function):
    """y_p = Σ_{r<p} (Π_{r<j<p} a_j) x_r.  With G_p = ∂L/∂(a_p y_p + x_p), the backward is
    G = reverse scan of dy, ∂L/∂x_p = G_p and ∂L/∂a_p = Σ_V G_p ⊙ y_p."""

    @staticmethod
    def forward(ctx, x_BHKV, a_BHK, group, args: AllScanArgs):
        y_BHKV = all_scan(x_BHKV, a_BHK, group, args=args)
        ctx.save_for_backward(a_BHK, y_BHKV)
        ctx.group, ctx.args = group, args
        return y_BHKV

    @staticmethod
    def backward(ctx, dy_BHKV):
        a_BHK, y_BHKV = ctx.saved_tensors
        G_BHKV = all_scan(dy_BHKV.to(a_BHK.dtype).contiguous(), a_BHK, ctx.group, reverse=True, args=ctx.args)
        return G_BHKV, (G_BHKV * y_BHKV).sum(-1), None, None


class _AllGatherFn(torch.autograd.Function):
    """Stack every rank's tensor; the backward sums the gradients of this rank's slice over ranks."""

    @staticmethod
    def forward(ctx, t, group):
        rank, P = group_rank_size(group)
        parts = [torch.empty_like(t) for _ in range(P)]
        dist.all_gather(parts, t.contiguous(), group=group)
        ctx.group, ctx.rank = group, rank
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, d_stack):
        d_stack = d_stack.contiguous()
        if dist.get_backend(ctx.group) == "nccl":
            out = torch.empty_like(d_stack[0])
            dist.reduce_scatter_tensor(out, d_stack, group=ctx.group)
            return out, None
        dist.all_reduce(d_stack, group=ctx.group)  # gloo has no reduce-scatter
        return d_stack[ctx.rank], None


def all_gather_scan(x_BHKV, a_BHK, group):
    """LASP-2: every rank receives all P states and decays and scans the ones before it locally."""
    rank, _ = group_rank_size(group)
    xs = _AllGatherFn.apply(x_BHKV, group)
    as_ = _AllGatherFn.apply(a_BHK, group)
    # Start from 0·(stack) rather than zeros: every rank's graph must hold both gathers, because
    # their backward is a collective that all ranks have to enter (rank 0 uses no other state).
    y_BHKV = 0 * (as_[0][..., None] * xs[0])
    for r in range(rank):
        y_BHKV = as_[r][..., None] * y_BHKV + xs[r]
    return y_BHKV


class RecvPrevFn(torch.autograd.Function):
    """LASP-1 forward: wait for the previous rank's final state; backward: send it its gradient.
    The inputs q, k, v, g only tie this node into the graph so that its backward runs."""

    @staticmethod
    def forward(ctx, shape, group, *anchors):
        rank, _ = group_rank_size(group)
        S = anchors[0].new_zeros(shape, dtype=_acc(anchors[0].dtype))  # the sender's S_out dtype
        if rank > 0:
            dist.recv(S, src=_global(group, rank - 1), group=group)
        ctx.group, ctx.rank, ctx.n = group, rank, len(anchors)
        return S

    @staticmethod
    def backward(ctx, dS):
        if ctx.rank > 0:
            dist.send(dS.to(_acc(dS.dtype)).contiguous(), dst=_global(ctx.group, ctx.rank - 1), group=ctx.group)
        return (None, None) + (None,) * ctx.n


class SendNextFn(torch.autograd.Function):
    """LASP-1: send the final state on; pass o through. Backward: receive ∂L/∂S_out from the next rank."""

    @staticmethod
    def forward(ctx, o, S_out, group):
        rank, P = group_rank_size(group)
        if rank < P - 1:
            dist.send(S_out.to(_acc(S_out.dtype)).contiguous(), dst=_global(group, rank + 1), group=group)
        ctx.group, ctx.rank, ctx.P = group, rank, P
        ctx.shape, ctx.dtype = S_out.shape, S_out.dtype
        return o.view_as(o)

    @staticmethod
    def backward(ctx, do):
        G = do.new_zeros(ctx.shape, dtype=_acc(ctx.dtype))
        if ctx.rank < ctx.P - 1:
            dist.recv(G, src=_global(ctx.group, ctx.rank + 1), group=ctx.group)
        return do, G.to(ctx.dtype), None
