"""All-Scan: the exclusive scan of recurrent states over the ranks of a process group.

Rank p contributes x_p [..., K, V] (its local final state, fp32) and its transition a_p: for GLA the
decays a_p [..., K] (the product of its forget gates, in [0, 1]).  It receives

    y_p = sum_{r < p} (prod_{r < j < p} a_j) ⊙ x_r          (zeros on the first rank)

i.e. the true state entering its slice.  With reverse=True the roles of "before" and "after" swap
(rank p receives the sum over r > p), which is what the backward pass needs.  transition=MATRIX scans
matrix transitions A_p [..., K, K] instead (y_{p+1} = A_p y_p + x_p: the gated delta rule; pair_scan).
The algorithms (lingua_zeco/comm/scan.py, hierarchical.py), picked by `AllScanArgs.algorithm`:

* chain: p-1 → p → p+1, the paper's All-Scan, pipelined in blocks, so the time is
  ≈ τ(state) + (P-1)·τ(state / n_blocks) and every rank sends one state.
* tree: a Hillis–Steele scan, ceil(log2 P) rounds of pairwise exchange.  More bytes, far fewer hops.
* hier: chain inside a node, tree across nodes (decay transitions only).
* auto: the fastest by the alpha–beta model (choose_algorithm).

No autograd here: lingua_zeco.sp wraps this in autograd functions.
"""
from __future__ import annotations

import functools
import math
import os
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .buffers import group_key
from .hierarchical import hierarchical_scan, hierarchical_time
from .scan import DECAY, MATRIX, P2PLink, Transition, chain_scan, check_pair, tree_scan
from .symm import SymmLink, SymmSetupError, symm_unavailable

ALGORITHMS = ("chain", "tree", "hier", "auto")
TRANSPORTS = ("nccl", "symm", "auto")
OVERLAP = ("auto", "on", "off")


@dataclass
class AllScanArgs:
    algorithm: str = "chain"   # chain | tree | hier (chain in a node, tree across) | auto
    n_blocks: int = 0          # chain pipelining: blocks of the state (1 = none; 0 = by the alpha–beta model)
    # alpha–beta cost of one message (seconds, bytes/second) for the automatic choices; defaults from
    # NCCL P2P between two H200s (apps/gla/bench/bench_comm.py measures them)
    alpha_s: float = 45e-6
    beta_Bps: float = 300e9
    # extra cost of one tree round over one chain message (batched send/recv, packing), from the P = 2
    # chain and tree times between two H200s (docs/results/README.md, "Two H200s")
    tree_round_extra_s: float = 240e-6
    # hier / auto across nodes: ranks per node (0 = LOCAL_WORLD_SIZE from torchrun; 0 there = one node)
    # and the per-message cost across nodes (InfiniBand NDR 400 Gb/s per GPU; a lead, not measured)
    node_size: int = 0
    alpha_inter_s: float = 60e-6
    beta_inter_Bps: float = 50e9
    # what carries a hop (chain and tree): nccl = torch.distributed point-to-point (NCCL on GPUs, gloo on
    # CPUs); symm = one-sided writes into the next rank's symmetric memory (CUDA, one node: comm/symm.py);
    # auto = symm where the group is known to sit in one node (node_size / LOCAL_WORLD_SIZE), else nccl
    # (docs/sp.md, "Transports": what symm guarantees and what it was proven on).
    # hier always runs on nccl. symm_timeout_s bounds every wait on a peer (then the waiting kernel traps).
    transport: str = "nccl"
    symm_timeout_s: float = 600.0
    symm_fused: bool = True  # symm: a one-block decay chain hop as one kernel (comm/symm_hop.py)
    # fused ZeCO: scan on a side stream overlapped with the intra-chunk work (on), on the caller's stream
    # (off), or whichever measured faster in this run's first calls, per group, shape and direction (auto:
    # lingua_zeco/sp/overlap.py). At P = 2 blocking was the faster in GLA-1B training
    # (docs/results/README.md, "Two H200s"), so no one choice holds for every P.
    overlap: str = "auto"

    def check(self) -> None:
        """Refuse a bad configuration with one line naming the field and its choices."""
        for field, value, choices in (("algorithm", self.algorithm, ALGORITHMS),
                                      ("transport", self.transport, TRANSPORTS),
                                      ("overlap", self.overlap, OVERLAP)):
            if value not in choices:
                raise ValueError(f"all_scan.{field}={value!r}; choose one of {', '.join(choices)}")
        if self.n_blocks < 0 or self.symm_timeout_s <= 0:
            raise ValueError(f"all_scan.n_blocks must be >= 0 (0 = by the model) and all_scan.symm_timeout_s > 0; got "
                             f"{self.n_blocks} and {self.symm_timeout_s}")


def chain_time(P: int, nbytes: int, n_blocks: int, alpha_s: float, beta_Bps: float) -> float:
    """Alpha–beta estimate of the pipelined chain: the first block crosses P-1 hops, the other n-1
    follow one hop behind each other; every block pays the per-message cost alpha (on NCCL it barely
    depends on the message size up to a few MiB, docs/results/README.md, "Two
    H200s": so few blocks win on few ranks)."""
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


def estimate(P: int, nbytes: int, args: AllScanArgs, tree_nbytes: int | None = None) -> dict[str, float]:
    """Modelled seconds of each algorithm; hops that cross a node boundary pay the inter-node cost.
    nbytes: one state; tree_nbytes: what a tree round sends (default nbytes: K decays are noise)."""
    G = node_size_of(args, P)
    N = P // G
    tb = nbytes if tree_nbytes is None else tree_nbytes

    def hop(nb, across):  # one message of nb bytes inside a node, or across nodes
        return args.alpha_inter_s + nb / args.beta_inter_Bps if across else args.alpha_s + nb / args.beta_Bps
    n = args.n_blocks or best_n_blocks(G, nbytes, args.alpha_s, args.beta_Bps)
    rounds = math.ceil(math.log2(P)) if P > 1 else 0
    rounds_in = min(rounds, math.ceil(math.log2(G)) if G > 1 else 0)  # distances < G stay in a node
    est = {"chain": chain_time(P, nbytes, n, args.alpha_s, args.beta_Bps) + (N - 1) * (hop(nbytes, 1) - hop(nbytes, 0)),
           "tree": rounds_in * hop(tb, 0) + (rounds - rounds_in) * hop(tb, 1) + rounds * args.tree_round_extra_s}
    if N > 1:
        est["hier"] = hierarchical_time(P, G, nbytes, args.alpha_s, args.beta_Bps,
                                        args.alpha_inter_s, args.beta_inter_Bps, args.tree_round_extra_s)
    return est


def choose_algorithm(P: int, nbytes: int, args: AllScanArgs, tree_nbytes: int | None = None,
                     allowed: tuple = ALGORITHMS) -> str:
    """The fastest algorithm by the alpha–beta model (ties go to the chain: one state of volume)."""
    if args.algorithm != "auto":
        return args.algorithm
    est = {k: t for k, t in estimate(P, nbytes, args, tree_nbytes).items() if k in allowed}
    return min(est, key=lambda k: (est[k], k != "chain"))


class ScanWork:
    """Handle of an asynchronous All-Scan: `wait()` returns the result, ordered on the caller's stream."""

    def __init__(self, out, event=None):
        self._out, self._event = out, event

    def wait(self) -> torch.Tensor:
        if self._event is not None:
            torch.cuda.current_stream(self._out.device).wait_event(self._event)
            self._event = None
        return self._out


@functools.lru_cache(maxsize=None)
def _side_stream(device):  # one per device, made on first use
    return torch.cuda.Stream(device=device)


def all_scan(x: torch.Tensor, a: torch.Tensor, group=None, reverse: bool = False, *,
             algorithm: str = "chain", n_blocks: int = 0, async_op: bool = False,
             args: AllScanArgs | None = None, transition: Transition = DECAY):
    """Exclusive scan of x [..., K, V] with transitions a over the ranks of `group`: decays a [..., K]
    (transition=DECAY), or matrices a [..., K, K] (transition=MATRIX).

    Returns the tensor, or a ScanWork whose wait() returns it when async_op=True. On CUDA the
    asynchronous form runs the receive-combine-send loop on a side stream, so that the caller's
    stream keeps computing until it calls wait().
    """
    check_pair("all_scan", x, a, transition)
    if args is None:
        args = AllScanArgs(algorithm=algorithm, n_blocks=n_blocks)
    allowed = ALGORITHMS if transition.hier else tuple(n for n in ALGORITHMS if n != "hier")
    if args.algorithm not in allowed:
        raise ValueError(f"all_scan: algorithm must be one of {allowed} for this transition, got {args.algorithm!r}")
    args.check()
    group = group if group is not None else dist.group.WORLD
    rank, P = dist.get_rank(group), dist.get_world_size(group)
    x, a = x.contiguous(), a.contiguous()

    def run():
        if P == 1:
            return torch.zeros_like(x)
        nbytes = x.numel() * x.element_size()
        tree_nbytes = nbytes + a.numel() * a.element_size() if transition.tree_sends_a else nbytes
        algo = choose_algorithm(P, nbytes, args, tree_nbytes, allowed)
        n_blocks = args.n_blocks or best_n_blocks(P, nbytes, args.alpha_s, args.beta_Bps)
        with torch.autocast(x.device.type, enabled=False):  # autocast would run A @ y in bf16
            if algo == "hier":
                return hierarchical_scan(x, a, group, reverse, hier_node_size(args, P), n_blocks)
            links = _links(args, x, group, rank, P, reverse)
            for i, link in enumerate(links):
                try:
                    if algo == "tree":
                        return tree_scan(x, a, link, transition)
                    return chain_scan(x, a, link, n_blocks, transition)
                except SymmSetupError as e:  # raised before any hop was posted
                    if i + 1 == len(links):
                        raise
                    _NO_SYMM.add(group_key(group))
                    warnings.warn(f"all_scan: transport=auto falls back to nccl on this group: {e}", stacklevel=1)

    if not (async_op and x.is_cuda):
        out = run()
        return ScanWork(out) if async_op else out
    return on_side_stream(run, (x, a))


_NO_SYMM: set = set()  # groups where transport=auto found no symmetric memory


def in_one_node(group, args: AllScanArgs) -> bool:
    """Whether every rank of `group` is known to sit in one node (node_size, else LOCAL_WORLD_SIZE)."""
    G = args.node_size or int(os.environ.get("LOCAL_WORLD_SIZE", "0"))
    return G > 0 and len({r // G for r in dist.get_process_group_ranks(group)}) == 1


def _links(args: AllScanArgs, x, group, rank: int, P: int, reverse: bool):
    """The links to try in order: [SymmLink] for symm, [SymmLink, P2PLink] for auto where symmetric memory
    may work (the second only if making the first's buffers fails), else [P2PLink]."""
    nccl = P2PLink(group, rank, P, reverse)
    if args.transport == "nccl":
        return [nccl]
    why = symm_unavailable(x)
    if why and args.transport == "symm":
        raise ValueError(f"all_scan(transport='symm'): {why}; use all_scan.transport=nccl (or auto)")
    if args.transport == "auto" and (why or not in_one_node(group, args) or group_key(group) in _NO_SYMM):
        return [nccl]
    symm = SymmLink(group, rank, P, reverse, args.symm_timeout_s, fused=args.symm_fused)
    return [symm] if args.transport == "symm" else [symm, nccl]


def pair_scan(x: torch.Tensor, A: torch.Tensor, group=None, reverse: bool = False,
              args: AllScanArgs | None = None) -> torch.Tensor:
    """all_scan of x [..., K, V] with matrix transitions A [..., K, K]: y_0 = 0, y_{p+1} = A_p y_p + x_p
    (reverse=True: from the last rank down). fp32 advised."""
    return all_scan(x, A, group, reverse, args=args, transition=MATRIX)


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
