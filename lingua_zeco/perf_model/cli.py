"""`python -m lingua_zeco.perf_model what={comm,op,throughput,memory,all,check} [key=value ...]`

Examples:
    python -m lingua_zeco.perf_model what=comm P=2,8,64,256 H=16,32
    python -m lingua_zeco.perf_model what=op P=8,16,32,64,128,256,512,1024 T=16384,32768 \
        calib=results/comm/comm.json,results/op/op.json op.scan=chain
    python -m lingua_zeco.perf_model what=throughput P=8,16,32,64,128,256 T=16384
    python -m lingua_zeco.perf_model what=memory T=16384 P=8 mem.fsdp=8 mem.act_ckpt=full
    python -m lingua_zeco.perf_model what=memory T=65536,262144 P=1 mem.segment_len=16384 mem.act_ckpt=full
Besides the keys below, `prefix.field=value` sets any field of the model, after calibration:
op.*, tput.*, mem.*, mem.shape.*, dev.*, topo.*, link.<name>.*.
Every run prints its inputs first: each measured one with the file it was fitted from, the others
as "assumed, not measured" with the reason (lingua_zeco/perf_model/inputs.py).
"""
from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import dataclass, field

from lingua_zeco.args import ConfigError, parse_args

from .calibrate import RAW, RAW_1GPU, RAW_FUSED, calibrate, check_rows, symm_hop_fit
from .inputs import NotMeasured, format_inputs, inputs_rows, lookup
from .links import (Topology, TopologyArgs, apply_link_calibration, complete_links, default_links, load_calibration,
                    numeric_keys)
from .memory import MemoryArgs, peak_memory
from .op_model import OpArgs, op_rows
from .raw_files import shown
from .schedules import DeviceArgs, comm_rows
from .throughput import ThroughputArgs, throughput_rows

TABLES = ("comm", "op", "throughput", "memory", "all", "check")
MODEL_PREFIXES = ("op", "tput", "mem", "dev", "topo", "link")  # `prefix.field=value`: apply_set


@dataclass
class PerfModelArgs:
    what: str = "all"  # comm | op | throughput | memory | all | check (every measured point of raw= vs the model)
    P: list[int] = field(default_factory=lambda: [8, 16, 32, 64, 128, 256, 512, 1024])  # SP sizes / GPU counts
    T: list[int] = field(default_factory=lambda: [16384, 32768])  # local sequence lengths
    H: list[int] = field(default_factory=lambda: [32, 16])  # heads per state (comm table)
    blocks: list[int] = field(default_factory=lambda: [1, 2, 4, 8])  # chain pipelining depths
    topology: str = "hier"  # hier | nvlink | ib | any calibrated link name
    gpus_per_node: int = 8  # GPUs per node of the hier topology
    calib: list[str] = field(default_factory=list)  # JSON files from bench_comm / bench_op, applied after raw=
    # folder of raw bench outputs to calibrate from (calibrate.py); default: the committed 2 x H200 runs
    # (calibrate.RAW), or none when calib= is given (another machine's files); none: no folder
    raw: str = "default"
    # folder of single-GPU bench_train JSON (searched recursively; per variant and length the newest file):
    # our trainer's step ("ours" rows) for tokens/s, else fla's rows scale metrics_dp.jsonl to other lengths;
    # default: the committed one-H200 measurements (calibrate.RAW_1GPU) whenever raw= is used; none: not used
    raw_1gpu: str = "default"
    # the fused operator's extra work for the predictions: a bench_fused JSON, or a folder whose newest one is
    # taken; default: the committed one-H200 measurements (calibrate.RAW_FUSED) whenever raw= is used;
    # none: raw's own bench_fused.json (the operator raw's runs measured)
    raw_fused: str = "default"
    json: str = ""  # also write every table here
    # folder of bench_comm loopback=P outputs (comm_loopback_P*.json): hops inside a node at the symm
    # transport's measured cost (calibrate.symm_hop_fit); across nodes unchanged
    symm: str = ""


def parse(argv: list[str]) -> tuple[PerfModelArgs, list[str]]:
    """Our keys -> PerfModelArgs (through the project's parser); `op.scan=chain` and the like -> the
    list of model overrides, applied after calibration."""
    overrides = [a for a in argv if "=" in a and a.split("=", 1)[0].split(".")[0] in MODEL_PREFIXES]
    args = parse_args(PerfModelArgs, [a for a in argv if a not in overrides])
    if args.what not in TABLES:
        raise ConfigError(f"what={args.what!r}; choose from {', '.join(TABLES)}")
    for key in ("P", "T", "H", "blocks", "gpus_per_node"):  # sizes and counts: 0 divides by zero, < 0 gives zeros
        value = getattr(args, key)
        bad = [v for v in (value if isinstance(value, list) else [value]) if v < 1]
        if bad:
            raise ConfigError(f"{key}={bad[0]}: must be >= 1; give {key}= positive values")
    return args, overrides


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
    key, _, text = item.partition("=")
    if key.split(".")[0] not in targets or "." not in key:
        raise ConfigError(f"{key}: prefix must be one of {sorted(targets)}")
    owner, name = key.rsplit(".", 1)
    try:
        obj = lookup(targets, owner)
    except (KeyError, AttributeError) as e:
        raise ConfigError(f"{key}: no such input ({e}); every run prints its inputs first") from e
    fields = sorted(f.name for f in dataclasses.fields(obj)) if dataclasses.is_dataclass(obj) else []
    if name not in fields:
        raise ConfigError(f"{key}: no such field; valid: {', '.join(fields)}")
    setattr(obj, name, _coerce(getattr(obj, name), text))


def folders(ns: PerfModelArgs) -> tuple[str | None, str | None, str | None]:
    """The raw=, raw_1gpu= and raw_fused= paths this run calibrates from (None: none)."""
    raw = {"default": None if ns.calib else RAW, "none": None, "": None}.get(ns.raw, ns.raw)
    one = {"default": RAW_1GPU if raw else None, "none": None, "": None}.get(ns.raw_1gpu, ns.raw_1gpu)
    fused = {"default": RAW_FUSED if raw else None, "none": None, "": None}.get(ns.raw_fused, ns.raw_fused)
    return raw, one, fused


def build(ns: PerfModelArgs, overrides: list[str] = ()):
    """(Topology or None, DeviceArgs, OpArgs, ThroughputArgs, MemoryArgs, sources, notes): raw= calibration,
    then calib= files, then the overrides; `sources` names where each set input came from, `notes` holds
    the calibration's by-products (e.g. alpha_split)."""
    op, tput, mem, dev = OpArgs(), ThroughputArgs(), MemoryArgs(), DeviceArgs()
    links, notes = default_links(), {"sources": {}}
    raw, raw_1gpu, raw_fused = folders(ns)
    if raw:
        topo_raw, dev, op, tput, notes = calibrate(raw, "nvlink", ns.gpus_per_node, raw_1gpu, raw_fused)
        links = dict(topo_raw.links)
    sources: dict[str, str] = dict(notes["sources"])
    for path in ns.calib:
        cal, how = load_calibration([path]), f"measured: {shown(path)}"
        links = apply_link_calibration(links, cal)
        sources.update({f"link.{name}.{k}": how for name, fields in cal["links"].items() for k in fields})
        for key, table in (("op.kernel_ms", op.kernel_ms), ("tput.tok_s", tput.tok_s)):
            new = numeric_keys(cal[key.split(".")[1]])
            if new:
                table.update(new)
                sources[key] = how
    if ns.symm:  # after IB took its latencies from NVLink's NCCL-measured ones
        links = complete_links(links)
        alpha, sources["link.nvlink.alpha_s"] = symm_hop_fit(ns.symm)
        links["nvlink"] = dataclasses.replace(links["nvlink"], alpha_s=alpha)
    topo_args = TopologyArgs(kind=ns.topology, gpus_per_node=ns.gpus_per_node)
    targets = dict(op=op, tput=tput, mem=mem, dev=dev, topo=topo_args, link=links)
    for item in overrides:
        apply_set(targets, item)
        sources[item.partition("=")[0]] = "set on the command line"
    try:
        topo = Topology(topo_args, links)
    except KeyError as e:  # an unknown link name
        raise ConfigError(f"topology={ns.topology}: {e.args[0]}") from None
    except NotMeasured:  # a measured input nothing supplied: only the memory table does without links
        if ns.what != "memory":
            raise
        topo = None
    return topo, dev, op, tput, mem, sources, notes


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


def run(ns: PerfModelArgs, overrides: list[str] = ()) -> dict[str, list[dict]]:
    """Every table asked for; tables["inputs"]: where each input came from."""
    topo, dev, op, tput, mem, sources, notes = build(ns, overrides)
    targets = dict(op=op, tput=tput, mem=mem, dev=dev, link=topo.links if topo else {})
    tables = {"inputs": inputs_rows(targets, topo.link_names() if topo else [], sources)}
    if ns.what == "check":
        raw = folders(ns)[0]
        if not raw:
            raise ConfigError("what=check needs raw=<folder of raw bench outputs>")
        tables["check"] = check_rows(raw, topo, dev, op, tput)
        if "alpha_split" in notes:
            tables["alpha_split"] = [notes["alpha_split"]]
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
                                     seg=m.segment_len,
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
    ns, overrides = parse(sys.argv[1:] if argv is None else argv)
    tables = run(ns, overrides)
    titles = dict(comm="Table 2 model: one exclusive scan (µs)", op="Tables 3-4 model: operator fwd+bwd (ms)",
                  throughput="Tables 5-6 model: tokens/s/GPU (K)", memory="Peak memory per GPU (GiB)",
                  check="Measured vs calibrated model (err = model / measured - 1; the model fed raw's own "
                        "bench_fused.json and metrics_dp.jsonl, the code those points ran)",
                  alpha_split="The chain's cost per message: the transport's (P2P ping-pong) and the scan's own (µs)")
    sys.stdout.write(format_inputs(tables["inputs"]) + "\n")
    for name, rows in tables.items():
        if name != "inputs":
            sys.stdout.write(format_table(comm_pivot(rows) if name == "comm" else rows, titles[name]) + "\n")
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(dict(args=dataclasses.asdict(ns), overrides=overrides, tables=tables), f, indent=1)
        print(f"wrote {ns.json}")
    return 0
