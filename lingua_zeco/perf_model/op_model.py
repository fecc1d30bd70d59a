"""Operator time of one sequence-parallel GLA call, forward + backward (paper Tables 3-4).

Fed by the measured single-GPU fla `chunk_gla` fwd+bwd time `c` at the local length (op.kernel_ms, from
the fla rows of op_P*.json: calibrate.py).
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

from .inputs import assumed, missing
from .links import Topology
from .schedules import DeviceArgs, StateArgs, allgather_scan, scan_time


@dataclass
class OpArgs:
    # fla chunk_gla fwd+bwd ms per T_local at B=1, H, K, V below, bf16: measured only (op_P*.json)
    kernel_ms: dict[int, float] = field(default_factory=dict)
    H: int = 16
    K: int = 128
    V: int = 128
    fwd_frac: float = assumed("op.fwd_frac")  # forward share of fwd+bwd (backward ~ 2x forward in fla's GLA)
    intra_frac: float = assumed("op.intra_frac")  # share of a pass that needs no S_in (intra-chunk A / dA)
    # the fused path's extra work (the D pass, the chunk gate sums, S_in folded inside the output stage):
    # measured per T_local (zeco_extra_by_T, bench_fused.json); this fraction only stands in without it
    zeco_extra_frac: float = assumed("op.zeco_extra_frac")
    zeco_overlap: bool = True  # False = composition build (scan exposed)
    scan: str = "auto"  # All-Scan algorithm for zeco: chain | tree | auto (faster of the two)
    n_blocks: int = 4  # chain pipelining depth
    lasp1_serial_frac: float = assumed("op.lasp1_serial_frac")  # share of a pass that waits for S_in (LASP-1 paper < 1)
    lasp2_overlap: bool = False
    # fitted from measurements (calibrate.py); empty / 0 = not modelled
    zeco_extra_by_T: dict[int, float] = field(default_factory=dict)  # measured fused extra compute (fraction)
    scan_op_overhead_s: float = assumed("op.scan_op_overhead_s")  # in-operator cost of a fused scan beyond the scan
    compose_extra_ms: dict[int, float] = field(default_factory=dict)  # unfused composition path (lasp2, zeco_composed)


def kernel_seconds(T: int, kernel_ms: dict[int, float]) -> float:
    """Interpolate (or extrapolate) the measured time linearly in T; one point scales with T."""
    pts = sorted((int(t), float(ms)) for t, ms in kernel_ms.items())
    if not pts:
        raise missing("op.kernel_ms")
    if len(pts) == 1:
        t0, m0 = pts[0]
        return m0 * T / t0 * 1e-3
    # the two measured lengths closest to T define the line
    (t0, m0), (t1, m1) = sorted(sorted(pts, key=lambda p: abs(p[0] - T))[:2])
    slope = (m1 - m0) / (t1 - t0)
    return max(m0 + slope * (T - t0), 0.0) * 1e-3


def interp_clamped(T: int, table: dict[int, float], default: float) -> float:
    """Linear in T between measured lengths, the nearest measurement outside them."""
    pts = sorted((int(t), float(v)) for t, v in table.items())
    if not pts:
        return default
    if T <= pts[0][0]:
        return pts[0][1]
    if T >= pts[-1][0]:
        return pts[-1][1]
    (t0, v0), (t1, v1) = next((a, b) for a, b in zip(pts, pts[1:]) if T <= b[0])  # the segment holding T
    return v0 + (v1 - v0) * (T - t0) / (t1 - t0)


def lasp1_sim(P: int, c_fwd: float, c_bwd: float, serial_frac: float, st: StateArgs,
              topo: Topology) -> float:
    """Forward wave 0 -> P-1, then backward wave P-1 -> 0 (rank p starts its backward when its own
    forward is done); returns when the last rank finishes its backward."""
    f = serial_frac
    fwd_end = []
    arrive = 0.0
    for p in range(P):  # the serial part of rank p's pass starts once S_in has arrived
        fwd_end.append(max((1 - f) * c_fwd, arrive) + f * c_fwd)
        if p + 1 < P:
            arrive = fwd_end[p] + topo.link(p, p + 1).p2p(st.msg_bytes)
    arrive = last = 0.0
    for p in reversed(range(P)):
        end = max(fwd_end[p] + (1 - f) * c_bwd, arrive) + f * c_bwd
        last = max(last, end)
        if p > 0:
            arrive = end + topo.link(p, p - 1).p2p(st.msg_bytes)
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

    extra = interp_clamped(T_local, args.zeco_extra_by_T, args.zeco_extra_frac)
    compose = kernel_seconds(T_local, args.compose_extra_ms) if args.compose_extra_ms and P > 1 else 0.0

    def zeco_time(algorithm: str) -> tuple[float, float, str]:
        scan, algo = scan_time(P, st, topo, dev, algorithm, args.n_blocks)
        if P <= 1:
            return c, 0.0, algo
        s_op = scan + args.scan_op_overhead_s
        return (c * (1 + extra) + exposed(s_op, c_f, args.zeco_overlap) + exposed(s_op, c_b, args.zeco_overlap),
                scan, algo)

    zeco, scan, algo = zeco_time(args.scan)
    zeco_chain = zeco_time("chain")[0]  # the paper's schedule, whatever args.scan picks
    zeco_composed = c + compose + 2 * scan  # reference build: unfused correction, scans exposed
    ag = allgather_scan(P, st, topo, dev)
    lasp2 = c + compose + exposed(ag, c_f, args.lasp2_overlap) + exposed(ag, c_b, args.lasp2_overlap)
    lasp1 = lasp1_sim(P, c_f, c_b, args.lasp1_serial_frac, st, topo)
    return dict(none=c, zeco=zeco, zeco_chain=zeco_chain, zeco_composed=zeco_composed, lasp1=lasp1, lasp2=lasp2,
                scan_algo=algo, scan_s=scan, allgather_s=ag)


OP_COLS = ("none", "zeco", "zeco_chain", "zeco_composed", "lasp1", "lasp2")  # op_rows: one column each


def op_rows(P_list: list[int], T_list: list[int], args: OpArgs, topo: Topology, dev: DeviceArgs) -> list[dict]:
    rows = []
    for T in T_list:
        for P in P_list:
            r = op_times(P, T, args, topo, dev)
            rows.append(dict(T_local=T, P=P, scan=r["scan_algo"], **{f"{m}_ms": r[m] * 1e3 for m in OP_COLS}))
    return rows
