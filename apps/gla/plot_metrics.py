"""Loss (train and validation) and tokens/s/GPU of a run, from its metrics.jsonl, to a PNG.

    python -m apps.gla.plot_metrics dump_dir=dumps/debug                       # -> dumps/debug/metrics.png
    python -m apps.gla.plot_metrics dump_dir=dumps/a compare=dumps/b,dumps/c out=compare.png
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from lingua_zeco import reliability
from lingua_zeco.args import ConfigError, parse_args
from lingua_zeco.metrics import read_metrics


@dataclass
class PlotArgs:
    dump_dir: str = ""  # the run's folder (or its metrics.jsonl)
    compare: list[str] = field(default_factory=list)  # other runs drawn beside it (folders or metrics.jsonl files)
    out: str = ""  # the PNG to write; empty = <dump_dir>/metrics.png


def metrics_path(p: str) -> str:
    path = os.path.join(p, "metrics.jsonl") if os.path.isdir(p) else p
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no metrics at {path!r}: give a run folder (dump_dir) or its metrics.jsonl; "
                                f"a run writes it from its first logged step on")
    return path


def pyplot():
    """matplotlib.pyplot on the Agg backend (files, no display), imported on first use."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: str, dpi: int = 100, axes=()) -> str:
    """Grid and legend on each of `axes`, then lay out, write `path` (its folder made), close the figure."""
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)
    return path


def plot(runs: list[str], out: str) -> str:
    fig, (ax_loss, ax_tps) = pyplot().subplots(1, 2, figsize=(11, 4))
    for run in runs:
        rows = read_metrics(metrics_path(run))
        label = os.path.basename(os.path.dirname(os.path.abspath(metrics_path(run)))) or run
        train = {r["step"]: r for r in rows if "loss" in r}  # a resumed run may repeat a step: keep the last
        val = {r["step"]: r for r in rows if "val_loss" in r}
        steps = sorted(train)
        ax_loss.plot(steps, [train[s]["loss"] for s in steps], label=f"{label} train")
        if val:
            vs = sorted(val)
            ax_loss.plot(vs, [val[s]["val_loss"] for s in vs], "o--", label=f"{label} valid")
        tps = [s for s in steps if "tok_per_s_per_gpu" in train[s]]
        ax_tps.plot(tps, [train[s]["tok_per_s_per_gpu"] for s in tps], label=label)
    ax_loss.set(xlabel="step", ylabel="loss (nats/token)", title="loss")
    ax_tps.set(xlabel="step", ylabel="tokens/s/GPU", title="throughput")
    return save_figure(fig, out, axes=(ax_loss, ax_tps))


def plot_main(cls, argv: list[str] | None, name: str, what: str, draw) -> str:
    """A plotting command: `cls` from argv, then draw(args, [dump_dir, *compare], out) to args.out, else to
    `name` in the folder of dump_dir's metrics. A ConfigError without dump_dir (`what`: what it may be)."""
    args = parse_args(cls, argv)
    if not args.dump_dir:
        raise ConfigError(f"give dump_dir=<run folder> ({what})")
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(metrics_path(args.dump_dir))), name)
    print(draw(args, [args.dump_dir, *args.compare], out))
    return out


def main(argv: list[str] | None = None) -> str:
    return plot_main(PlotArgs, argv, "metrics.png", "the one holding metrics.jsonl", lambda _, runs, o: plot(runs, o))


if __name__ == "__main__":
    with reliability.clean_exit():  # bad input: one `error: ...` line, exit code 2
        main()
