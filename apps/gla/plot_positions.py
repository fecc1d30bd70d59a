"""Validation loss by token position (power-of-two buckets, lingua_zeco/position_loss.py) to a PNG.

    python -m apps.gla.plot_positions dump_dir=dumps/debug/eval.jsonl  # apps.gla.eval ... out=dumps/debug/eval.jsonl
    python -m apps.gla.plot_positions dump_dir=dumps/run               # a run with eval.every=N: its evaluations
    python -m apps.gla.plot_positions dump_dir=dumps/a compare=dumps/b,eval.jsonl out=pos.png   # last of each

Reads the `val_pos{lo}_loss` keys that evaluation writes (the trainer's metrics.jsonl, or the `out=`
file of apps.gla.eval). Each bucket [lo, hi) is drawn at hi on a log2 axis: "positions below hi".
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from apps.gla.plot_metrics import metrics_path, plot_main, pyplot, save_figure
from lingua_zeco import reliability
from lingua_zeco.metrics import read_metrics
from lingua_zeco.position_loss import bucket_bounds

_KEY = re.compile(r"^(val|train_set)_pos(\d+)_loss$")
MAX_CURVES = 8  # of one run's evaluations, evenly picked


@dataclass
class PlotPositionsArgs:
    dump_dir: str = ""  # a run folder, its metrics.jsonl, or an apps.gla.eval out= file
    compare: list[str] = field(default_factory=list)  # more runs / files: their last evaluation each
    steps: list[int] = field(default_factory=list)  # evaluations to draw; empty: all of one run (<= 8), else the last
    out: str = ""  # empty = <dump_dir's folder>/loss_by_position.png


def curve(record: dict) -> tuple[str, list[int], list[float]] | None:
    """(prefix, bucket upper ends, mean losses) of one evaluation record, None without per-position keys."""
    found = {int(m[2]): (m[1], v) for k, v in record.items() if (m := _KEY.match(k))}
    if not found:
        return None
    prefix = next(iter(found.values()))[0]
    hi = dict(bucket_bounds(record.get(f"{prefix}_context") or 2 * max(found)))
    los = sorted(found)
    return prefix, [hi.get(lo, 2 * lo) for lo in los], [found[lo][1] for lo in los]


def evaluations(path: str) -> list[dict]:
    """Records with per-position losses; a step evaluated again (a resumed run) keeps its last record."""
    records = read_metrics(metrics_path(path))
    by_step = {r.get("step", f"#{i}"): r for i, r in enumerate(records) if curve(r) is not None}
    return list(by_step.values())


def _pick(records: list[dict], steps: list[int], many: bool) -> list[dict]:
    if steps:
        return [r for r in records if r.get("step") in steps]
    if not many:
        return records[-1:]
    stride = max(1, -(-len(records) // MAX_CURVES))
    return records[::-1][::stride][::-1]  # the last evaluation always drawn


def plot(runs: list[str], out: str, steps: list[int]) -> str:
    fig, ax = pyplot().subplots(figsize=(7, 4))
    for run in runs:
        path = os.path.abspath(metrics_path(run))
        label = os.path.basename(os.path.dirname(path)) or run
        if os.path.basename(path) != "metrics.jsonl":  # e.g. apps.gla.eval's out= file beside the run
            label += "/" + os.path.basename(path)
        records = evaluations(run)
        if not records:
            raise ValueError(f"{run}: no per-position validation loss (val_pos*_loss); evaluate with "
                             f"eval.by_position=true (eval.every=N in training, or python -m apps.gla.eval)")
        for r in _pick(records, steps, many=len(runs) == 1):
            prefix, xs, ys = curve(r)
            sp = f", sp {r['sp_size']}" if "sp_size" in r else ""  # apps.gla.eval records its mesh
            ax.plot(xs, ys, "o-", ms=3, label=f"{label} step {r.get('step')}{sp}"
                    + ("" if prefix == "val" else " (train set)"))
    ax.set_xscale("log", base=2)
    ax.set(xlabel="token position in the sequence (bucket upper end)", ylabel="loss (nats/token)",
           title="validation loss by token position")
    return save_figure(fig, out, axes=(ax,))


def main(argv: list[str] | None = None) -> str:
    return plot_main(PlotPositionsArgs, argv, "loss_by_position.png", "or a metrics.jsonl / apps.gla.eval out= file",
                     lambda a, runs, out: plot(runs, out, a.steps))


if __name__ == "__main__":
    with reliability.clean_exit():  # bad input: one `error: ...` line, exit code 2
        main()
