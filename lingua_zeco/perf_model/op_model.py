"""Operator time of one sequence-parallel GLA call, forward + backward (paper Tables 3-4).

Fed by the measured single-GPU fla `chunk_gla` fwd+bwd time `c` at the local length (DESIGN §7).
    none   c
    zeco   c (1 + extra) + exposed(scan_fwd) + exposed(scan_bwd);
           exposed(t) = max(0, t - intra_frac * c_pass): the scan runs on a side stream while the
           intra-chunk attention (which needs no S_in) computes; only the excess shows.
    lasp2  c + 2 (all-gather + local scan), exposed the same way when lasp2_overlap is set.
    lasp1  event-simulated wavefront: rank p runs the serial part of its pass after S_in arrives,
           then sends S_out (one unpipelined P2P of the whole state); backward the reverse.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .links import Topology
from .schedules import DeviceArgs, StateArgs, allgather_scan, scan_time

# DESIGN §7: fla chunk_gla fwd+bwd, B=1, H=16, K=V=128, bf16 on one H200
KERNEL_MS_H200 = {16384: 3.47, 32768: 6.83}


@dataclass
class OpArgs:
    kernel_ms: dict[int, float] = field(default_factory=lambda: dict(KERNEL_MS_H200))
    H: int = 16
    K: int = 128
    V: int = 128
    fwd_frac: float = 1 / 3  # forward share of fwd+bwd (backward ~ 2x forward in fla's GLA)
    intra_frac: float = 0.35  # share of a pass that needs no S_in (intra-chunk A / dA): overlap window
    zeco_extra_frac: float = 0.02  # folding S_in into the chunk states: O(N K V) extra, ≤ 2% (DESIGN §3)
    zeco_overlap: bool = True  # False = composition build (scan exposed)
    scan: str = "auto"  # All-Scan algorithm for zeco: chain | tree | auto (faster of the two)
    n_blocks: int = 4  # chain pipelining depth
    lasp1_serial_frac: float = 1.0  # share of a pass that waits for S_in (1.0: ours; LASP-1 paper < 1)
    lasp2_overlap: bool = False


def kernel_seconds(T: int, kernel_ms: dict[int, float]) -> float:
    """Interpolate (or extrapolate) the measured time linearly in T; one point scales with T."""
    pts = sorted((int(t), float(ms)) for t, ms in kernel_ms.items())
    if not pts:
        raise ValueError("no kernel times given")
    if len(pts) == 1:
        t0, m0 = pts[0]
        return m0 * T / t0 * 1e-3
    # the two measured lengths closest to T define the line
    (t0, m0), (t1, m1) = sorted(sorted(pts, key=lambda p: abs(p[0] - T))[:2])
    slope = (m1 - m0) / (t1 - t0)
    return max(m0 + slope * (T - t0), 0.0) * 1e-3


def lasp1_sim(P: int, c_fwd: float, c_bwd: float, serial_frac: float, st: StateArgs,
              topo: Topology) -> float:
    """Forward wave 0 -> P-1, then backward wave P-1 -> 0 (rank p starts its backward when its own
    forward is done); returns when the last rank finishes its backward."""
    msg = st.state_bytes + st.decay_bytes
    f = serial_frac
    fwd_end = []
    arrive = 0.0
    for p in range(P):
        start_serial = max((1 - f) * c_fwd, arrive)
        end = start_serial + f * c_fwd
        fwd_end.append(end)
        if p + 1 < P:
            arrive = end + topo.link(p, p + 1).p2p(msg)
    arrive = 0.0
    last = 0.0
    for p in reversed(range(P)):
        start = fwd_end[p]
        start_serial = max(start + (1 - f) * c_bwd, arrive)
        end = start_serial + f * c_bwd
        last = max(last, end)
        if p > 0:
            arrive = end + topo.link(p, p - 1).p2p(msg)
    return last


def lasp1_closed(P: int, c_fwd: float, c_bwd: float, tau: float) -> float:
    """Fully serial (serial_frac = 1), uniform link: P passes and P - 1 hops each way."""
    return P * (c_fwd + c_bwd) + 2 * (P - 1) * tau


def op_times(P: int, T_local: int, args: OpArgs, topo: Topology, dev: DeviceArgs) -> dict:
    """Seconds per method for one fwd+bwd, plus which All-Scan the zeco row used."""
    c = kernel_seconds(T_local, args.kernel_ms)
    c_f, c_b = args.fwd_frac * c, (1 - args.fwd_frac) * c
    st = StateArgs(H=args.H, K=args.K, V=args.V)

    def exposed(t_comm: float, c_pass: float, overlap: bool) -> float:
        return max(0.0, t_comm - args.intra_frac * c_pass) if overlap else t_comm

    def zeco_time(algorithm: str) -> tuple[float, float, str]:
        scan, algo = scan_time(P, st, topo, dev, algorithm, args.n_blocks)
        t = c * (1 + args.zeco_extra_frac) if P > 1 else c
        return t + exposed(scan, c_f, args.zeco_overlap) + exposed(scan, c_b, args.zeco_overlap), scan, algo

    zeco, scan, algo = zeco_time(args.scan)
    zeco_chain = zeco_time("chain")[0]  # the paper's schedule, whatever args.scan picks
    ag = allgather_scan(P, st, topo, dev)
    lasp2 = c + exposed(ag, c_f, args.lasp2_overlap) + exposed(ag, c_b, args.lasp2_overlap)
    lasp1 = lasp1_sim(P, c_f, c_b, args.lasp1_serial_frac, st, topo)
    return dict(none=c, zeco=zeco, zeco_chain=zeco_chain, lasp1=lasp1, lasp2=lasp2, scan_algo=algo, scan_s=scan, allgather_s=ag)


def op_rows(P_list: list[int], T_list: list[int], args: OpArgs, topo: Topology, dev: DeviceArgs) -> list[dict]:
    rows = []
    for T in T_list:
        for P in P_list:
            r = op_times(P, T, args, topo, dev)
            rows.append(dict(T_local=T, P=P, scan=r["scan_algo"],
                             **{f"{m}_ms": r[m] * 1e3 for m in ("none", "zeco", "zeco_chain", "lasp1", "lasp2")}))
    return rows
