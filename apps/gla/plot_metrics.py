"""Loss (train and validation) and tokens/s/GPU of a run, from its metrics.jsonl, to a PNG.

    python -m apps.gla.plot_metrics dumps/debug                 # -> dumps/debug/metrics.png
    python -m apps.gla.plot_metrics dumps/a/metrics.jsonl dumps/b --out compare.png
"""
from __future__ import annotations

import argparse
import os

from lingua_zeco.metrics import read_metrics


def _metrics_path(p: str) -> str:
    return os.path.join(p, "metrics.jsonl") if os.path.isdir(p) else p


def plot(runs: list[str], out: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_tps) = plt.subplots(1, 2, figsize=(11, 4))
    for run in runs:
        rows = read_metrics(_metrics_path(run))
        label = os.path.basename(os.path.dirname(os.path.abspath(_metrics_path(run)))) or run
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
    for ax in (ax_loss, ax_tps):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", help="run folders (dump_dir) or metrics.jsonl files")
    ap.add_argument("--out", default="", help="PNG path; default <first run>/metrics.png")
    a = ap.parse_args(argv)
    out = a.out or os.path.join(os.path.dirname(os.path.abspath(_metrics_path(a.runs[0]))), "metrics.png")
    print(plot(a.runs, out))


if __name__ == "__main__":
    main()
