"""Event simulation of the communication schedules of one exclusive scan over P ranks (docs/perf_model.md §2).

Every schedule is simulated message by message: a message leaves when its data is ready *and* the
sender's link to that peer is free (messages on one link serialise: each torch P2P op is an NCCL
launch of its own), and arrives `alpha + bytes / beta` later. Closed forms beside each simulation
are exact for one uniform link with free combines; the tests hold the simulation to them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from .inputs import assumed
from .links import LinkArgs, Topology


@dataclass
class StateArgs:
    H: int = 16  # heads in one layer (paper d=2048 -> 16, d=4096 -> 32)
    K: int = 128
    V: int = 128
    elem_bytes: int = 4  # states and decays travel in fp32

    @property
    def state_bytes(self) -> int:
        return self.H * self.K * self.V * self.elem_bytes

    @property
    def decay_bytes(self) -> int:
        return self.H * self.K * self.elem_bytes

    @property
    def msg_bytes(self) -> int:
        """What one scan message carries: the state and its decays."""
        return self.state_bytes + self.decay_bytes


@dataclass
class DeviceArgs:
    # defaults: the named assumptions of inputs.py (printed as such); calibrate.py fits the last three
    hbm_Bps: float = assumed("dev.hbm_Bps")  # copy bandwidth of a combine (bytes/s)
    launch_s: float = assumed("dev.launch_s")  # one small elementwise kernel
    # software costs of our torch.distributed All-Scan, fitted from bench_comm (calibrate.py);
    # 0 = the pure alpha-beta schedule (the closed forms below)
    scan_fixed_s: float = assumed("dev.scan_fixed_s")  # once per scan: allocations, first launches, the final wait
    scan_s_per_byte: float = assumed("dev.scan_s_per_byte")  # once per scan, per byte of state + decays (copies)
    tree_round_s: float = assumed("dev.tree_round_s")  # per tree round beyond the P2P: grouped launch, cat, folds

    def combine(self, nbytes: float) -> float:
        """diag(a) x_in + x_local on a received block: read two blocks, write one."""
        return self.launch_s + 3 * nbytes / self.hbm_Bps


FREE = DeviceArgs(hbm_Bps=math.inf, launch_s=0.0)  # combines cost nothing: closed forms are exact


# --------------------------------------------------------------------------------------- chain
def chain_sim(P: int, st: StateArgs, n_blocks: int, topo: Topology, dev: DeviceArgs) -> float:
    """Pipelined chain All-Scan: rank p combines block j as it arrives and forwards it to p+1."""
    if P <= 1:
        return 0.0
    block = st.msg_bytes / n_blocks
    ready = [0.0] * n_blocks  # rank 0's local blocks are ready at t=0 (nothing to combine)
    for p in range(P - 1):
        link = topo.link(p, p + 1)
        free, arrive = 0.0, []
        for j in range(n_blocks):  # block j leaves once it is ready and the link is free
            free = max(ready[j], free) + link.p2p(block)
            arrive.append(free)
        # rank p+1 must combine a block before it can forward it (the last rank only receives)
        ready = [t + dev.combine(block) for t in arrive] if p + 1 < P - 1 else arrive
    return max(ready) + _scan_fixed(st, dev)


def _scan_fixed(st: StateArgs, dev: DeviceArgs) -> float:
    return dev.scan_fixed_s + dev.scan_s_per_byte * st.msg_bytes


def chain_closed(P: int, st: StateArgs, n_blocks: int, link: LinkArgs) -> float:
    """(n + P - 2) block times: n blocks drain through P - 1 links, one stage per link."""
    if P <= 1:
        return 0.0
    block = st.msg_bytes / n_blocks
    return (n_blocks + P - 2) * link.p2p(block)


# ---------------------------------------------------------------------------------------- tree
def tree_sim(P: int, st: StateArgs, topo: Topology, dev: DeviceArgs) -> float:
    """Hillis-Steele: in round r rank p sends its running aggregate to p + 2^r and folds what it
    gets from p - 2^r into both its inclusive and its exclusive aggregate (ceil(log2 P) rounds)."""
    if P <= 1:
        return 0.0
    t = [0.0] * P
    d = 1
    while d < P:
        nxt = list(t)
        # a rank leaves the round once its send is done and what it received is folded in
        for q in range(P - d):
            nxt[q] = t[q] + dev.tree_round_s + topo.link(q, q + d).p2p(st.msg_bytes)
        for q in range(d, P):
            arrive = t[q - d] + dev.tree_round_s + topo.link(q - d, q).p2p(st.msg_bytes)
            nxt[q] = max(nxt[q], arrive + dev.combine(st.msg_bytes))
        t = nxt
        d *= 2
    return max(t) + _scan_fixed(st, dev)


def tree_closed(P: int, st: StateArgs, link: LinkArgs) -> float:
    return math.ceil(math.log2(P)) * link.p2p(st.msg_bytes) if P > 1 else 0.0


# ---------------------------------------------------------------------------------------- ring
def ring_sim(P: int, steps: int, chunk_bytes: float, topo: Topology) -> float:
    """A ring collective of `steps` steps: step k on rank p forwards what arrived at step k-1."""
    if P <= 1:
        return 0.0
    got = [0.0] * P  # time rank p holds the data it forwards next
    free = [0.0] * P
    for _ in range(steps):
        new = [0.0] * P
        for p in range(P):
            dst = (p + 1) % P
            link = topo.link(p, dst)
            free[p] = max(got[p], free[p]) + link.step_alpha_s + chunk_bytes / link.beta_Bps
            new[dst] = free[p]
        got = new
    return topo.slowest(P).coll_alpha_s + max(got)


def ring_closed(P: int, steps: int, chunk_bytes: float, link: LinkArgs) -> float:
    return link.coll_alpha_s + steps * (link.step_alpha_s + chunk_bytes / link.beta_Bps) if P > 1 else 0.0


def allgather_scan(P: int, st: StateArgs, topo: Topology, dev: DeviceArgs) -> float:
    """LASP-2: ring all-gather of every rank's (decay, state), then a local scan over P states."""
    if P <= 1:
        return 0.0
    gather = ring_sim(P, P - 1, st.msg_bytes, topo)
    return gather + dev.launch_s + (P + 1) * st.state_bytes / dev.hbm_Bps


def allreduce_state(P: int, st: StateArgs, topo: Topology) -> float:
    """Ring all-reduce of one state (reference): reduce-scatter + all-gather of P pieces."""
    return ring_sim(P, 2 * (P - 1), st.state_bytes / P, topo)


def allreduce_big(nbytes: float, N: int, topo: Topology) -> float:
    """Gradient all-reduce (closed form; large messages). Across nodes NCCL goes hierarchical:
    reduce-scatter in the node, all-reduce of 1/g of the data over nodes (one NIC per GPU,
    all rails busy at once), all-gather in the node."""
    if N <= 1:
        return 0.0
    a, g = topo.args, topo.args.gpus_per_node
    if a.kind != "hier" or N <= g:
        return ring_closed(N, 2 * (N - 1), nbytes / N, topo.slowest(N))
    intra, inter = topo.links[a.intra], topo.links[a.inter]
    nodes = math.ceil(N / g)
    rs = ring_closed(g, g - 1, nbytes / g, intra)
    ar = ring_closed(nodes, 2 * (nodes - 1), nbytes / g / nodes, inter)
    return 2 * rs + ar  # all-gather in the node costs what the reduce-scatter cost


# ------------------------------------------------------------------------------------ dispatch
def scan_time(P: int, st: StateArgs, topo: Topology, dev: DeviceArgs, algorithm: str = "auto",
              n_blocks: int = 4) -> tuple[float, str]:
    """One exclusive scan (one direction) with the named All-Scan; "auto" takes the faster.
    n_blocks = 0: the chain takes its best depth among 1, 2, 4, 8."""
    if n_blocks == 0 and algorithm in ("chain", "auto"):
        n_blocks = min((1, 2, 4, 8), key=lambda n: chain_sim(P, st, n, topo, dev))
    if algorithm == "chain":
        return chain_sim(P, st, n_blocks, topo, dev), f"chain{n_blocks}"
    if algorithm == "tree":
        return tree_sim(P, st, topo, dev), "tree"
    if algorithm == "auto":
        c = chain_sim(P, st, n_blocks, topo, dev)
        t = tree_sim(P, st, topo, dev)
        return (c, f"chain{n_blocks}") if c <= t else (t, "tree")
    raise ValueError(f"unknown All-Scan algorithm {algorithm!r} (chain | tree | auto)")


def method_time(method: str, P: int, st: StateArgs, topo: Topology, dev: DeviceArgs) -> float:
    """One state exchange by bench_comm's method name: chain<n>, tree, allgather, else the all-reduce."""
    if method.startswith("chain"):
        return chain_sim(P, st, int(method[5:]), topo, dev)
    if method == "tree":
        return tree_sim(P, st, topo, dev)
    if method == "allgather":
        return allgather_scan(P, st, topo, dev)
    return allreduce_state(P, st, topo)


def recv_bytes(method: str, P: int, st: StateArgs) -> float:
    """Bytes one rank receives (the busiest rank)."""
    if P <= 1:
        return 0.0
    if method.startswith("chain"):
        return st.msg_bytes
    if method == "tree":
        return math.ceil(math.log2(P)) * st.msg_bytes
    if method == "allgather":
        return (P - 1) * st.msg_bytes
    if method == "allreduce":
        return 2 * (P - 1) * st.state_bytes / P
    raise ValueError(method)


def comm_rows(P_list: list[int], H_list: list[int], topo: Topology, dev: DeviceArgs,
              blocks: tuple[int, ...] = (1, 2, 4, 8)) -> list[dict]:
    """Table 2: time of one scan per method, P and head count."""
    methods = [f"chain{n}" for n in dict.fromkeys(blocks)] + ["tree", "allgather", "allreduce"]  # no repeats
    rows = []
    for H in H_list:
        st = StateArgs(H=H)
        rows += [dict(H=H, P=P, method=m, time_us=method_time(m, P, st, topo, dev) * 1e6,
                      recv_MiB=recv_bytes(m, P, st) / 2**20) for P in P_list for m in methods]
    return rows


def hier_scan(P: int, st: StateArgs, topo: Topology, dev: DeviceArgs, n_blocks: int = 1) -> float:
    """Modeled only (not implemented in lingua_zeco.comm): chain inside each node of g GPUs, a tree
    over the nodes' totals across nodes (the inter-node link), then one intra-node hop that hands each
    rank its node's prefix, and a combine. One fixed scan cost, not three."""
    g = topo.args.gpus_per_node if topo.args.kind == "hier" else P
    if P <= g:
        return chain_sim(P, st, n_blocks, topo, dev)
    fixed = _scan_fixed(st, dev)
    intra = Topology(replace(topo.args, kind=topo.args.intra), topo.links)
    inter = Topology(replace(topo.args, kind=topo.args.inter), topo.links)
    t_chain = chain_sim(g, st, n_blocks, intra, dev) - fixed
    t_tree = tree_sim(-(-P // g), st, inter, dev) - fixed
    t_bcast = intra.link(0, 1).p2p(st.msg_bytes) + dev.combine(st.msg_bytes)
    return t_chain + t_tree + t_bcast + fixed
