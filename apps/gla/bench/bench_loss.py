"""Loss-curve parity of trainer variants: the same config, seed and data trained once per variant (each a
fresh `python -m apps.gla.train` process, every step logged); writes every curve, the mean loss of the
last `tail` steps and its relative difference to the first variant.

    python -m apps.gla.bench.bench_loss                          # debug config on CPU: eager vs compiled blocks
    python -m apps.gla.bench.bench_loss config=gla_1b_dp.yaml variants=bf16,float8 steps=300 seq_len=8192
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


def train_curve(name: str, a: BenchLossArgs, dump: str) -> list[float]:
    """Every step's loss of variant `name` (its own process, its own dump_dir, no periodic checkpoints)."""
    argv = [f"config={a.config}", f"dump_dir={dump}", f"steps={a.steps}", "logging.freq=1",
            "checkpoint.dump.every=0", *([f"data.seq_len={a.seq_len}"] if a.seq_len else []), *a.overrides,
            *VARIANTS[name]]
    res = subprocess.run([sys.executable, "-m", "apps.gla.train", *argv], capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"variant {name} failed ({res.returncode}):\n{res.stdout[-2000:]}\n{res.stderr[-3000:]}")
    losses = {r["step"]: r["loss"] for r in read_metrics(os.path.join(dump, "metrics.jsonl")) if "loss" in r}
    return [losses[s] for s in sorted(losses)]


def check_args(a: BenchLossArgs, device) -> None:
    at_least(a, steps=1, tail=1, seq_len=0)
    unknown = [n for n in a.variants if n not in VARIANTS]
    if unknown:
        raise ConfigError(f"variants={unknown[0]}: unknown variant; choose from {', '.join(VARIANTS)}")
    if a.tail > a.steps:
        raise ConfigError(f"tail={a.tail} exceeds steps={a.steps}; the compared mean needs that many steps")


def measure(a: BenchLossArgs, device):
    curves, rows = {}, []
    for name in a.variants:
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
        yield a.stem, dict(rows=rows, curves=curves), md


main = bench_main(BenchLossArgs, measure, check_args)


if __name__ == "__main__":
    with reliability.clean_exit():
        main()
