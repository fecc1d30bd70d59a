"""Hierarchical All-Scan: chain inside each node (fast links), log-depth tree across nodes.

With N nodes of G ranks (in scan order), rank (n, l):
  1. exclusive chain scan inside node n                      → y_loc, and on the node's last rank
     its inclusive total  X_n = a ⊙ y_loc + x;  every rank gathers its node's decays (K floats)
     to form A_excl (product of a over the node's ranks before it) and the node product A_n;
  2. the last ranks of all nodes run an exclusive tree scan of (A_n, X_n) across nodes → Y_n;
  3. Y_n is broadcast inside the node;  y = y_loc + A_excl ⊙ Y_n.
One state crosses each inter-node link ceil(log2 N) times instead of the chain's N-1 sequential
hops; inside a node the chain keeps the volume at one state per rank.
The sub-groups are made up front by every rank (init_node_groups; distributed.setup calls it).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from .scan import P2PLink, chain_scan, global_rank, tree_scan

# (group's global ranks in group-rank order, node size) -> (world it was made in, intra, cross)
_GROUPS: dict = {}


def init_node_groups(groups: list[list[int]], node_size: int) -> None:
    """Make hier's sub-groups for every group in `groups` (lists of global ranks, e.g. every SP group).

    dist.new_group is collective over the whole world and names a group by a per-process counter, so
    every rank must call this with the same lists in the same order, member or not (made lazily
    inside one SP group, the SP groups' sub-groups took the same names and cross-wired their gloo
    connections). A rank keeps the sub-groups of the groups it belongs to."""
    me, G = dist.get_rank(), node_size
    for ranks in groups:
        ranks = sorted(int(r) for r in ranks)  # a torch group's ranks are its sorted global ranks
        if G <= 0 or len(ranks) % G:
            raise ValueError(f"init_node_groups: node_size={G} must divide the group size {len(ranks)}")
        intra = [dist.new_group(ranks[n * G:(n + 1) * G]) for n in range(len(ranks) // G)]
        cross = [dist.new_group(ranks[l::G]) for l in range(G)]
        if me in ranks:
            _GROUPS[(tuple(ranks), G)] = (dist.group.WORLD, intra, cross)


def _node_groups(group, P: int, G: int):
    """(intra-node groups by node, cross-node groups by local index), made by init_node_groups.
    A group spanning the world gets them here: all ranks are in the scan, so all take part."""
    ranks = tuple(dist.get_process_group_ranks(group))
    hit = _GROUPS.get((ranks, G))
    if hit is None or hit[0] is not dist.group.WORLD:  # none yet, or made in a destroyed world
        if P != dist.get_world_size():
            raise RuntimeError(
                f"all_scan(algorithm='hier') on a group of {P} of the world's {dist.get_world_size()} ranks: "
                f"its sub-groups must be made up front by every rank, in one order. Call "
                f"lingua_zeco.comm.init_node_groups(<every such group's ranks>, node_size={G}) on all ranks "
                f"(lingua_zeco.distributed.setup does it for the SP groups).")
        init_node_groups([list(ranks)], G)
        hit = _GROUPS[(ranks, G)]
    return hit[1], hit[2]


def hierarchical_time(P: int, G: int, nbytes: int, alpha_s: float, beta_Bps: float,
                      alpha_inter_s: float, beta_inter_Bps: float, tree_round_extra_s: float = 0.0) -> float:
    """Alpha–beta estimate: chain over G ranks, tree over N nodes, broadcast inside the node."""
    N = max(1, P // G)
    intra = alpha_s + nbytes / beta_Bps
    inter = alpha_inter_s + nbytes / beta_inter_Bps + tree_round_extra_s
    return (G - 1) * intra + math.ceil(math.log2(N)) * inter + math.ceil(math.log2(G)) * intra


def hierarchical_scan(x, a, group, reverse: bool, node_size: int, n_blocks: int):
    """The decay scan of all_scan(algorithm='hier'): chain_scan inside the node, tree_scan across."""
    rank, P, G = dist.get_rank(group), dist.get_world_size(group), node_size
    if G <= 0 or P % G:
        raise ValueError(f"all_scan(algorithm='hier'): node_size={G} must divide the group size {P}")
    intra, cross = _node_groups(group, P, G)
    node, local = rank // G, rank % G
    ig = intra[node]
    link = P2PLink(ig, local, G, reverse)                # pos: the position inside the node, in scan order
    pos, last_local = link.pos, (0 if reverse else G - 1)  # the node's last rank in scan order
    y_loc = chain_scan(x, a, link, n_blocks) if G > 1 else torch.zeros_like(x)
    decays = [torch.empty_like(a) for _ in range(G)]
    dist.all_gather(decays, a.contiguous(), group=ig)
    order = [G - 1 - p if reverse else p for p in range(G)]        # local indices in scan order
    a_excl = torch.ones_like(a)
    for p in range(pos):
        a_excl = a_excl * decays[order[p]]
    Y, N = torch.zeros_like(x), P // G
    if local == last_local and N > 1:  # the node's inclusive total, scanned across the nodes
        X_node, A_node = (a[..., None] * y_loc + x).contiguous(), (a_excl * a).contiguous()
        Y = tree_scan(X_node, A_node, P2PLink(cross[last_local], node, N, reverse))
    dist.broadcast(Y, src=global_rank(ig, last_local), group=ig)
    return y_loc + a_excl[..., None] * Y
