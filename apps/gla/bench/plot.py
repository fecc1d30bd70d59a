"""Figures like the paper's Fig. 3 (communication time vs P) and Fig. 4 (operator time vs P):
measured points from bench_comm / bench_op JSON files, lines from lingua_zeco.perf_model calibrated
with the same files (P2P alpha/beta, baseline kernel time).

    python -m apps.gla.bench.plot comm=results/bench_comm op=results/bench_op out=docs/figures
"""
from __future__ import annotations

import glob
import json
import os
import statistics
from collections import defaultdict
from dataclasses import dataclass

from apps.gla.plot_metrics import pyplot, save_figure
from lingua_zeco import reliability
from lingua_zeco.args import ConfigError, parse_args
from lingua_zeco.perf_model.links import (Topology, TopologyArgs, apply_link_calibration, default_links,
                                          load_calibration)
from lingua_zeco.perf_model.op_model import OpArgs, op_times
from lingua_zeco.perf_model.schedules import (DeviceArgs, StateArgs, allgather_scan, allreduce_state, chain_sim,
                                              hier_scan, tree_sim)

COLORS = dict(chain1="tab:gray", chain2="tab:olive", chain4="tab:green", chain8="tab:cyan", tree="tab:purple",
              allgather="tab:red", allreduce="tab:brown", none="black", fla="tab:gray", zeco="tab:green",
              lasp1="tab:orange", lasp2="tab:red", zeco_composed="tab:blue", hier="tab:pink")
# paper (arXiv 2507.01004, H100), operator fwd+bwd at 16K per GPU: only the end points it reports
PAPER_OP_16K = dict(zeco={8: 7.3, 128: 9.9}, lasp2={8: 19.4, 128: 35.7}, lasp1={8: 22.6, 128: 113.7})


@dataclass
class PlotArgs:
    comm: str = "results/bench_comm"  # folder of comm_P*.json, or comma-separated files ("" = skip)
    op: str = "results/bench_op"  # folder of op_P*.json, or comma-separated files ("" = skip)
    out: str = "docs/figures"  # folder of the PNGs
    model_max_p: int = 256  # draw the model out to this P
    topology: str = ""  # "" = the measured link (one node) extended by perf_model's "hier" preset
    gpus_per_node: int = 8  # GPUs per node of the modelled topology
    scan: str = "chain"  # All-Scan the zeco model line assumes: chain | tree | auto
    n_blocks: int = 4  # chain All-Scan blocks of the zeco model line (0: chosen by the alpha-beta model)
    raw: str = ""  # folder of raw bench outputs: measured points from it, model calibrated by perf_model.calibrate


def json_files(spec: str, prefix: str) -> list[str]:
    if os.path.isdir(spec):
        return sorted(glob.glob(os.path.join(spec, f"{prefix}_P*.json")))
    return [p for p in spec.split(",") if p]


def calibrated(args: PlotArgs):
    """(Topology, DeviceArgs, OpArgs) from perf_model.calibrate when args.raw is set, else None."""
    if not args.raw:
        return None
    from lingua_zeco.perf_model.calibrate import calibrate
    topo, dev, op, _, _ = calibrate(args.raw, args.topology or "hier", args.gpus_per_node)
    op.scan, op.n_blocks = args.scan, args.n_blocks
    return topo, dev, op


def model_topology(args: PlotArgs, files: list[str]) -> Topology:
    cal = load_calibration(files)
    links = apply_link_calibration(default_links(), cal)
    # gloo: CPU smoke runs, every hop is loopback TCP
    kind = args.topology or ("gloo" if "gloo" in cal["links"] else "hier")
    return Topology(TopologyArgs(kind=kind, gpus_per_node=args.gpus_per_node), links)


def p_range(measured: list[int], top: int, lowest: int = 2) -> list[int]:
    """Powers of two up to `top` plus every measured P >= lowest (P=1 exchanges nothing)."""
    hi = max([top, *measured])
    ps, p = [], lowest
    while p <= hi:
        ps.append(p)
        p *= 2
    return sorted(set(ps) | {m for m in measured if m >= lowest})


def measured(args: PlotArgs, files: list[str], comm_files: list[str]):
    """(the files' JSON, their result rows, perf_model.calibrate's (topology, device, op) or None, the
    topology and device of the model lines), None when the files hold no results."""
    data = [json.load(open(f)) for f in files]
    rows = [r for d in data for r in d["results"]]
    if not rows:
        return None
    cal = calibrated(args)
    topo, dev = cal[:2] if cal else (model_topology(args, comm_files), DeviceArgs())
    return data, rows, cal, topo, dev


def finish_axes(fig, ax, ps: list[int], ylabel: str, title: str, path: str) -> str:
    """Log-log axes over GPUs P with a tick at each P, legend, grid; the figure written to `path`."""
    ax.set(xscale="log", yscale="log", xlabel="GPUs P", ylabel=ylabel, title=title)
    ax.set_xticks(ps, [str(p) for p in ps])
    ax.legend(fontsize=6, ncol=2)
    ax.grid(True, which="both", alpha=0.3)
    return save_figure(fig, path, dpi=130)


def plot_comm(args: PlotArgs, files: list[str]) -> list[str]:
    if (got := measured(args, files, files)) is None:
        return []
    data, rows, cal, topo, dev = got
    bench_args = data[0]["args"]
    written = []
    for H in sorted({r["H"] for r in rows}, reverse=True):
        st = StateArgs(H=H, K=bench_args["head_k"], V=bench_args["head_v"])
        fig, ax = pyplot().subplots(figsize=(6.4, 4.4))
        mine = [r for r in rows if r["H"] == H]
        methods = sorted({r["method"] for r in mine}, key=list(COLORS).index)
        ps = p_range(sorted({r["P"] for r in mine}), args.model_max_p)
        for m in methods:
            pts = sorted((r["P"], r["median_us"]) for r in mine if r["method"] == m and r["P"] > 1)
            if pts:
                ax.plot(*zip(*pts), "o", color=COLORS[m], label=f"{m} measured")
            model = {"tree": lambda P, st=st: tree_sim(P, st, topo, dev),
                     "allgather": lambda P, st=st: allgather_scan(P, st, topo, dev),
                     "allreduce": lambda P, st=st: allreduce_state(P, st, topo)}.get(m)
            if m.startswith("chain"):
                model = lambda P, n=int(m[5:]), st=st: chain_sim(P, st, n, topo, dev)  # noqa: E731
            ax.plot(ps, [model(P) * 1e6 for P in ps], "-", color=COLORS[m], alpha=0.7, label=f"{m} model")
        if cal and topo.args.kind == "hier":
            ax.plot(ps, [hier_scan(P, st, topo, dev) * 1e6 for P in ps], "--", color=COLORS["hier"],
                    label="hier chain+tree model (not implemented)")
        title = f"Fig. 3: state exchange, H={H}, K×V={st.K}×{st.V} fp32 ({topo.args.kind})"
        written.append(finish_axes(fig, ax, ps, "time (µs)", title, os.path.join(args.out, f"fig3_comm_H{H}.png")))
    return written


def plot_op(args: PlotArgs, op_files: list[str], comm_files: list[str]) -> list[str]:
    if (got := measured(args, op_files, comm_files)) is None:
        return []
    data, rows, cal, topo, dev = got
    base_by_T = defaultdict(list)
    for d in data:
        for r in d["results"]:
            if r["method"] == d.get("baseline", "none"):
                base_by_T[r["T_local"]].append(r["median_ms"])
    kernel_ms = {T: statistics.median(v) for T, v in base_by_T.items()}
    written = []
    for T in sorted({r["T_local"] for r in rows}):
        r0 = next(r for r in rows if r["T_local"] == T)
        op = cal[2] if cal else OpArgs(kernel_ms=kernel_ms, H=r0["H"], K=r0["K"], V=r0["V"], scan=args.scan,
                                       n_blocks=args.n_blocks)
        mine = [r for r in rows if r["T_local"] == T]
        measured_ps = sorted({r["P"] for r in mine})
        ps = p_range(measured_ps, args.model_max_p, lowest=min(measured_ps[0], 2))  # P=1: the baseline
        model = [op_times(P, T, op, topo, dev) for P in ps]
        fig, ax = pyplot().subplots(figsize=(6.4, 4.4))
        for m in ("none", "fla", "zeco", "zeco_composed", "lasp1", "lasp2"):
            pts = sorted((r["P"], r["median_ms"]) for r in mine if r["method"] == m)
            if pts:
                ax.plot(*zip(*pts), "o" if m != "fla" else "x", color=COLORS[m], label=f"{m} measured")
            if m != "fla" and m in model[0]:
                ax.plot(ps, [x[m] * 1e3 for x in model], "-", color=COLORS[m], alpha=0.7, label=f"{m} model")
            if cal and T == 16384 and m in PAPER_OP_16K:
                ax.plot(*zip(*sorted(PAPER_OP_16K[m].items())), "s", mfc="none", color=COLORS[m],
                        label=f"{m} paper (H100)")
        title = f"Fig. 4: GLA operator, T_local={T}, H={op.H} ({topo.args.kind}, scan={args.scan})"
        written.append(finish_axes(fig, ax, ps, "fwd+bwd (ms)", title, os.path.join(args.out, f"fig4_op_T{T}.png")))
    return written


def main(argv: list[str] | None = None) -> list[str]:
    args = parse_args(PlotArgs, argv)
    if args.raw:
        args.comm, args.op = args.raw, args.raw
    comm_files, op_files = json_files(args.comm, "comm"), json_files(args.op, "op")
    if not comm_files and not op_files:
        raise ConfigError(f"no comm_P*.json under {args.comm!r} and no op_P*.json under {args.op!r}")
    written = plot_comm(args, comm_files) + plot_op(args, op_files, comm_files)
    for p in written:
        print(f"wrote {p}")
    return written


if __name__ == "__main__":
    with reliability.clean_exit():  # bad input: one `error: ...` line, exit code 2
        main()
