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
Ranks are walked in scan order by a link (P2PLink here, SymmLink in symm.py): `link.pos` is this
rank's position (ScanOrder; reverse=True walks the group backwards, as the backward pass needs).
Cost per hop: what a rank sends, stages and folds lives in persistent scratch buffers (buffers.py, with
their lifetime rule); every combine a·y + x is one fused op written in place (addcmul / baddbmm); the
result is the only tensor a call allocates.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from .buffers import scratch


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


def _mm3(t: torch.Tensor) -> torch.Tensor:
    """[..., K, V] as a batch of matrices [B, K, V] (a view for the layouts the scans use)."""
    return t.reshape(-1, t.shape[-2], t.shape[-1])


def _decay_combine_into(x, a, y, out):  # out = a ⊙ y + x, one fused elementwise op
    return torch.addcmul(x, a[..., None], y, out=out)


def _matrix_combine_into(x, A, y, out):  # out = A @ y + x, one batched GEMM with bias
    torch.baddbmm(_mm3(x), _mm3(A), _mm3(y), out=_mm3(out))
    return out


def _decay_then_(acc, got, tmp):  # acc ← acc·got (acc the later slice's decay)
    return acc.mul_(got)


def _matrix_then_(acc, got, tmp):  # acc ← acc @ got; a GEMM cannot write over its input: via tmp
    torch.matmul(acc, got, out=tmp)
    return acc.copy_(tmp)


@dataclass(frozen=True)
class Transition:
    """How a rank's transition a acts on a state y [..., K, V] and composes with the next rank's."""
    apply: Callable       # (a, y) -> a·y
    adjoint: Callable     # a -> aᵀ: the transition of the reverse scan of gradients
    grad_a: Callable      # (E, y) -> ∂L/∂a, given E = ∂L/∂(a·y + x)
    a_shape: Callable     # x's shape -> the shape a must have
    a_doc: str
    hier: bool            # whether the hierarchical all_scan is built for it
    tree_sends_a: bool    # whether the α–β model counts a's bytes in a tree round (K decays beside K×V: no)
    combine_into: Callable = _decay_combine_into  # (x, a, y, out) -> out = a·y + x, in one op
    then_: Callable = _decay_then_                # (acc, got, tmp) -> acc = acc·got in place
    # whether every row of x (all dims but V) is independent, so the chain cuts x into flat rows and a
    # block of rows takes the same rows of a; else (A mixes K) it cuts x along V and every block takes A
    rows: bool = True


DECAY = Transition(apply=lambda a, y: a[..., None] * y, adjoint=lambda a: a, grad_a=lambda E, y: (E * y).sum(-1),
                   a_shape=lambda s: s[:-1], a_doc="[..., K]", hier=True, tree_sends_a=False)
MATRIX = Transition(apply=lambda A, y: A @ y, adjoint=lambda A: A.transpose(-1, -2),
                    grad_a=lambda E, y: E @ y.transpose(-1, -2), a_shape=lambda s: (*s[:-1], s[-2]),
                    a_doc="[..., K, K]", hier=False, tree_sends_a=True, combine_into=_matrix_combine_into,
                    then_=_matrix_then_, rows=False)


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


def issue(ops: list) -> list:
    """Post P2P ops (fn, tensor, global peer, group) with as few calls as the transport allows: one op
    directly, several as one batch_isend_irecv (NCCL: one grouped launch). Returns the works to wait on.
    (NCCL: a batch must not be a group's very first collective unless every rank joins it; the
    trainer's groups have made collectives before the first scan.)"""
    if len(ops) == 1:
        fn, t, peer, group = ops[0]
        return [fn(t, peer, group=group)]
    return dist.batch_isend_irecv([dist.P2POp(fn, t, peer, group) for fn, t, peer, group in ops]) if ops else []


def wait_all(works) -> None:
    """Wait for every work of a batch of point-to-point ops."""
    for w in works:
        w.wait()


class ScanOrder:
    """`group`'s ranks in scan order: `pos` is the position of group rank `rank`, rank_at(off) the group
    rank `off` positions away (None past either end). The base of both links."""

    def __init__(self, group, rank: int, P: int, reverse: bool):
        self.group, self.P, self.reverse = group, P, reverse
        self.pos = P - 1 - rank if reverse else rank

    def rank_at(self, off: int):
        p = self.pos + off
        if not 0 <= p < self.P:
            return None
        return self.P - 1 - p if self.reverse else p


class P2PLink(ScanOrder):
    """The scan order over `group` carried by torch.distributed point-to-point ops (NCCL on GPUs, gloo on
    CPUs): transport="nccl". A link is what chain_scan and tree_scan need from a transport; the other one
    is comm/symm.py's SymmLink (one-sided puts into the next rank's symmetric memory).

    Chain: fused_chain(x, a, y) may do a whole one-block decay hop at once (True) or decline (False);
    otherwise open_chain(y) before anything else; a block is a view of y (the result); send_first posts
    x's blocks at position 0, recv waits for one block and returns the tensor holding it, send_slot
    is where a block's combine writes what goes out, send posts it, close ends the call.
    Tree: exchange(d, inc) sends inc to pos + d and receives the same shape from pos − d (None where
    there is no such position); release(d) says the received tensor was consumed."""

    def _at(self, off: int):  # global rank `off` positions away, None past either end
        r = self.rank_at(off)
        return None if r is None else global_rank(self.group, r)

    def _scratch(self, tag, like):
        return scratch(tag, like.shape, like.dtype, like.device, self.group)

    def fused_chain(self, x_RV, a_R, y_RV) -> bool:
        return False

    def open_chain(self, y: torch.Tensor, blocks: list) -> None:
        """Post the receives of y's blocks (contiguous ones straight into y); at the last position all in
        one call, elsewhere one by one, so each block is waited for alone."""
        self._sends, self._slots, self._recvs = [], [], []
        if self.pos == 0:
            return
        self._slots = [b if b.is_contiguous() else self._scratch(f"chain_recv{j}", b) for j, b in enumerate(blocks)]
        src = self._at(-1)
        if self.pos == self.P - 1:
            self._recvs = issue([(dist.irecv, t, src, self.group) for t in self._slots])
        else:
            self._recvs = [dist.irecv(t, src=src, group=self.group) for t in self._slots]

    def send_first(self, x_blocks: list, y_blocks: list) -> None:
        blks = [b if b.is_contiguous() else self._scratch(f"chain_send{j}", b).copy_(b) for j, b in enumerate(x_blocks)]
        wait_all(issue([(dist.isend, b, self._at(1), self.group) for b in blks]))

    def recv(self, j: int) -> torch.Tensor:
        self._recvs[j].wait()
        return self._slots[j]

    def send_slot(self, j: int, y_block: torch.Tensor) -> torch.Tensor:
        return self._scratch(f"chain_send{j}", y_block)

    def send(self, j: int, t: torch.Tensor) -> None:
        self._sends.append(dist.isend(t, dst=self._at(1), group=self.group))

    def close(self) -> None:
        wait_all(self._sends)

    def exchange(self, d: int, inc: torch.Tensor):
        got = self._scratch("tree_recv", inc)
        dst, src = self._at(d), self._at(-d)
        wait_all(issue(([(dist.isend, inc, dst, self.group)] if dst is not None else [])
                       + ([(dist.irecv, got, src, self.group)] if src is not None else [])))
        return got if src is not None else None

    def release(self, d: int) -> None:
        pass


def chain_scan(x, a, link, n_blocks: int, transition: Transition = DECAY):
    """The chain, pipelined in blocks: position p receives y_p block by block and, as each block
    arrives, sends that block of x_p + a_p·y_p (of x_p alone at p = 0) on to p + 1, so hop p+1 starts
    before hop p has finished. Returns y_p (zeros at p = 0).

    Decays act row by row, so x [..., K, V] is cut along its flat rows: every block is contiguous and
    the P2P link receives it straight into the result. Matrix transitions mix K: x is cut along V."""
    pos, P = link.pos, link.P
    y = torch.empty_like(x)
    if transition.rows:  # rows of [..., K, V] are independent under decays: [R, V] with a [R]
        x_, a_, y_, d = x.view(-1, x.shape[-1]), a.reshape(-1), y.view(-1, x.shape[-1]), 0
    else:
        x_, a_, y_, d = x, a, y, x.dim() - 1
    spans = split_blocks(x_.shape[d], n_blocks)
    if P > 1 and transition.rows and len(spans) == 1 and link.fused_chain(x_, a_, y_):
        return y  # the link did the whole hop in one go
    if pos == 0:
        y.zero_()
    if P <= 1:
        return y
    y_blks = [y_.narrow(d, s, e - s) for s, e in spans]
    link.open_chain(y, y_blks)
    if pos == 0:  # nothing to combine: x's blocks go out at once
        link.send_first([x_.narrow(d, s, e - s) for s, e in spans], y_blks)
        link.close()
        return y
    for j, (s, e) in enumerate(spans):
        got = link.recv(j)
        if got is not y_blks[j]:
            y_blks[j].copy_(got)
        if pos < P - 1:
            out = link.send_slot(j, y_blks[j])
            a_blk = a_.narrow(0, s, e - s) if transition.rows else a_
            transition.combine_into(x_.narrow(d, s, e - s), a_blk, got, out)
            link.send(j, out)
    link.close()
    return y


def tree_scan(x, a, link, transition: Transition = DECAY):
    """Hillis–Steele (any P: missing partners are skipped). A position keeps the inclusive pair of
    the positions (pos−d, pos] and the exclusive pair of (pos−d, pos); the round at distance d sends
    the inclusive pair to pos + d and composes the one received from pos − d (earlier) onto both.
    One exchange per round; the aggregates live in scratch buffers and are folded in place, and only
    while a later round still needs them. Returns y_p (zeros at p = 0)."""
    pos, P = link.pos, link.P
    y = torch.empty_like(x)
    na, n = a.numel(), a.numel() + x.numel()

    def buf(tag, shape):
        return scratch(f"tree_{tag}", shape, x.dtype, x.device, link.group)

    inc = buf("inc", (n,))  # [a | x] flat: one message per round
    inc_a, inc_x = inc[:na].view_as(a), inc[na:].view_as(x)
    exc_a, tmp = buf("exc_a", a.shape), buf("tmp", a.shape)
    if pos + 1 < P:
        inc_a.copy_(a)
        inc_x.copy_(x)
    have, d = False, 1
    while d < P:
        got = link.exchange(d, inc)
        if got is not None:  # the received segment (pos−2d, pos−d] lies before ours
            got_a, got_x = got[:na].view_as(a), got[na:].view_as(x)
            more_recv, more_send = pos - 2 * d >= 0, pos + 2 * d < P
            if not have:
                y.copy_(got_x)
                if more_recv:
                    exc_a.copy_(got_a)
            else:
                transition.combine_into(y, exc_a, got_x, y)
                if more_recv:
                    transition.then_(exc_a, got_a, tmp)
            if more_send:
                transition.combine_into(inc_x, inc_a, got_x, inc_x)
                transition.then_(inc_a, got_a, tmp)
            link.release(d)
            have = True
        d *= 2
    return y if have else y.zero_()


def prefix_scans(pairs, like: torch.Tensor, transition: Transition = DECAY) -> list[torch.Tensor]:
    """Every prefix of the fold y ← a·y + x of (a, x) pairs, earliest first, from a zero state shaped like
    `like`: the state before each pair, then the one after the last (one more tensor than pairs)."""
    ys = [torch.zeros_like(like)]
    for a, x in pairs:
        ys.append(transition.apply(a, ys[-1]) + x)
    return ys


def local_scan(pairs, like: torch.Tensor, transition: Transition = DECAY) -> torch.Tensor:
    """Fold (a, x) pairs, earliest first, from a zero state shaped like `like`: y ← a·y + x."""
    return prefix_scans(pairs, like, transition)[-1]


def gather_scan(x: torch.Tensor, a: torch.Tensor, group=None, reverse: bool = False,
                transition: Transition = DECAY) -> torch.Tensor:
    """LASP-2's way to the same exclusive scan: one all-gather of every rank's [x | a], then the fold
    of the earlier ranks' pairs (the later ones with reverse=True). One collective of P pairs: fewer
    latency hops than the chain, P times its volume and memory."""
    check_pair("gather_scan", x, a, transition)
    group = group if group is not None else dist.group.WORLD
    rank, P = dist.get_rank(group), dist.get_world_size(group)
    nx, n = x.numel(), x.numel() + a.numel()
    msg = scratch("gather_msg", (n,), x.dtype, x.device, group)
    msg[:nx].copy_(x.reshape(-1))
    msg[nx:].copy_(a.reshape(-1))
    every = scratch("gather_all", (P * n,), x.dtype, x.device, group)  # flat: gloo takes no [P, n]
    dist.all_gather_into_tensor(every, msg, group=group)
    every = every.view(P, -1)
    xs, as_ = every[:, :nx].view(P, *x.shape), every[:, nx:].view(P, *a.shape)
    order = list(range(P - 1, rank, -1) if reverse else range(rank))
    y = torch.zeros_like(x) if not order else xs[order[0]].clone()
    tmp = scratch("gather_tmp", x.shape, x.dtype, x.device, group) if transition is not DECAY else y
    with torch.autocast(x.device.type, enabled=False):  # autocast would run A @ y in bf16
        for r in order[1:]:  # y ← a_r·y + x_r in one op (a GEMM writes to tmp: it cannot overwrite y)
            transition.combine_into(xs[r], as_[r], y, tmp)
            if tmp is not y:
                y.copy_(tmp)
    return y
