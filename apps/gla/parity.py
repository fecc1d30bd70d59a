"""Loss-curve parity across SP sizes on CPU: the debug config trained with SP = 1, 2, 4 on the same
global sequences (sp_size x seq_len = 256 tokens), every step logged; writes the curves' max
difference (JSON) and a plot.

    python -m apps.gla.parity                        # 200 steps, SP 1 2 4, zeco
    python -m apps.gla.parity steps=20 sizes=1,2 out=dumps/parity_short
    python -m apps.gla.parity dtype=fp64 tag=fp64 control=true  # float64 model (model.dtype), plus a control:
        # SP=1 again with the batch as 2 micro-batches (the same maths, another summation order)
    python -m apps.gla.parity overrides=optim.lr=3e-4 tag=lr3e-4  # trainer keys for every run

Writes <out>/results/parity[_<tag>].json and <out>/figures/parity_sp<sizes>[_<tag>].png (sizes=1,2,4:
parity_sp124.png); out defaults to dumps/parity, relative to where you run. The committed results in
docs/ were written with out=docs (docs/long_context.md gives the commands).

SP > 1 runs go through `torchrun --nproc_per_node=P` (gloo); on a 2-core machine SP = 4 is
oversubscribed but only slower.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from apps.gla.plot_metrics import pyplot, save_figure
from apps.gla.train import TrainArgs
from lingua_zeco import reliability
from lingua_zeco.args import parse_args
from lingua_zeco.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[2]
GLOBAL_TOKENS = 256
CONTROL = "1_grad_acc2"  # the control run's key in the results


@dataclass
class ParityArgs:
    steps: int = 200  # training steps of every run
    sizes: list[int] = field(default_factory=lambda: [1, 2, 4])  # SP sizes; the first is the reference
    method: str = "zeco"  # distributed.sp_method of the runs
    dtype: str = "fp32"  # model.dtype: fp64 makes rounding ~1e-16 instead of ~1e-7
    tag: str = ""  # output names parity_<tag>.json, parity_sp<sizes>_<tag>.png
    out: str = "dumps/parity"  # folder of results/ and figures/ (out=docs replaces the committed ones)
    control: bool = False  # also SP=1 with the batch as 2 micro-batches (rounding alone)
    overrides: list[str] = field(default_factory=list)  # trainer keys for every run, e.g. optim.lr=3e-4


def size_name(sizes: list[int]) -> str:
    """sp124 for SP sizes 1, 2, 4; sp1-2-16 when a size has two digits."""
    return "sp" + ("".join if max(sizes) < 10 else "-".join)(str(P) for P in sizes)


def run(P: int, args: ParityArgs, dump: Path, extra: list[str]) -> list[float]:
    """The loss of every step of the debug config trained with SP = P (`extra`: more trainer keys)."""
    shutil.rmtree(dump, ignore_errors=True)
    argv = ["-m", "apps.gla.train", "config=debug.yaml", f"dump_dir={dump}", f"steps={args.steps}", "logging.freq=1",
            f"data.seq_len={GLOBAL_TOKENS // P}", f"distributed.sp_size={P}", f"distributed.sp_method={args.method}",
            "checkpoint.dump.every=0", "data.prefetch=0", f"model.dtype={args.dtype}", *extra]
    launcher = [] if P == 1 else ["-m", "torch.distributed.run", f"--nproc_per_node={P}"]
    res = subprocess.run([sys.executable, *launcher, *argv], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    if res.returncode != 0:
        raise RuntimeError(f"SP={P} failed ({res.returncode}):\n{res.stderr[-3000:]}")
    return [r["loss"] for r in read_metrics(dump / "metrics.jsonl")]


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(ParityArgs, argv)
    batch = parse_args(TrainArgs, ["config=debug.yaml", *args.overrides]).data.batch_size  # checks the keys
    sizes, method, dtype, extra = args.sizes, args.method, args.dtype, args.overrides
    suffix = f"_{args.tag}" if args.tag else ""
    out = Path(args.out or "dumps/parity")
    dumps = Path("dumps").resolve()  # the runs start in ROOT (so apps/ imports): give them absolute folders
    curves = {str(P): run(P, args, dumps / f"parity{suffix}_sp{P}", extra) for P in sizes}
    if args.control:  # rounding alone: SP=1, the same global batch summed as 2 micro-batches
        acc = [*extra, "grad_acc_steps=2", f"data.batch_size={batch // 2}"]
        curves[CONTROL] = run(1, args, dumps / f"parity{suffix}_control", acc)
    ref = curves[str(sizes[0])]
    gaps = {P: [abs(a - b) for a, b in zip(c, ref)] for P, c in curves.items()}
    diffs = {P: max(g) for P, g in gaps.items()}
    result = {"steps": args.steps, "method": method, "dtype": dtype, "global_tokens_per_sequence": GLOBAL_TOKENS,
              "extra": extra, "max_abs_diff_vs_sp%d" % sizes[0]: diffs,
              "median_abs_diff_vs_sp%d" % sizes[0]: {P: sorted(g)[len(g) // 2] for P, g in gaps.items()},
              # the first step at which each curve is more than 1e-3 from the reference (None: never)
              "first_step_over_1e-3": {P: next((i + 1 for i, d in enumerate(g) if d > 1e-3), None)
                                       for P, g in gaps.items()},
              "final_loss": {P: c[-1] for P, c in curves.items()}, "losses": curves}
    (out / "results").mkdir(parents=True, exist_ok=True)
    (out / "results" / f"parity{suffix}.json").write_text(json.dumps(result, indent=1))
    plot(curves, diffs, out / "figures" / f"parity_{size_name(sizes)}{suffix}.png", method, dtype, extra)
    print(json.dumps({k: v for k, v in result.items() if k != "losses"}, indent=1))
    return result


def plot(curves: dict, diffs: dict, path: Path, method: str, dtype: str, extra: list[str]) -> None:
    fig, (ax, bx) = pyplot().subplots(1, 2, figsize=(11, 4))
    ref_P = next(iter(curves))
    for i, ((P, c), style) in enumerate(zip(curves.items(), ["-", "--", ":", "-."])):
        name = "SP=1, 2 micro-batches" if P == CONTROL else f"SP={P}" + ("" if P == "1" else f" ({method})")
        ax.plot(range(1, len(c) + 1), c, style, color=f"C{i}", lw=1.5, label=name)
        if P != ref_P:
            bx.semilogy(range(1, len(c) + 1), [abs(a - b) + 1e-17 for a, b in zip(c, curves[ref_P])], style,
                        color=f"C{i}", label=f"|{name.split(' (')[0]} - SP={ref_P}|, max {diffs[P]:.1e}")
    lr = next((e.split("=", 1)[1] for e in extra if e.startswith("optim.lr=")), "3e-3 (debug.yaml)")
    ax.set(xlabel="step", ylabel="training loss", title=f"debug config, 256 tokens/sequence, CPU {dtype}, lr {lr}")
    bx.axhline(1e-3, color="gray", lw=0.8)
    bx.set(xlabel="step", ylabel="absolute loss difference", title="difference to SP=1 (line: 1e-3)")
    ax.legend()
    if len(curves) > 1:  # one size alone: nothing to compare
        bx.legend()
    save_figure(fig, str(path), dpi=120)


if __name__ == "__main__":
    with reliability.clean_exit():  # bad input: one `error: ...` line, exit code 2
        main()
