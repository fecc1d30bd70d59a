"""All-Scan: the exclusive decay-scan of recurrent states over the ranks of a process group.

Rank p contributes x_p [..., K, V] (its local final state, fp32) and a_p [..., K] (the product of
its forget gates, in [0, 1]).  It receives

    y_p = sum_{r < p} (prod_{r < j < p} a_j) ⊙ x_r          (zeros on the first rank)

i.e. the true state entering its slice.  With reverse=True the roles of "before" and "after" swap
(rank p receives the sum over r > p), which is what the backward pass needs.  The pair operator
(a1, x1) ∘ (a2, x2) = (a1·a2, a2 ⊙ x1 + x2) is associative, so two algorithms are offered:

* chain: p-1 → p → p+1, the paper's All-Scan.  The state is cut into blocks along K; a rank
  forwards block j as soon as it has combined it, while block j+1 is still in flight, so the time
  is ≈ τ(state) + (P-1)·τ(state / n_blocks) and every rank sends one state.
* tree: a Hillis–Steele scan, ceil(log2 P) rounds of pairwise exchange at distance 1, 2, 4, ...
  Each rank keeps the inclusive pair I of the ranks (p-d, p] and the exclusive pair E of
  (p-d, p); a round composes the received I of rank p-d onto both.  More bytes, far fewer hops.

No autograd here: lingua_zeco.sp wraps this in autograd functions.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .hierarchical import hierarchical_scan, hierarchical_time

ALGORITHMS = ("chain", "tree", "hier", "auto")


@dataclass
class AllScanArgs:
    algorithm: str = "chain"   # chain | tree | hier (chain in a node, tree across) | auto
    n_blocks: int = 0          # chain pipelining: blocks along K (1 = none; 0 = by the alpha–beta model)
    # alpha–beta cost of one message (seconds, bytes/second) for the automatic choices; defaults from
    # NCCL P2P between two H200s (apps/gla/bench/bench_comm.py measures them)
    alpha_s: float = 45e-6
    beta_Bps: float = 300e9
    # measured extra cost of one tree round over one chain message (batched send/recv, packing):
    # tree 447 µs against chain 205 µs for one 1 MiB round between two H200s (docs/results/all_scan.md)
    tree_round_extra_s: float = 240e-6
    # hier / auto across nodes: ranks per node (0 = LOCAL_WORLD_SIZE from torchrun; 0 there = one node)
    # and the per-message cost across nodes (InfiniBand NDR 400 Gb/s per GPU; a lead, not measured)
    node_size: int = 0
    alpha_inter_s: float = 60e-6
    beta_inter_Bps: float = 50e9
    # fused ZeCO runs the scan on a side stream, overlapped with the intra-chunk work, from this group
    # size on; below it on the caller's stream. At P = 2 (one hop) blocking was faster: GLA-1B training
    # 51.2K against 48.2K tok/s/GPU, operator -0.28 ms (docs/results/performance.md). P >= 4 is not
    # measured yet; 2 = always overlap.
    overlap_min_ranks: int = 3


def _group_info(group):
    group = group if group is not None else dist.group.WORLD
    return group, dist.get_rank(group), dist.get_world_size(group)


def _global(group, group_rank: int) -> int:
    return dist.get_global_rank(group, group_rank) if group is not dist.group.WORLD else group_rank


def _k_blocks(K: int, n_blocks: int) -> list[tuple[int, int]]:
    n = max(1, min(int(n_blocks), K))
    edges = [round(i * K / n) for i in range(n + 1)]
    return [(s, e) for s, e in zip(edges[:-1], edges[1:]) if e > s]


def chain_time(P: int, nbytes: int, n_blocks: int, alpha_s: float, beta_Bps: float) -> float:
    """Alpha–beta estimate of the pipelined chain: the first block crosses P-1 hops, the other n-1
    follow one hop behind each other; every block pays the per-message cost alpha (measured on
    NCCL here: ~45 µs a message whatever its size up to 4 MiB, so few blocks win on few ranks)."""
    if P <= 1:
        return 0.0
    return (P - 2 + n_blocks) * (alpha_s + nbytes / n_blocks / beta_Bps)


def best_n_blocks(P: int, nbytes: int, alpha_s: float, beta_Bps: float) -> int:
    return min((1, 2, 4, 8, 16), key=lambda n: chain_time(P, nbytes, n, alpha_s, beta_Bps))


def tree_time(P: int, nbytes: int, alpha_s: float, beta_Bps: float) -> float:
    """Alpha–beta estimate of the Hillis–Steele scan: ceil(log2 P) exchanges of state + decay."""
    if P <= 1:
        return 0.0
    return math.ceil(math.log2(P)) * (alpha_s + nbytes / beta_Bps)


def node_size_of(args: AllScanArgs, P: int) -> int:
    G = args.node_size or int(os.environ.get("LOCAL_WORLD_SIZE", "0")) or P
    return G if 0 < G <= P and P % G == 0 else P


def hier_node_size(args: AllScanArgs, P: int) -> int:
    """The node size hier runs with (an explicit one that does not divide P is refused there)."""
    return args.node_size or node_size_of(args, P)


def hier_groups_needed(args: AllScanArgs, P: int) -> int:
    """The node size whose sub-groups all_scan may use on groups of P ranks with these args, 0 if none:
    hier, or auto where the groups span more than one node (callers make them up front)."""
    G = hier_node_size(args, P)
    if P <= 1 or P % G or args.algorithm not in ("hier", "auto") or (args.algorithm == "auto" and G == P):
        return 0
    return G


def estimate(P: int, nbytes: int, args: AllScanArgs) -> dict[str, float]:
    """Modelled seconds of each algorithm; hops that cross a node boundary pay the inter-node cost."""
    G = node_size_of(args, P)
    N = P // G
    b_in = args.alpha_s + nbytes / args.beta_Bps
    b_out = args.alpha_inter_s + nbytes / args.beta_inter_Bps
    n = args.n_blocks or best_n_blocks(G, nbytes, args.alpha_s, args.beta_Bps)
    rounds = math.ceil(math.log2(P)) if P > 1 else 0
    rounds_in = min(rounds, math.ceil(math.log2(G)) if G > 1 else 0)  # distances < G stay in a node
    est = {"chain": chain_time(P, nbytes, n, args.alpha_s, args.beta_Bps) + (N - 1) * (b_out - b_in),
           "tree": rounds_in * b_in + (rounds - rounds_in) * b_out + rounds * args.tree_round_extra_s}
    if N > 1:
        est["hier"] = hierarchical_time(P, G, nbytes, args.alpha_s, args.beta_Bps,
                                        args.alpha_inter_s, args.beta_inter_Bps, args.tree_round_extra_s)
    return est


def choose_algorithm(P: int, nbytes: int, args: AllScanArgs) -> str:
    """The fastest algorithm by the alpha–beta model (ties go to the chain: one state of volume)."""
    if args.algorithm != "auto":
        return args.algorithm
    est = estimate(P, nbytes, args)
    return min(est, key=lambda k: (est[k], k != "chain"))


def pipelined_chain(x, slices, carry, group, pos: int, P: int, peer):
    """Chain scan, pipelined in blocks: position p receives its exclusive prefix y block by block
    (`slices` index x) and, as each block arrives, sends carry(slice, y_block) (x's block at p = 0)
    on to p + 1, so hop p+1 starts before hop p has finished. Returns y (zeros at p = 0)."""
    out = torch.zeros_like(x)
    recvs = []
    if pos > 0:
        recvs = [(buf, dist.irecv(buf, src=peer(pos - 1), group=group))
                 for buf in (x.new_empty(x[sl].shape) for sl in slices)]
    sends = []
    for j, sl in enumerate(slices):
        if recvs:
            buf, work = recvs[j]
            work.wait()
            out[sl] = buf
        if pos < P - 1:
            blk = (carry(sl, out[sl]) if recvs else x[sl]).contiguous()
            sends.append((blk, dist.isend(blk, dst=peer(pos + 1), group=group)))
    for _, work in sends:
        work.wait()
    return out


def _chain(x, a, group, pos, P, peer, n_blocks):
    """Decay chain in blocks of K rows: forward a ⊙ y + x (a diagonal: the rows are independent)."""
    slices = [(..., slice(s, e), slice(None)) for s, e in _k_blocks(x.shape[-2], n_blocks)]
    return pipelined_chain(x, slices, lambda sl, y: x[sl] + a[sl[:-1]][..., None] * y, group, pos, P, peer)


def hillis_steele(inc: tuple, compose, group, pos: int, P: int, peer):
    """Exclusive scan of one element per position by Hillis–Steele rounds (any P: missing partners
    are skipped). `inc`: this position's element, a tuple of tensors; `compose(earlier, later)` the
    associative combine of two elements. Returns the composition of every earlier position's
    element, or None at position 0 (the caller's identity). Also the matrix scan of sp/delta.py."""
    exc = None
    d = 1
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
    return exc


def _tree(x, a, group, pos, P, peer):
    """Decay scan by Hillis–Steele: (a₁, x₁) then (a₂, x₂) composes to (a₁a₂, a₂ ⊙ x₁ + x₂)."""
    def compose(earlier, later):
        (ea, ex), (la, lx) = earlier, later
        return ea * la, la[..., None] * ex + lx

    exc = hillis_steele((a, x), compose, group, pos, P, peer)
    return torch.zeros_like(x) if exc is None else exc[1]


class ScanWork:
    """Handle of an asynchronous All-Scan: `wait()` returns the result, ordered on the caller's stream."""

    def __init__(self, out, event=None):
        self._out, self._event = out, event

    def wait(self) -> torch.Tensor:
        if self._event is not None:
            torch.cuda.current_stream(self._out.device).wait_event(self._event)
            self._event = None
        return self._out


_SIDE_STREAMS: dict = {}


def _side_stream(device):
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device=device)
    return _SIDE_STREAMS[device]


def all_scan(x: torch.Tensor, a: torch.Tensor, group=None, reverse: bool = False, *,
             algorithm: str = "chain", n_blocks: int = 0, async_op: bool = False,
             args: AllScanArgs | None = None):
    """Exclusive decay-scan of x [..., K, V] with decays a [..., K] over the ranks of `group`.

    Returns the tensor, or a ScanWork whose wait() returns it when async_op=True. On CUDA the
    asynchronous form runs the receive-combine-send loop on a side stream, so that the caller's
    stream keeps computing until it calls wait().
    """
    if x.dim() < 2 or a.shape != x.shape[:-1]:
        raise ValueError(f"all_scan: x must be [..., K, V] and a [..., K]; got x {tuple(x.shape)}, a {tuple(a.shape)}")
    if x.dtype != a.dtype or not x.is_floating_point():
        raise ValueError(f"all_scan: x and a must share one floating dtype (fp32 advised); got {x.dtype}, {a.dtype}")
    if args is None:
        args = AllScanArgs(algorithm=algorithm, n_blocks=n_blocks)
    if args.algorithm not in ALGORITHMS:
        raise ValueError(f"all_scan: algorithm must be one of {ALGORITHMS}, got {args.algorithm!r}")
    group, rank, P = _group_info(group)
    x, a = x.contiguous(), a.contiguous()
    pos = P - 1 - rank if reverse else rank

    def peer(p):
        return _global(group, P - 1 - p if reverse else p)

    def run():
        if P == 1:
            return torch.zeros_like(x)
        nbytes = x.numel() * x.element_size()
        algo = choose_algorithm(P, nbytes, args)
        if algo == "tree":
            return _tree(x, a, group, pos, P, peer)
        if algo == "hier":
            return hierarchical_scan(x, a, group, reverse, hier_node_size(args, P),
                                     args.n_blocks or best_n_blocks(P, nbytes, args.alpha_s, args.beta_Bps))
        n_blocks = args.n_blocks or best_n_blocks(P, nbytes, args.alpha_s, args.beta_Bps)
        return _chain(x, a, group, pos, P, peer, n_blocks)

    if not (async_op and x.is_cuda):
        out = run()
        return ScanWork(out) if async_op else out
    return on_side_stream(run, (x, a))


def on_side_stream(run, inputs: tuple) -> ScanWork:
    """Run `run()` (which returns a CUDA tensor) on the side stream after the caller's stream has
    produced `inputs`; the handle's wait() orders the caller's stream after it. The asynchronous
    All-Scan uses this; tests run virtual ranks' scans through it too."""
    device = inputs[0].device
    main, side = torch.cuda.current_stream(device), _side_stream(device)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        out = run()
    for t in (*inputs, out):  # the allocator must not reuse these while either stream may use them
        t.record_stream(main)
        t.record_stream(side)
    event = torch.cuda.Event()
    event.record(side)
    return ScanWork(out, event)
