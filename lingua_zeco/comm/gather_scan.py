"""LASP-2's way to the same exclusive decay-scan: all-gather every rank's (x, a), scan locally.

One collective of P states instead of one state per rank: fewer latency hops than the chain, P
times its volume and memory. Same contract as all_scan (no autograd here).
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def gather_scan(x: torch.Tensor, a: torch.Tensor, group=None, reverse: bool = False) -> torch.Tensor:
    """y_p = Σ_{r<p} (Π_{r<j<p} a_j) x_r (r>p with reverse=True) from one all-gather of [x | a]."""
    if x.dim() < 2 or a.shape != x.shape[:-1]:
        raise ValueError(f"gather_scan: x must be [..., K, V] and a [..., K]; got {tuple(x.shape)}, {tuple(a.shape)}")
    group = group if group is not None else dist.group.WORLD
    rank, P = dist.get_rank(group), dist.get_world_size(group)
    msg = torch.cat([x.reshape(-1), a.reshape(-1).to(x.dtype)])
    every = msg.new_empty(P * msg.numel())  # flat: gloo accepts no [P, n] output
    dist.all_gather_into_tensor(every, msg, group=group)
    every = every.view(P, -1)
    xs, as_ = every[:, :x.numel()].view(P, *x.shape), every[:, x.numel():].view(P, *a.shape)
    order = range(P - 1, rank, -1) if reverse else range(rank)
    y = torch.zeros_like(x)
    for r in order:
        y = as_[r][..., None] * y + xs[r]
    return y
