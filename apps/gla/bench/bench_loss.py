"""Loss-curve parity of trainer variants: the same config, seed and data trained once per variant (each a
fresh `python -m apps.gla.train` process, every step logged to <out>/<stem>_<variant>.metrics.jsonl); writes
every curve, the mean loss of the last `tail` steps and its relative difference to the first variant, and
<stem>.png with the curves.

    python -m apps.gla.bench.bench_loss                          # debug config on CPU: eager vs compiled blocks
    python -m apps.gla.bench.bench_loss config=gla_1b_dp.yaml variants=bf16,float8 steps=300 seq_len=8192
    # runs longer than one sitting: one variant each, the second compared with the first's output
    python -m apps.gla.bench.bench_loss config=gla_1b_dp.yaml variants=bf16 steps=1000 seq_len=16384 stem=bf16
    python -m apps.gla.bench.bench_loss config=gla_1b_dp.yaml variants=float8 steps=1000 seq_len=16384 \
        ref=bench_out/bf16.json stem=float8
    # or each on its own (any order, any machine), then compared without training (variants= empty)
    python -m apps.gla.bench.bench_loss config=gla_1b_dp.yaml variants= steps=1000 seq_len=16384 \
        ref=bench_out/bf16.json,bench_out/float8.json stem=both
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass

from apps.gla.bench.common import at_least, bench_main, markdown_table
from apps.gla.plot_metrics import pyplot, save_figure
from lingua_zeco import reliability
from lingua_zeco.args import ConfigError
from lingua_zeco.metrics import read_metrics

# name -> trainer keys on top of `config` and `overrides`
VARIANTS = {
    "eager": ["model.compile=none"],
    "compiled": ["model.compile=blocks"],
    "bf16": [],  # the config's default (model.compile=auto)
    "float8": ["model.float8=tensorwise"],
    "float8_rowwise": ["model.float8=rowwise"],
}


@dataclass
class BenchLossArgs:
    config: str = "debug.yaml"  # the trainer's config
    variants: tuple[str, ...] = ("eager", "compiled")  # names of VARIANTS; the first is the reference
    steps: int = 100  # training steps of every variant
    seq_len: int = 0  # data.seq_len; 0: the config's
    tail: int = 50  # the mean loss over the last `tail` steps is compared
    overrides: tuple[str, ...] = ()  # trainer keys for every variant
    out: str = "bench_out"  # output folder
    stem: str = "loss"  # output file names
    # earlier bench_loss JSONs of the same settings: their curves come first, in order (the very first curve is the
    # reference); with no variants the run only compares and draws them
    ref: tuple[str, ...] = ()


def train_curve(name: str, a: BenchLossArgs, dump: str) -> list[float]:
    """Every step's loss of variant `name` (its own process, its own dump_dir, no periodic checkpoints). Its
    metrics go to <out>/<stem>_<name>.metrics.jsonl, not into the dump: a run stopped by a time limit still leaves
    the steps it took there."""
    metrics = os.path.abspath(os.path.join(a.out, f"{a.stem}_{name}.metrics.jsonl"))
    os.makedirs(a.out, exist_ok=True)
    if os.path.exists(metrics):  # an earlier run of this stem: this run's curve replaces it, as its .json does
        os.remove(metrics)
    argv = [f"config={a.config}", f"dump_dir={dump}", f"steps={a.steps}", "logging.freq=1",
            f"logging.metrics_file={metrics}", "checkpoint.dump.every=0",
            *([f"data.seq_len={a.seq_len}"] if a.seq_len else []), *a.overrides, *VARIANTS[name]]
    res = subprocess.run([sys.executable, "-m", "apps.gla.train", *argv], capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"variant {name} failed ({res.returncode}):\n{res.stdout[-2000:]}\n{res.stderr[-3000:]}")
    losses = {r["step"]: r["loss"] for r in read_metrics(metrics) if "loss" in r}
    return [losses[s] for s in sorted(losses)]


# what an earlier output must share with this run for its curves to be compared with this run's
SAME = ("config", "steps", "seq_len", "overrides")


def reference_curves(a: BenchLossArgs) -> dict[str, list[float]]:
    """{variant: curve} of the outputs a.ref names, in order ({} without ref): one ConfigError if one cannot be
    used."""
    curves = {}
    for path in a.ref:
        try:
            with open(path) as f:
                old = json.load(f)
            theirs, args = old["curves"], old["args"]
            if not (isinstance(theirs, dict) and isinstance(args, dict)):
                raise TypeError("its curves and args are not objects")
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"ref={path}: not a bench_loss output ({type(e).__name__}: {e}); give the .json an "
                              f"earlier run wrote") from e
        differ = [f"{k}={args.get(k)!r} there, {getattr(a, k)!r} here" for k in SAME
                  if args.get(k) != (list(v) if isinstance(v := getattr(a, k), tuple) else v)]
        if differ:
            raise ConfigError(f"ref={path} ran other settings ({'; '.join(differ)}): its curves cannot be compared")
        if clash := [n for n in theirs if n in curves]:
            raise ConfigError(f"ref={path}: variant {clash[0]} is in an earlier ref already; give each variant once")
        curves |= theirs
    if clash := [n for n in a.variants if n in curves]:
        raise ConfigError(f"variants={clash[0]} is in ref={','.join(a.ref)} already; run the other variants")
    return curves


def check_args(a: BenchLossArgs, device) -> None:
    at_least(a, steps=1, tail=1, seq_len=0)
    unknown = [n for n in a.variants if n not in VARIANTS]
    if unknown:
        raise ConfigError(f"variants={unknown[0]}: unknown variant; choose from {', '.join(VARIANTS)}")
    if not a.variants and not a.ref:
        raise ConfigError("variants= is empty and no ref= is given: name variants to train or earlier outputs "
                          "to compare")
    if a.tail > a.steps:
        raise ConfigError(f"tail={a.tail} exceeds steps={a.steps}; the compared mean needs that many steps")
    reference_curves(a)


def plot_curves(curves: dict[str, list[float]], path: str, tail: int) -> str:
    """Every curve (thin) and its running mean over `tail` steps (thick) against the step."""
    fig, ax = pyplot().subplots(figsize=(8, 4.5))
    for name, curve in curves.items():
        steps = range(1, len(curve) + 1)
        line, = ax.plot(steps, curve, lw=0.5, alpha=0.4)
        mean = [sum(curve[max(0, i - tail + 1):i + 1]) / (i + 1 - max(0, i - tail + 1)) for i in range(len(curve))]
        ax.plot(steps, mean, color=line.get_color(), lw=1.8, label=f"{name} (mean of {tail})")
    ax.set(xlabel="step", ylabel="loss (nats/token)", title="loss curves, same data and seed")
    return save_figure(fig, path, axes=(ax,))


def measure(a: BenchLossArgs, device):
    curves, rows = reference_curves(a), []
    for name in [*curves, *a.variants]:
        if name not in curves:
            dump = tempfile.mkdtemp(prefix=f"bench_loss_{name}_")
            try:  # the run's final checkpoint can be large (GLA-1B's: docs/checkpoints.md): never kept
                curves[name] = train_curve(name, a, dump)
            finally:
                shutil.rmtree(dump, ignore_errors=True)
        tail = curves[name][-a.tail:]
        rows.append(dict(variant=name, steps=len(curves[name]), first_loss=curves[name][0],
                         last_loss=curves[name][-1], tail_mean=sum(tail) / len(tail)))
        ref = rows[0]["tail_mean"]
        for r in rows:
            r["tail_vs_ref"] = r["tail_mean"] / ref - 1
        print(json.dumps(rows[-1]), flush=True)
        md = markdown_table(rows, ["variant", "steps", "first_loss", "last_loss", "tail_mean", "tail_vs_ref"])
        plot_curves(curves, os.path.join(a.out, a.stem + ".png"), a.tail)
        yield a.stem, dict(rows=rows, curves=curves), md


main = bench_main(BenchLossArgs, measure, check_args)


if __name__ == "__main__":
    with reliability.clean_exit():
        main()
