"""The building blocks of every exclusive scan over the ranks of a process group (no autograd).

Rank p holds a state x_p [..., K, V] and the transition a_p that carries a state across its slice.
The exclusive scan hands rank p the state entering its slice,

    y_0 = 0,   y_{p+1} = a_p·y_p + x_p       (y_p = Σ_{r<p} a_{p−1}⋯a_{r+1}·x_r),

and the pair combine (a₁, x₁) then (a₂, x₂) = (a₂a₁, a₂·x₁ + x₂) is associative for both transitions
(`Transition`): DECAY, a [..., K] acting row by row (GLA: the product of the slice's forget gates),
and MATRIX, A [..., K, K] acting by A @ y (the gated delta rule). Three ways to compute it, for either:
* chain_scan   p−1 → p → p+1 (the paper's All-Scan): x is cut into blocks that the transition keeps
               independent, and a rank forwards block j while block j+1 is still in flight;
* tree_scan    Hillis–Steele, ceil(log2 P) rounds of pairwise exchange at distance 1, 2, 4, ...;
* gather_scan  LASP-2's: one all-gather of every rank's pair, then the local fold (local_scan).
Ranks are walked in scan order: `pos` is this rank's position, `peer(pos)` the global rank there
(scan_position; reverse=True walks the group backwards, as the backward pass needs).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist


def group_rank_size(group) -> tuple[int, int]:
    """(this rank's index in `group`, the group's size); (0, 1) without a process group."""
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def global_rank(group, group_rank: int) -> int:
    """The global rank of `group`'s rank `group_rank` (group None or WORLD: the same number)."""
    if group is None or group is dist.group.WORLD:
        return group_rank
    return dist.get_global_rank(group, group_rank)


def scan_position(group, rank: int, P: int, reverse: bool):
    """(pos, peer): the position of `group`'s rank `rank` in scan order, and position → global rank."""
    def peer(p):
        return global_rank(group, P - 1 - p if reverse else p)
    return (P - 1 - rank if reverse else rank), peer


@dataclass(frozen=True)
class Transition:
    """How a rank's transition a acts on a state y [..., K, V] and composes with the next rank's."""
    apply: Callable       # (a, y) -> a·y
    then: Callable        # (a_earlier, a_later) -> a_later·a_earlier, both slices in a row
    adjoint: Callable     # a -> aᵀ: the transition of the reverse scan of gradients
    grad_a: Callable      # (E, y) -> ∂L/∂a, given E = ∂L/∂(a·y + x)
    a_shape: Callable     # x's shape -> the shape a must have
    a_doc: str
    chain_dim: int        # the dim of x whose blocks a keeps independent: the chain cuts x along it
    chain_part: Callable  # (a, start, end) -> what of a acts on x's block [start, end) along chain_dim
    hier: bool            # whether the hierarchical all_scan is built for it
    tree_sends_a: bool    # whether the α–β model counts a's bytes in a tree round (K decays beside K×V: no)


DECAY = Transition(apply=lambda a, y: a[..., None] * y, then=lambda e, l: e * l, adjoint=lambda a: a,
                   grad_a=lambda E, y: (E * y).sum(-1), a_shape=lambda s: s[:-1], a_doc="[..., K]",
                   chain_dim=-2, chain_part=lambda a, s, e: a[..., s:e], hier=True, tree_sends_a=False)
MATRIX = Transition(apply=lambda A, y: A @ y, then=lambda E, L: L @ E, adjoint=lambda A: A.transpose(-1, -2),
                    grad_a=lambda E, y: E @ y.transpose(-1, -2), a_shape=lambda s: (*s[:-1], s[-2]),
                    a_doc="[..., K, K]", chain_dim=-1, chain_part=lambda A, s, e: A, hier=False,
                    tree_sends_a=True)


def check_pair(where: str, x: torch.Tensor, a: torch.Tensor, transition: Transition) -> None:
    if x.dim() < 2 or a.shape != transition.a_shape(x.shape):
        raise ValueError(f"{where}: x must be [..., K, V] and a {transition.a_doc}; got x {tuple(x.shape)}, "
                         f"a {tuple(a.shape)}")
    if x.dtype != a.dtype or not x.is_floating_point():
        raise ValueError(f"{where}: x and a must share one floating dtype (fp32 advised); got {x.dtype}, {a.dtype}")


def split_blocks(n: int, n_blocks: int) -> list[tuple[int, int]]:
    """[start, end) of n_blocks near-equal blocks of range(n) (clamped to 1..n blocks)."""
    m = max(1, min(int(n_blocks), n))
    edges = [round(i * n / m) for i in range(m + 1)]
    return [(s, e) for s, e in zip(edges[:-1], edges[1:]) if e > s]


def chain_scan(x, a, group, pos: int, P: int, peer, n_blocks: int, transition: Transition = DECAY):
    """The chain, pipelined in blocks: position p receives y_p block by block and, as each block
    arrives, sends that block of x_p + a_p·y_p (of x_p alone at p = 0) on to p + 1, so hop p+1 starts
    before hop p has finished. Returns y_p (zeros at p = 0)."""
    d = transition.chain_dim % x.dim()
    spans = split_blocks(x.shape[d], n_blocks)
    y = torch.zeros_like(x)
    recvs = []
    if pos > 0:
        recvs = [(buf, dist.irecv(buf, src=peer(pos - 1), group=group))
                 for buf in (x.new_empty(x.narrow(d, s, e - s).shape) for s, e in spans)]
    sends = []
    for j, (s, e) in enumerate(spans):
        x_blk = x.narrow(d, s, e - s)
        if recvs:
            y_blk, work = recvs[j]
            work.wait()
            y.narrow(d, s, e - s).copy_(y_blk)
            x_blk = x_blk + transition.apply(transition.chain_part(a, s, e), y_blk)
        if pos < P - 1:
            blk = x_blk.contiguous()
            sends.append((blk, dist.isend(blk, dst=peer(pos + 1), group=group)))
    for _, work in sends:
        work.wait()
    return y


def tree_scan(x, a, group, pos: int, P: int, peer, transition: Transition = DECAY):
    """Hillis–Steele (any P: missing partners are skipped). A position keeps the inclusive pair of
    the positions (pos−d, pos] and the exclusive pair of (pos−d, pos); the round at distance d sends
    the inclusive pair to pos + d and composes the one received from pos − d (earlier) onto both.
    Returns y_p (zeros at p = 0)."""
    def compose(earlier, later):
        (ea, ex), (la, lx) = earlier, later
        return transition.then(ea, la), transition.apply(la, ex) + lx

    inc, exc, d = (a, x), None, 1
    while d < P:
        ops, recv = [], None
        if pos + d < P:
            msg = torch.cat([t.reshape(-1) for t in inc])
            ops.append(dist.P2POp(dist.isend, msg, peer(pos + d), group))
        if pos - d >= 0:
            recv = inc[0].new_empty(sum(t.numel() for t in inc))
            ops.append(dist.P2POp(dist.irecv, recv, peer(pos - d), group))
        for work in dist.batch_isend_irecv(ops) if ops else []:
            work.wait()
        if recv is not None:  # the received segment (pos−2d, pos−d] lies before ours
            got = tuple(part.view_as(t) for part, t in zip(recv.split([t.numel() for t in inc]), inc))
            exc = got if exc is None else compose(got, exc)
            inc = compose(got, inc)
        d *= 2
    return torch.zeros_like(x) if exc is None else exc[1]


def local_scan(pairs, like: torch.Tensor, transition: Transition = DECAY) -> torch.Tensor:
    """Fold (a, x) pairs, earliest first, from a zero state shaped like `like`: y ← a·y + x."""
    y = torch.zeros_like(like)
    for a, x in pairs:
        y = transition.apply(a, y) + x
    return y


def gather_scan(x: torch.Tensor, a: torch.Tensor, group=None, reverse: bool = False,
                transition: Transition = DECAY) -> torch.Tensor:
    """LASP-2's way to the same exclusive scan: one all-gather of every rank's [x | a], then the fold
    of the earlier ranks' pairs (the later ones with reverse=True). One collective of P pairs: fewer
    latency hops than the chain, P times its volume and memory."""
    check_pair("gather_scan", x, a, transition)
    group = group if group is not None else dist.group.WORLD
    rank, P = dist.get_rank(group), dist.get_world_size(group)
    msg = torch.cat([x.reshape(-1), a.reshape(-1)])
    every = msg.new_empty(P * msg.numel())  # flat: gloo accepts no [P, n] output
    dist.all_gather_into_tensor(every, msg, group=group)
    every = every.view(P, -1)
    xs, as_ = every[:, :x.numel()].view(P, *x.shape), every[:, x.numel():].view(P, *a.shape)
    order = range(P - 1, rank, -1) if reverse else range(rank)
    with torch.autocast(x.device.type, enabled=False):  # autocast would run A @ y in bf16
        return local_scan(((as_[r], xs[r]) for r in order), x, transition)
