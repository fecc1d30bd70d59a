"""Table 2: communication time of one state exchange per method, and the P2P alpha/beta of the link.

    torchrun --nproc_per_node=8 -m apps.gla.bench.bench_comm out=results/bench_comm
    python -m apps.gla.bench.bench_comm out=/tmp/c heads=2 head_k=16 head_v=16   # one CPU process

Methods (same state bytes for all): All-Scan chain pipelined in n blocks (chain1 = unpipelined),
All-Scan tree (Hillis-Steele), all-gather of every rank's (state, decay) as LASP-2 does, all-reduce of
one state (reference). State per rank: [H, K, V] fp32 with decays [H, K] (H=32: paper's d=4096).
P2P: ping-pong between rank 0 and `p2p_peer` over several sizes; one-way = round trip / 2; a line
alpha + bytes / beta is fitted and written as {"calibration": {"links": {name: ...}}}, the form
`python -m lingua_zeco.perf_model calib=FILE` reads.
Transports (all_scan.transport) for the chain and the tree: nccl (torch.distributed P2P), symm (one-sided
writes into symmetric memory; rows named symm_chain1, symm_tree). On CUDA every row also has host_us,
the host time to enqueue one scan (the software cost, apart from the wire).
One GPU (torch's symmetric memory refuses two ranks on one GPU): loopback=P runs P virtual ranks of the
symm transport on P streams of one process (comm/symm_loopback.py), the hop's kernels as between GPUs
minus NVLink; rows loopback_symm_chain<n> / loopback_symm_tree (loopback_rows says what is timed):
    python -m apps.gla.bench.bench_comm loopback=4 methods=[chain,tree] p2p_sizes=[]
Writes <out>/comm_P<world>.json and .md (rank 0).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from lingua_zeco.comm import AllScanArgs, all_scan
from lingua_zeco.perf_model.links import fit_alpha_beta

from lingua_zeco import reliability
from lingua_zeco.args import ConfigError

from .common import (HEAD_MINIMUM, HeadArgs, at_least, bench_main, device_name, local_world_size, markdown_table,
                     summarize, time_iters)

METHODS = ("chain", "tree", "allgather", "allreduce")
TRANSPORTS = ("nccl", "symm")


@dataclass
class BenchCommArgs(HeadArgs):
    out: str = "results/bench_comm"  # output folder
    heads: tuple[int, ...] = (32, 16)  # state heads, one measurement each
    blocks: tuple[int, ...] = (1, 2, 4, 8)  # chain pipelining depths
    methods: tuple[str, ...] = ("chain", "tree", "allgather", "allreduce")  # collectives to time
    warmup: int = 10  # untimed calls first
    iters: int = 100  # timed calls (statistics over these)
    p2p_sizes: tuple[int, ...] = (4096, 65536, 262144, 1 << 20, 4 << 20, 16 << 20)  # bytes
    p2p_peer: int = 1  # ping-pong partner of rank 0 (e.g. 8 = first GPU of the next node: "ib")
    link_name: str = ""  # name written into the calibration; "" = nvlink / ib / gloo by placement
    transports: tuple[str, ...] = ("nccl",)  # all_scan.transport of the chain and tree rows: nccl | symm
    loopback: int = 0  # > 1: that many virtual ranks of the symm transport on this one GPU (one process)
    seed: int = 0  # seed of the random states


def check_args(args: BenchCommArgs, device: torch.device) -> None:
    """Refuse bad input before the first collective is timed: one line naming the key."""
    at_least(args, **HEAD_MINIMUM, heads=1, blocks=1, loopback=0)
    for key, value, choices in (("methods", args.methods, METHODS), ("transports", args.transports, TRANSPORTS)):
        unknown = [v for v in value if v not in choices]
        if unknown:
            raise ConfigError(f"{key}={unknown[0]}: unknown; choose from {', '.join(choices)}")
    if "symm" in args.transports and device.type != "cuda":  # one rank would time a no-op scan
        raise ConfigError("transports=symm: the symm transport needs CUDA GPUs (symmetric memory); use transports=nccl")


def _allgather(out: torch.Tensor, inp: torch.Tensor) -> None:
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, inp)


def loopback_rows(args: BenchCommArgs, device: torch.device) -> list[dict]:
    """The symm transport's chain and tree over args.loopback virtual ranks on this GPU. Two numbers:
    host_us, one virtual rank's host time for its scan call (the software cost per rank and scan), and
    median_us, the GPU time of the whole scan with every rank's work enqueued before the first kernel
    runs (the main stream sleeps while the host enqueues): the hops' kernel chain as on P GPUs whose
    hosts are ahead, minus NVLink."""
    from lingua_zeco.comm.symm_loopback import Loopback

    if device.type != "cuda" or dist.get_world_size() != 1:
        raise ValueError("bench_comm loopback=P runs on one CUDA GPU in one process (no torchrun)")
    P, lb = args.loopback, Loopback(args.loopback)
    g = torch.Generator(device="cpu").manual_seed(args.seed)
    rows = []
    for H in args.heads:
        xs = [torch.randn(H, args.head_k, args.head_v, generator=g).to(device) for _ in range(P)]
        as_ = [torch.rand(H, args.head_k, generator=g).to(device) for _ in range(P)]
        cases = {}
        if "chain" in args.methods:
            cases |= {f"loopback_symm_chain{n}": ("chain", n, True) for n in args.blocks}
            cases["loopback_symm_ops_chain1"] = ("chain", 1, False)  # the same hop op by op: before the kernel
        if "tree" in args.methods:
            cases["loopback_symm_tree"] = ("tree", 1, True)
        for name, (algo, n, fused) in cases.items():
            for _ in range(args.warmup):
                lb.scan(xs, as_, algo, n, fused=fused)
            host, spans = [], []
            for _ in range(args.iters):
                torch.cuda.synchronize(device)
                torch.cuda._sleep(int(5e6) * P)  # ~2.5 ms per rank: longer than enqueueing it
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                lb.scan(xs, as_, algo, n, host_s=host, fused=fused)
                end.record()
                spans.append((start, end))
            torch.cuda.synchronize(device)
            t = [s.elapsed_time(e) * 1e-3 for s, e in spans]
            rows.append(dict(method=name, H=H, P=P, state_bytes=xs[0].numel() * 4, **summarize(t, "us"),
                             host_us=summarize(host, "us")["median_us"]))
    return rows


def collective_rows(args: BenchCommArgs, device: torch.device) -> list[dict]:
    if args.loopback > 1:
        return loopback_rows(args, device)
    P = dist.get_world_size()
    g = torch.Generator(device="cpu").manual_seed(args.seed + dist.get_rank())
    rows = []
    for H in args.heads:
        x = torch.randn(H, args.head_k, args.head_v, generator=g).to(device)
        a = torch.rand(H, args.head_k, generator=g).to(device)
        flat = torch.cat([x.reshape(-1), a.reshape(-1)])
        gathered = flat.new_empty(P * flat.numel())
        reduced = x.clone()
        cases = {}
        for tp in args.transports:
            prefix = "" if tp == "nccl" else f"{tp}_"
            if "chain" in args.methods:
                for n in args.blocks:
                    scan = AllScanArgs(algorithm="chain", n_blocks=n, transport=tp)
                    cases[f"{prefix}chain{n}"] = lambda scan=scan, x=x, a=a: all_scan(x, a, args=scan)
            if "tree" in args.methods:
                scan = AllScanArgs(algorithm="tree", transport=tp)
                cases[f"{prefix}tree"] = lambda scan=scan, x=x, a=a: all_scan(x, a, args=scan)
        if "allgather" in args.methods:
            cases["allgather"] = lambda gathered=gathered, flat=flat: _allgather(gathered, flat)
        if "allreduce" in args.methods:
            cases["allreduce"] = lambda reduced=reduced: dist.all_reduce(reduced)
        for name, fn in cases.items():
            t, host = time_iters(fn, device, args.warmup, args.iters)
            extra = dict(host_us=summarize(host, "us")["median_us"]) if device.type == "cuda" else {}
            rows.append(dict(method=name, H=H, P=P, state_bytes=x.numel() * 4, **summarize(t, "us"), **extra))
    return rows


def _link_name(args: BenchCommArgs, device: torch.device) -> str:
    if args.link_name:
        return args.link_name
    if device.type != "cuda":
        return "gloo"
    return "nvlink" if args.p2p_peer < local_world_size() else "ib"


def p2p_rows(args: BenchCommArgs, device: torch.device) -> list[dict]:
    """Ping-pong rank 0 <-> p2p_peer; every rank joins the barriers so the timing stays aligned."""
    rank, peer = dist.get_rank(), args.p2p_peer
    if dist.get_world_size() < 2 or not 0 < peer < dist.get_world_size():
        return []
    rows = []
    for nbytes in args.p2p_sizes:
        buf = torch.zeros(max(nbytes // 4, 1), dtype=torch.float32, device=device)

        def pingpong(buf=buf):
            if rank == 0:
                dist.send(buf, peer)
                dist.recv(buf, peer)
            elif rank == peer:
                dist.recv(buf, 0)
                dist.send(buf, 0)

        t, _ = time_iters(pingpong, device, args.warmup, args.iters)
        s = summarize([x / 2 for x in t], "us")  # one way = half the round trip
        rows.append(dict(method="p2p_one_way", bytes=buf.numel() * 4, peer=peer, **s))
    return rows


def calibration(args: BenchCommArgs, device: torch.device, p2p: list[dict], rows: list[dict]) -> dict:
    if len(p2p) < 2:
        return {}
    alpha, beta = fit_alpha_beta([r["bytes"] for r in p2p], [r["median_us"] * 1e-6 for r in p2p])
    link = dict(alpha_s=alpha, beta_Bps=beta)
    # start cost of a collective: the all-reduce of the smallest state is nearly all latency
    ar = [r for r in rows if r["method"] == "allreduce"]
    if ar:
        link["coll_alpha_s"] = min(r["median_us"] for r in ar) * 1e-6
    return {"links": {_link_name(args, device): link}}


def measure(args: BenchCommArgs, device: torch.device) -> tuple[str, dict, str]:
    P = dist.get_world_size()
    rows = collective_rows(args, device)
    p2p = p2p_rows(args, device)
    cal = calibration(args, device, p2p, rows)
    results = dict(bench="comm", world_size=P, results=rows, p2p=p2p, calibration=cal)
    md = f"# bench_comm, P={P} ({device_name(device)})\n\n"
    cols = ["method", "H", "P", "state_bytes", "median_us", "p10_us", "p90_us", "n"]
    md += markdown_table(rows, cols + (["host_us"] if rows and "host_us" in rows[0] else []))
    if p2p:
        md += "\n## P2P one way\n\n" + markdown_table(p2p, ["bytes", "peer", "median_us", "p10_us", "p90_us"])
    for name, link in cal.get("links", {}).items():  # the one link measured
        md += f"\nfit {name}: alpha = {link['alpha_s'] * 1e6:.2f} µs, "
        md += f"beta = {link['beta_Bps'] / 1e9:.2f} GB/s\n"
    return (f"comm_loopback_P{args.loopback}" if args.loopback > 1 else f"comm_P{P}"), results, md


main = bench_main(BenchCommArgs, measure, check_args)


if __name__ == "__main__":
    with reliability.clean_exit():  # bad input: one `error: ...` line, exit code 2
        main()
