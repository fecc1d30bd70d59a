"""Reading raw benchmark outputs for the cost model, each value with the file it came from.

`raw` (load_raw) holds comm_P<n>.json (bench_comm), op_P<n>.json (bench_op), optionally bench_fused.json
and metrics_<method>.jsonl (trainer); `raw_fused` (load_fused) is a bench_fused JSON, or a folder: its
newest one; `raw_1gpu` (single_gpu_runs) a folder of single-GPU bench_train JSON (the newest file per
variant and length). "Newest" is the time a file records, then its path. Relative paths are found from
the working directory, else inside the repository (the committed folders, from any directory).
"""
from __future__ import annotations

import glob
import json
import os
import statistics
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def find(path: str) -> str:
    """`path` as given (absolute, or from the working directory), else inside the repository (the
    committed folders are found from any directory when the package is installed editable)."""
    if os.path.exists(path) or os.path.isabs(path):
        return path
    inside = REPO / path
    return str(inside) if inside.exists() else path


def shown(path: str) -> str:
    """A path as the model's output names it: relative to the repository when inside it."""
    try:
        return str(Path(path).resolve().relative_to(REPO))
    except ValueError:
        return str(path)


def read_json(path: str):
    with open(path) as f:  # closed here, not whenever the garbage collector gets to it
        return json.load(f)


def load_raw(raw: str) -> dict:
    """The folder's files, parsed; out["files"] names the file behind each key."""
    raw = find(raw)
    if not os.path.isdir(raw):
        raise FileNotFoundError(f"raw={raw}: no such folder of benchmark outputs")
    out: dict = {"files": {}, "metrics": {}}
    for key, pat in (("comm", "comm_P*.json"), ("op", "op_P*.json"), ("fused", "bench_fused.json")):
        found = sorted(glob.glob(os.path.join(raw, pat)))
        if found:
            out[key] = read_json(found[0])
            out["files"][key] = shown(found[0])
            if out[key].get("partial"):  # bench_main's mark of a run cut short
                warnings.warn(f"{shown(found[0])} is partial (its benchmark was cut short): the model is "
                              "calibrated from the measurements it holds", stacklevel=2)
    for f in sorted(glob.glob(os.path.join(raw, "metrics_*.jsonl"))):
        name = os.path.basename(f)[len("metrics_"):-len(".jsonl")]
        with open(f) as lines:
            out["metrics"][name] = [json.loads(line) for line in lines if line.strip()]
        out["files"][f"metrics_{name}"] = shown(f)
    return out


def recorded_time(data: dict) -> str:
    """When a bench JSON says it ran ("YYYY-MM-DD HH:MM:SS"; "" when it does not say)."""
    return str(data.get("env", {}).get("time") or data.get("time") or "")


def newest_json(folder: str, keep, name: str = "*.json") -> list[tuple[str, dict]]:
    """(file, data) of every JSON named `name` under `folder` (recursively) that keep(data) accepts, oldest
    first: by the time the file records, then by path."""
    found = []
    for f in sorted(glob.glob(os.path.join(find(folder), "**", name), recursive=True)):
        try:
            data = json.loads(Path(f).read_text())
        except (OSError, ValueError):
            continue  # not a bench output
        if isinstance(data, dict) and keep(data):
            found.append((f, data))
    return sorted(found, key=lambda fd: (recorded_time(fd[1]), fd[0]))


def is_one_gpu_train(data: dict) -> bool:
    """bench_train JSON of one GPU without overrides (e.g. activation checkpointing: not the plain model)."""
    return (data.get("env", {}).get("world_size") == 1 and not data.get("args", {}).get("overrides")
            and any("tok_per_s" in r and "variant" in r for r in data.get("rows", [])))


def single_gpu_runs(folder: str) -> dict[str, dict[int, dict]]:
    """variant -> seq_len -> tokens/s and peak GiB of one-GPU bench_train rows, from the newest file (the time
    it records) holding that variant at that length (median over its rows of it), and that file."""
    found = newest_json(folder, is_one_gpu_train)
    if not found:
        raise FileNotFoundError(f"raw_1gpu={folder}: no one-GPU bench_train JSON (rows with tok_per_s) in or below "
                                "that folder; give a folder holding one, or raw_1gpu=none")
    out: dict[str, dict[int, dict]] = {}
    for f, data in found:  # oldest first: newer files replace older ones
        by: dict[tuple[str, int], list[dict]] = {}
        for r in data["rows"]:
            if "tok_per_s" in r:
                by.setdefault((r["variant"], int(r["seq_len"])), []).append(r)
        for (variant, T), rs in by.items():
            out.setdefault(variant, {})[T] = dict(
                tok_s=statistics.median(r["tok_per_s"] for r in rs), rows=len(rs), files=[shown(f)],
                peak_gib=statistics.median(r["peak_gib"] for r in rs), time=recorded_time(data))
    return {v: dict(sorted(runs.items())) for v, runs in sorted(out.items())}


# (fused, single-device) columns of a bench_fused row, first found first: the files of 2026-12-04 timed today's
# stages (whole-chunk intra-chunk stages, kept states) under these names, beside the stage sets removed since
FUSED_PAIRS = (("zeco_fused_chunk_intra_save_h", "staged_chunk_intra_save_h"), ("zeco_fused", "staged_chunk_gla"),
               ("zeco_fused", "fla_chunk_gla"))


def fused_extra(row: dict) -> tuple[float, str]:
    """The fused ZeCO operator's extra work over the single-device operator, as a fraction, and how: against
    the staged operator (what one GPU runs on CUDA) where the row has it, else fla's chunk_gla; CUDA-graph times
    (GPU work alone) where the row has them, else eager; rows with neither: extra_pct (eager, against fla)."""
    for fused, base in FUSED_PAIRS:
        for suffix in ("_graph_ms", "_ms"):
            if f"{fused}{suffix}" in row and f"{base}{suffix}" in row:
                return row[f"{fused}{suffix}"] / row[f"{base}{suffix}"] - 1, f"{fused}{suffix} / {base}{suffix} - 1"
    return row["extra_pct"] / 100, "extra_pct: fused ZeCO without comm vs fla"


def fused_rows(data: dict, file: str) -> tuple[dict[int, float], str]:
    """op.zeco_extra_by_T from one bench_fused JSON (dense rows, by T_local) and its source line."""
    extra, hows = {}, set()
    for r in data["rows"]:
        extra[int(r["T_local"])], how = fused_extra(r)
        hows.add(how)
    return extra, f"measured: {file} ({'; '.join(sorted(hows))})"


def load_fused(path: str) -> tuple[dict[int, float], str]:
    """raw_fused=: a bench_fused JSON, or a folder whose newest *bench_fused*.json with rows (recursively)."""
    path = find(path)
    with_rows = lambda d: bool(d.get("rows")) and all("T_local" in r for r in d["rows"])  # noqa: E731
    if os.path.isfile(path):
        files = [(path, data) for data in [json.loads(Path(path).read_text())] if with_rows(data)]
    else:
        files = newest_json(path, with_rows, "*bench_fused*.json") if os.path.isdir(path) else []
    if not files:
        raise FileNotFoundError(f"raw_fused={path}: no bench_fused JSON with rows there (give a bench_fused.json "
                                "or a folder holding one; raw_fused=none: raw's own bench_fused.json)")
    return fused_rows(files[-1][1], shown(files[-1][0]))


def median_tok_s(rows: list[dict]) -> float:
    """Median tokens/s/GPU over the logged steps, the first logged step (warm-up) left out."""
    # the 2026-11-30 files predate the rename to tok_per_s_per_gpu
    return statistics.median(r.get("tok_per_s_per_gpu", r.get("tokens_per_s_per_gpu")) for r in rows[1:])
