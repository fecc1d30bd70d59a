"""`python -m lingua_zeco.perf_model {comm,op,throughput,memory,all} [options] [--set key=value ...]`

Examples:
    python -m lingua_zeco.perf_model comm --P 2,8,64,256 --H 16,32
    python -m lingua_zeco.perf_model op --P 8,16,32,64,128,256,512,1024 --T 16384,32768 \
        --calib results/comm/comm.json --calib results/op/op.json --set op.scan=chain
    python -m lingua_zeco.perf_model throughput --P 8,16,32,64,128,256 --T 16384
    python -m lingua_zeco.perf_model memory --T 16384 --P 8 --set mem.fsdp=8 --set mem.act_ckpt=full
`--set` reaches any field: op.*, tput.*, mem.*, mem.shape.*, dev.*, topo.*, link.<name>.*.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from .links import Topology, TopologyArgs, apply_link_calibration, default_links, load_calibration, numeric_keys
from .memory import MemoryArgs, peak_memory
from .op_model import OpArgs, op_rows
from .schedules import DeviceArgs, comm_rows
from .throughput import ThroughputArgs, throughput_rows


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m lingua_zeco.perf_model", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", nargs="?", default="all", choices=["comm", "op", "throughput", "memory", "all", "check"])
    ap.add_argument("--P", type=_ints, default=[8, 16, 32, 64, 128, 256, 512, 1024], help="SP sizes / GPU counts")
    ap.add_argument("--T", type=_ints, default=[16384, 32768], help="local sequence lengths")
    ap.add_argument("--H", type=_ints, default=[32, 16], help="heads per state (comm table)")
    ap.add_argument("--blocks", type=_ints, default=[1, 2, 4, 8], help="chain pipelining depths")
    ap.add_argument("--topology", default="hier", help="hier | nvlink | ib | any calibrated link name")
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--calib", action="append", default=[], help="JSON from bench_comm / bench_op (repeatable)")
    ap.add_argument("--raw", default=None, help="folder of raw bench outputs: calibrate everything from it "
                    "(calibrate.py); 'check' compares every measured point with the model")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a field")
    ap.add_argument("--json", default=None, help="also write every table here")
    return ap.parse_args(argv)


def _coerce(old, text: str):
    if isinstance(old, bool):
        if text.lower() not in ("true", "false", "1", "0"):
            raise ValueError(f"expected a boolean, got {text!r}")
        return text.lower() in ("true", "1")
    if isinstance(old, dict):
        return {int(k): float(v) for k, v in json.loads(text).items()}
    return type(old)(text) if old is not None else text


def apply_set(targets: dict[str, object], item: str) -> None:
    """`op.intra_frac=0.3` or `link.ib.alpha_s=1.5e-5`: walk attributes / dict keys, refuse unknowns."""
    key, sep, text = item.partition("=")
    if not sep:
        raise SystemExit(f"--set needs KEY=VALUE, got {item!r}")
    head, *path = key.split(".")
    if head not in targets or not path:
        raise SystemExit(f"--set {key}: prefix must be one of {sorted(targets)}")
    obj = targets[head]
    for part in path[:-1]:
        obj = obj[part] if isinstance(obj, dict) else getattr(obj, part)
    name = path[-1]
    if not dataclasses.is_dataclass(obj) or name not in {f.name for f in dataclasses.fields(obj)}:
        raise SystemExit(f"--set {key}: no such field")
    setattr(obj, name, _coerce(getattr(obj, name), text))


def build(ns: argparse.Namespace):
    cal = load_calibration(ns.calib)
    op, tput, mem, dev = OpArgs(), ThroughputArgs(), MemoryArgs(), DeviceArgs()
    links = default_links()
    if ns.raw:
        from .calibrate import calibrate
        topo_raw, dev, op, tput, _ = calibrate(ns.raw, ns.topology, ns.gpus_per_node)
        links = dict(topo_raw.links)
    links = apply_link_calibration(links, cal)
    op.kernel_ms.update(numeric_keys(cal["kernel_ms"]))
    tput.tok_s.update(numeric_keys(cal["tok_s"]))
    topo_args = TopologyArgs(kind=ns.topology, gpus_per_node=ns.gpus_per_node)
    targets = dict(op=op, tput=tput, mem=mem, dev=dev, topo=topo_args, link=links)
    for item in ns.set:
        apply_set(targets, item)
    return Topology(topo_args, links), dev, op, tput, mem


def format_table(rows: list[dict], title: str) -> str:
    if not rows:
        return f"## {title}\n(no rows)\n"
    cols = list(rows[0])

    def cell(v):
        if isinstance(v, float):
            return f"{v:.4g}" if abs(v) < 1e4 else f"{v:.0f}"
        return str(v)

    cells = [[cell(r.get(c, "")) for c in cols] for r in rows]
    width = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    line = lambda vals: "| " + " | ".join(v.rjust(w) for v, w in zip(vals, width)) + " |"  # noqa: E731
    out = [f"## {title}", line(cols), "|" + "|".join("-" * (w + 2) for w in width) + "|"]
    out += [line(row) for row in cells]
    return "\n".join(out) + "\n"


def run(ns: argparse.Namespace) -> dict[str, list[dict]]:
    topo, dev, op, tput, mem = build(ns)
    tables: dict[str, list[dict]] = {}
    if ns.what == "check":
        if not ns.raw:
            raise SystemExit("check needs --raw FOLDER")
        from .calibrate import check_rows
        tables["check"] = check_rows(ns.raw, topo, dev, op, tput)
    if ns.what in ("comm", "all"):
        tables["comm"] = comm_rows(ns.P, ns.H, topo, dev, tuple(ns.blocks))
    if ns.what in ("op", "all"):
        tables["op"] = op_rows(ns.P, ns.T, op, topo, dev)
    if ns.what in ("throughput", "all"):
        tables["throughput"] = throughput_rows(ns.P, ns.T, tput, op, topo, dev)
    if ns.what in ("memory", "all"):
        rows = []
        for T in ns.T:
            for P in ns.P:
                for method in ("none", "zeco", "lasp2"):
                    m = dataclasses.replace(mem, T_local=T, sp=P, method=method)
                    r = peak_memory(m)
                    rows.append(dict(T_local=T, sp=P, fsdp=m.fsdp or P, method=method, ckpt=m.act_ckpt,
                                     **{k.split("_")[0] + "_GiB": v for k, v in r.items() if k != "n_params"}))
        tables["memory"] = rows
    return tables


def comm_pivot(rows: list[dict]) -> list[dict]:
    """One line per (H, P), one column per method: easier to read than the long form."""
    out: dict[tuple, dict] = {}
    for r in rows:
        line = out.setdefault((r["H"], r["P"]), dict(H=r["H"], P=r["P"]))
        line[r["method"] + "_us"] = r["time_us"]
    return list(out.values())


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    tables = run(ns)
    titles = dict(comm="Table 2 model: one exclusive scan (µs)", op="Tables 3-4 model: operator fwd+bwd (ms)",
                  throughput="Tables 5-6 model: tokens/s/GPU (K)", memory="Peak memory per GPU (GiB)",
                  check="Measured vs calibrated model (err = model / measured - 1)")
    for name, rows in tables.items():
        shown = comm_pivot(rows) if name == "comm" else rows
        sys.stdout.write(format_table(shown, titles[name]) + "\n")
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(dict(args=vars(ns), tables=tables), f, indent=1)
        print(f"wrote {ns.json}")
    return 0
