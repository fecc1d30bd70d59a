"""Calibrate the cost model from raw benchmark outputs, record which file each input came from, and
compare the model with every measured point.

    python -m lingua_zeco.perf_model what=check raw=docs/results/raw/2026-11-30-h200x2
    python -m lingua_zeco.perf_model what=op raw=docs/results/raw/2026-11-30-h200x2 P=8,64,256

`raw`, `raw_fused` (the current operator's bench_fused) and `raw_1gpu` are read by raw_files.py; by default
they are the committed measurements RAW, RAW_FUSED and RAW_1GPU. What is fitted, and from which rows:
  links.nvlink   alpha = per-block slope of the chain rows (time = fixed + n_blocks * alpha + bytes-term,
                 relative least squares over every chain<n> row at the measured P); coll_alpha from the
                 all-gather / all-reduce rows (mean residual of the ring model). beta is assumed
                 (inputs.ASSUMED): the P2P sweep is latency-bound, its fitted slope is noise.
  dev            scan_fixed_s, scan_s_per_byte (intercept and bytes-slope of the same fit);
                 tree_round_s = tree rows minus the model's one-round tree.
  links.ib       not measured: NVLink's alpha and coll_alpha + inputs.IB_EXTRA_S (links.complete_links).
  op             kernel_ms from the fla rows; compose_extra_ms per T from the lasp2 rows; scan_op_overhead_s
                 from the zeco row at the smallest T (the other T are checks), with the extra compute of the
                 operator those rows ran (raw's own bench_fused.json); lasp1_serial_frac: mean over T of the
                 value that reproduces each lasp1 row. zeco_extra_by_T, what the predictions use: raw_fused's
                 rows (fused_extra: the fused operator against the single-device one), else raw's.
  tput           tok_s: the newest single-GPU tokens/s of our trainer ("ours" rows of raw_1gpu), tok_s_world 1;
                 without them, metrics_dp.jsonl: median tokens/s/GPU over the logged steps after the first,
                 T_local = tokens_global / world (world of the comm file), tok_s_world = that world; other
                 lengths: that value times the ratio of fla's single-GPU tokens/s (raw_1gpu) at the two lengths.
`what=check` puts raw's measurements beside the model fed what was measured with them (raw's bench_fused.json
and metrics_dp.jsonl): check_inputs.
"""
from __future__ import annotations

import glob
import os
import statistics
from dataclasses import replace

import numpy as np

from .inputs import assumed_origin
from .links import Topology, TopologyArgs, default_links
from .op_model import OpArgs, op_times
from .raw_files import find, fused_rows, load_fused, load_raw, median_tok_s, read_json, shown, single_gpu_runs
from .schedules import DeviceArgs, StateArgs, method_time
from .throughput import ThroughputArgs, tokens_per_gpu

RAW = "docs/results/raw/2026-11-30-h200x2"  # 2 x H200, NVLink: comm_P2, op_P2, bench_fused, metrics_*.jsonl
# one H200, the newest measurements: bench_fused JSON (run*/bench_fused.json) and bench_train JSON of our trainer
# the newest bench_fused of today's kernels (16K; the model holds 16K's extra at longer T_local)
RAW_FUSED = "docs/results/raw/2026-12-05-h200/launch"
RAW_1GPU = "docs/results/raw/2026-12-05-h200/step_144d849"  # the newest one-GPU step: compiled blocks, bf16


def alpha_split(alpha_s: float, p2p_rows: list[dict], source: str) -> dict:
    """The chain's cost per message (alpha_s, fitted) split into what the transport costs and what the
    scan adds on top: transport = the fastest one-way time of the P2P ping-pong (torch's isend/irecv on
    this link, any size: the sweep is latency-bound), ours = the rest (staging, the combine kernel, waits,
    Python). Both measured from one file; the 256-GPU prediction scales both with the message count."""
    transport = min(r["median_us"] for r in p2p_rows) * 1e-6
    return dict(per_message_us=alpha_s * 1e6, transport_us=transport * 1e6, ours_us=(alpha_s - transport) * 1e6,
                source=source)


def symm_hop_fit(folder: str) -> tuple[float, str]:
    """The symm transport's cost per hop at zero bytes (seconds) and its source, from bench_comm's
    one-GPU loopback files (comm_loopback_P*.json): relative least squares of the one-kernel chain rows,
    time = fixed + (P - 1)·(alpha + bytes·slope), over every P and state size. The loopback has no NVLink
    wire time; the model's bytes/beta per hop stands for it."""
    files = sorted(glob.glob(os.path.join(find(folder), "comm_loopback_P*.json")))
    rows = [r for f in files for r in read_json(f)["results"] if r["method"] == "loopback_symm_chain1"]
    if len({r["P"] for r in rows}) < 2:
        raise FileNotFoundError(f"symm={folder}: needs comm_loopback_P*.json files (bench_comm loopback=P) "
                                f"with loopback_symm_chain1 rows at two P or more; found {len(files)} files")
    X = np.array([[1.0, r["P"] - 1, (r["P"] - 1) * r["state_bytes"]] for r in rows])
    y = np.array([r["median_us"] * 1e-6 for r in rows])
    (_, alpha, _), *_ = np.linalg.lstsq(X / y[:, None], np.ones_like(y), rcond=None)
    used = ", ".join(shown(f) for f in files)
    return float(alpha), (f"measured: {used} (one-kernel symm hop on one GPU, {len(rows)} rows: per-hop slope at "
                          f"zero bytes; NVLink's wire time is the bytes/beta term)")


def calibrate(raw: str = RAW, topology: str = "hier", gpus_per_node: int = 8, raw_1gpu: str | None = RAW_1GPU,
              raw_fused: str | None = RAW_FUSED):
    """Returns (Topology, DeviceArgs, OpArgs, ThroughputArgs, notes) fitted to the files in `raw`, the fused
    operator's extra from `raw_fused` and the single-GPU runs in `raw_1gpu` (None: raw's own bench_fused.json,
    no single-GPU runs); notes["sources"] names the file behind every fitted input."""
    data = load_raw(raw)
    notes: dict = {"sources": {}}
    src = notes["sources"]
    links, dev = _fit_comm(data, notes) if data.get("comm") else (default_links(), DeviceArgs())
    topo = Topology(TopologyArgs(kind=topology, gpus_per_node=gpus_per_node), links)
    op = _fit_op(data, topo, dev, src) if data.get("op") else OpArgs()
    if raw_fused:  # the predictions use the newest operator; the fit above, the one raw's rows ran
        op.zeco_extra_by_T, src["op.zeco_extra_by_T"] = load_fused(raw_fused)
    notes["single_gpu"] = single_gpu_runs(raw_1gpu) if raw_1gpu else {}
    return topo, dev, op, _fit_tput(data, notes["single_gpu"], src), notes


def _state(row: dict, comm: dict) -> StateArgs:
    """The state one bench_comm row exchanged: the row's heads, the run's head dims."""
    return StateArgs(H=row["H"], K=comm["args"]["head_k"], V=comm["args"]["head_v"])


def _fit_comm(data: dict, notes: dict) -> tuple[dict, DeviceArgs]:
    """NVLink's latencies and the scan's software costs from comm_P*.json; notes get their sources, the
    P2P one-way times and alpha_split."""
    comm, files, src = data["comm"], data["files"], notes["sources"]
    rows = [r for r in comm["results"] if r["P"] > 1]
    P = rows[0]["P"]
    chain = [r for r in rows if r["method"].startswith("chain")]
    # chain at the measured P: fixed + (n + P - 2) * alpha + bytes-term (one block per hop, P - 1 hops)
    X = [[1.0, int(r["method"][5:]) + P - 2, _state(r, comm).msg_bytes] for r in chain]
    y = np.array([r["median_us"] * 1e-6 for r in chain])
    w = 1 / y  # relative least squares: every row's error counts alike
    (fixed, alpha, per_byte), *_ = np.linalg.lstsq(np.array(X) * w[:, None], y * w, rcond=None)
    links = default_links()
    # coll_alpha_s is fitted last: no collective in the P2P fits below
    nv = replace(links["nvlink"], alpha_s=float(alpha), coll_alpha_s=0.0)
    dev = DeviceArgs(scan_fixed_s=float(fixed), scan_s_per_byte=max(float(per_byte) - 1 / nv.beta_Bps, 0.0))
    how = f"measured: {files['comm']}"
    src["link.nvlink.alpha_s"] = (f"{how} (per-block slope of the {len(chain)} chain rows, "
                                  "relative least squares)")
    src["dev.scan_fixed_s"] = f"{how} (intercept of the chain fit)"
    src["dev.scan_s_per_byte"] = f"{how} (bytes-slope of the chain fit minus 1/beta)"
    topo1 = Topology(TopologyArgs(kind="nvlink"), {**links, "nvlink": nv})

    def residuals(method_rows: list[dict]) -> list[float]:  # measured minus the model, seconds
        return [r["median_us"] * 1e-6 - method_time(r["method"], P, _state(r, comm), topo1, dev)
                for r in method_rows]

    trees = [r for r in rows if r["method"] == "tree"]
    if trees:
        rounds = max(1, (P - 1).bit_length())
        dev = replace(dev, tree_round_s=max(statistics.mean(residuals(trees)) / rounds, 0.0))
        src["dev.tree_round_s"] = f"{how} (tree rows minus the alpha-beta tree, per round)"
    colls = [r for r in rows if r["method"] in ("allgather", "allreduce")]
    coll_alpha = float("nan")
    if colls:
        coll_alpha = statistics.mean(residuals(colls))
        src["link.nvlink.coll_alpha_s"] = (f"{how} (all-gather / all-reduce rows: "
                                           "mean residual of the ring model)")
    links["nvlink"] = replace(nv, coll_alpha_s=coll_alpha)
    for f in ("alpha_s", "coll_alpha_s"):
        src[f"link.ib.{f}"] = f"{assumed_origin(f'link.ib.{f}')} (NVLink's from {files['comm']})"
    notes["p2p_one_way_us"] = {r["bytes"]: r["median_us"] for r in comm.get("p2p", [])}
    if comm.get("p2p"):
        notes["alpha_split"] = alpha_split(float(alpha), comm["p2p"], files["comm"])
    return links, dev


def _fit_op(data: dict, topo: Topology, dev: DeviceArgs, src: dict) -> OpArgs:
    """The operator's measured inputs from op_P*.json and bench_fused.json."""
    opd, op = data["op"], OpArgs()
    res = opd["results"]
    P = res[0]["P"]
    base = "fla" if any(r["method"] == "fla" for r in res) else "none"
    op.kernel_ms = {r["T_local"]: r["median_ms"] for r in res if r["method"] == base}
    op.n_blocks = int(opd["args"].get("n_blocks", op.n_blocks))
    how = f"measured: {data['files']['op']}"
    src["op.kernel_ms"] = f"{how} ({base} rows, B=1 H={opd['args']['heads']} K=V={opd['args']['head_k']})"
    if data.get("fused"):  # the operator the zeco rows ran
        op.zeco_extra_by_T, src["op.zeco_extra_by_T"] = fused_rows(data["fused"], data["files"]["fused"])
    meas = {(r["method"], r["T_local"]): r["median_ms"] * 1e-3 for r in res}
    Ts = sorted(op.kernel_ms)
    # composition path: what lasp2 costs beyond kernel + exposed all-gathers
    op.compose_extra_ms = {T: (meas["lasp2", T] - op_times(P, T, op, topo, dev)["lasp2"]) * 1e3
                           for T in Ts if ("lasp2", T) in meas}
    if op.compose_extra_ms:
        src["op.compose_extra_ms"] = f"{how} (lasp2 rows minus kernel and all-gathers)"
    # in-operator scan overhead of the fused path, from the smallest T (chain, as bench_op ran it)
    if ("zeco", Ts[0]) in meas:
        op.scan_op_overhead_s = _bisect(
            lambda d: op_times(P, Ts[0], replace(op, scan="chain", scan_op_overhead_s=d), topo, dev)["zeco"],
            meas["zeco", Ts[0]], 0.0, 0.05)
        src["op.scan_op_overhead_s"] = f"{how} (zeco row at T={Ts[0]}, with the extra of raw's own bench_fused.json)"
    fs = [_bisect(lambda f, T=T: op_times(P, T, replace(op, lasp1_serial_frac=f), topo, dev)["lasp1"],
                  meas["lasp1", T], 0.0, 1.0) for T in Ts if ("lasp1", T) in meas]
    if fs:
        op.lasp1_serial_frac = statistics.mean(fs)
        src["op.lasp1_serial_frac"] = f"{how} (mean over the lasp1 rows of the value reproducing each)"
    return op


def _fit_tput(data: dict, runs: dict[str, dict[int, dict]], src: dict) -> ThroughputArgs:
    """Training tokens/s/GPU: our trainer's newest single-GPU runs, else metrics_dp.jsonl with other lengths
    through fla's single-GPU runs, else fla's own."""
    tput, files = ThroughputArgs(), data["files"]

    def used(variant: str) -> str:
        return ", ".join(sorted({f for run in runs[variant].values() for f in run["files"]}))
    dp = data["metrics"].get("dp")
    if runs.get("ours"):  # the default trainer's own step, one GPU: no gradient sync in it
        tput.tok_s, tput.tok_s_world = {t: run["tok_s"] for t, run in runs["ours"].items()}, 1
        per_T = "; ".join(f"T={t}: {run['files'][0]} ({run['rows']} row{'s' * (run['rows'] > 1)}, median)"
                          for t, run in runs["ours"].items())
        src["tput.tok_s"] = f"measured: {per_T} (variant ours, one GPU, the newest file per length)"
        src["tput.tok_s_world"] = f"measured: {used('ours')} (world size 1)"
    elif dp:
        world = (data.get("comm") or {}).get("world_size", 1)
        T = int(dp[0]["tokens_global"] // world)
        tput.tok_s, tput.tok_s_world = {T: median_tok_s(dp)}, world
        how = f"measured: {files['metrics_dp']} (median tokens/s/GPU after the first logged step, T={T})"
        src["tput.tok_s_world"] = f"measured: {files.get('comm', files['metrics_dp'])} (world size)"
        fla = runs.get("fla", {})
        if T in fla:  # other lengths: the trainer's value times fla's single-GPU ratio between the lengths
            ratio = tput.tok_s[T] / fla[T]["tok_s"]
            for t, run in fla.items():
                tput.tok_s.setdefault(t, run["tok_s"] * ratio)
            how += f"; other lengths scaled by fla's single-GPU tokens/s in {used('fla')}"
        src["tput.tok_s"] = how
    elif runs.get("fla"):  # no trainer run: fla's own single-GPU throughput
        tput.tok_s = {t: run["tok_s"] for t, run in runs["fla"].items()}
        src["tput.tok_s"] = f"measured: {used('fla')} (fla, one GPU)"
        src["tput.tok_s_world"] = f"measured: {used('fla')} (world size 1)"
    return tput


def _bisect(fn, target: float, lo: float, hi: float, iters: int = 60) -> float:
    """x in [lo, hi] with fn(x) = target for a non-decreasing fn (clamped at the ends)."""
    if fn(lo) >= target:
        return lo
    if fn(hi) <= target:
        return hi
    for _ in range(iters):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if fn(mid) < target else (lo, mid)
    return (lo + hi) / 2


def check_inputs(data: dict, op: OpArgs, tput: ThroughputArgs) -> tuple[OpArgs, ThroughputArgs]:
    """The inputs that describe the code raw's points ran: its own bench_fused.json extra and the trainer's
    step of its metrics_dp.jsonl, where the folder has them (the predictions may use newer ones)."""
    if data.get("fused"):
        op = replace(op, zeco_extra_by_T=fused_rows(data["fused"], data["files"]["fused"])[0])
    if data["metrics"].get("dp"):
        step = _fit_tput(data, {}, {})
        tput = replace(tput, tok_s=step.tok_s, tok_s_world=step.tok_s_world)
    return op, tput


def check_rows(raw: str, topo: Topology, dev: DeviceArgs, op: OpArgs, tput: ThroughputArgs) -> list[dict]:
    """Every measured point beside the calibrated model's value and the error (model/measured - 1); the
    model is fed what was measured with those points (check_inputs)."""
    data = load_raw(raw)
    op, tput = check_inputs(data, op, tput)
    out = []

    def add(table, point, measured, model, unit, role):
        out.append(dict(table=table, point=point, measured=measured, model=model, unit=unit,
                        err_pct=(model / measured - 1) * 100, role=role))

    comm = data.get("comm")
    if comm:
        for r in comm["results"]:
            v = method_time(r["method"], r["P"], _state(r, comm), topo, dev)
            add("comm", f"{r['method']} H={r['H']} P={r['P']}", r["median_us"], v * 1e6, "µs", "fit")
    chain_op = replace(op, scan="chain")  # the All-Scan bench_op and the trainer ran
    opd = data.get("op")
    if opd:
        T0 = min(r["T_local"] for r in opd["results"])  # the zeco row there is fitted, the others checked
        for r in opd["results"]:
            P, T, m = r["P"], r["T_local"], r["method"]
            t = op_times(P, T, chain_op, topo, dev)["none" if m == "fla" else m]
            role = dict(fla="fit", lasp2="fit", lasp1="fit (mean f)", zeco="fit" if T == T0 else "check")
            add("op", f"{m} T={T} P={P}", r["median_ms"], t * 1e3, "ms", role.get(m, "check"))
    world = (comm or {}).get("world_size", 1)
    for name, rows in data["metrics"].items():
        T = int(rows[0]["tokens_global"] // world)
        r = tokens_per_gpu(world, T, tput, chain_op, topo, dev, sp=1 if name == "dp" else world)
        add("tput", f"{name} T={T} N={world}", median_tok_s(rows) / 1e3, r[name] / 1e3, "Ktok/s/GPU",
            "fit" if name == "dp" else "check")
    return out
