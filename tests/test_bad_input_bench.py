"""Bad input to the benchmark programs and the cost model: one `error: ...` line naming the key, exit
code 2, no traceback; and the debug config, whose vocab_size comes from the tokenizer, benchmarks as
the trainer runs it. All cases in one interpreter (test_entry_points.DRIVER): imports cost seconds."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from test_entry_points import assert_one_error_line, run_cases

TINY = ["heads=2", "head_k=16", "head_v=16", "iters=2", "warmup=0"]
TRAIN = ["config=debug.yaml", "overrides=model.vocab_size=258", "variants=ours", "seq_len=16", "warmup=0", "steps=1"]
PERF = "lingua_zeco.perf_model"
GPU_ONLY = ("bench_fused", "bench_stages", "profile_fused", "profile_sp", "roofline")


def _bad_cases(tmp: Path) -> dict[str, tuple[str, list[str], str]]:
    """name -> (module, argv, a substring the error line must hold: the key, the fix or the choices)."""
    train, op, comm = "apps.gla.bench.bench_train", "apps.gla.bench.bench_op", "apps.gla.bench.bench_comm"
    ckpt, loss = "apps.gla.bench.bench_checkpoint", "apps.gla.bench.bench_loss"
    out = [f"out={tmp}/bad"]
    ref = f"ref={tmp}/ref.json"  # written by `results`: 5 steps of bf16 on debug.yaml
    cases = {
        "bench_train-seq_len-0": (train, [*TRAIN, "seq_len=0", *out], "seq_len=0"),
        "bench_train-steps-0": (train, [*TRAIN, "steps=0", *out], "steps=0"),
        "bench_train-warmup-negative": (train, [*TRAIN, "warmup=-1", *out], "warmup=-1"),
        "bench_train-sp-one-process": (train, [*TRAIN, "variants=sp_zeco", *out], "torchrun"),
        "bench_op-iters-0": (op, [*TINY, "t_local=16", "methods=none", "iters=0", *out], "iters=0"),
        "bench_op-t_local-0": (op, [*TINY, "t_local=0", "methods=none", *out], "t_local=0"),
        "bench_op-dtype-fp7": (op, [*TINY, "t_local=16", "dtype=fp7", *out], "fp32"),
        "bench_op-methods-bogus": (op, [*TINY, "t_local=16", "methods=bogus", *out], "lasp2"),
        "bench_comm-iters-0": (comm, [*TINY, "methods=allreduce", "iters=0", *out], "iters=0"),
        "bench_comm-symm-cpu": (comm, [*TINY, "methods=chain", "blocks=1", "transports=symm", *out], "symm"),
        "bench_comm-methods-bogus": (comm, [*TINY, "methods=bogus", *out], "allreduce"),
        "bench_checkpoint-saves-0": (ckpt, ["saves=0", *out], "saves=0"),
        "bench_checkpoint-idle_steps-0": (ckpt, ["idle_steps=0", *out], "idle_steps=0"),
        "bench_checkpoint-modes-bogus": (ckpt, ["modes=lazy", *out], "async"),
        "bench_checkpoint-models-bogus": (ckpt, ["models=gpt9", *out], "models=gpt9"),
        "bench_checkpoint-ckpt-not-empty": (ckpt, [f"out={tmp}/used"], f"{tmp}/used/ckpt is not empty"),
        "bench_checkpoint-path-not-empty": (ckpt, [f"path={tmp}/used/ckpt", *out], "another path="),
        "bench_loss-variants-bogus": (loss, ["variants=fp4", *out], "variants=fp4"),
        "bench_loss-tail-past-steps": (loss, ["steps=5", "tail=10", *out], "tail=10"),
        "bench_loss-ref-not-json": (loss, [f"ref={tmp}/not.json", *out], "not a bench_loss output"),
        "bench_loss-ref-other-steps": (loss, ["variants=float8", "steps=3", "tail=3", ref, *out], "steps=5 there"),
        "bench_loss-ref-has-the-variant": (loss, ["variants=bf16", "steps=5", "tail=5", ref, *out],
                                           "variants=bf16 is in ref"),
        "bench_loss-ref-twice": (loss, ["variants=", "steps=5", "tail=5", f"{ref},{tmp}/ref.json", *out],
                                 "in an earlier ref"),
        "bench_loss-nothing-to-do": (loss, ["variants=", *out], "variants= is empty"),
        "perf_model-P-0": (PERF, ["what=comm", "P=0"], "P=0"),
        "perf_model-P-negative": (PERF, ["what=comm", "P=-8"], "P=-8"),
        "perf_model-T-0": (PERF, ["what=throughput", "T=0"], "T=0"),
        "perf_model-calib-not-json": (PERF, ["what=comm", f"calib={tmp}/not.json"], "not.json"),
        "perf_model-raw_1gpu-missing": (PERF, ["what=throughput", f"raw_1gpu={tmp}/no_such"], "raw_1gpu="),
        "perf_model-raw_fused-missing": (PERF, ["what=op", f"raw_fused={tmp}/no_such"], "raw_fused="),
    }
    if not torch.cuda.is_available():  # the GPU-only programs refuse a machine without one
        cases |= {f"{m}-no-cuda": (f"apps.gla.bench.{m}", [f"out={tmp}/{m}"], "CUDA") for m in GPU_ONLY}
    return cases


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """[exit code, stderr] of the debug config's bench_train run and then of each bad case."""
    tmp = tmp_path_factory.mktemp("bad_bench")
    (tmp / "not.json").write_text("P=8 alpha=1e-6\n")
    (tmp / "used" / "ckpt").mkdir(parents=True)
    (tmp / "used" / "ckpt" / "mine.txt").write_text("a file of the user's: the benchmark must not delete it")
    (tmp / "ref.json").write_text(json.dumps(dict(args=dict(config="debug.yaml", steps=5, seq_len=0, overrides=[]),
                                                   curves=dict(bf16=[5.0, 4.0, 3.0, 2.0, 1.0]))))
    good = ("apps.gla.bench.bench_train", ["config=debug.yaml", "variants=ours", "seq_len=64", "steps=2", "warmup=1",
                                           f"out={tmp}/good"])
    cases = _bad_cases(tmp)
    got = run_cases([good, *[c[:2] for c in cases.values()]])
    return tmp, got[0], {name: (*r, cases[name][2]) for name, r in zip(cases, got[1:])}


def test_bench_train_fills_vocab_size_from_the_tokenizer(results):
    tmp, (code, err), _ = results
    assert code == 0, err[-3000:]
    rows = json.load(open(tmp / "good" / "train.json"))["rows"]
    assert [r["variant"] for r in rows] == ["ours"] and rows[0]["step_ms"] > 0


@pytest.mark.parametrize("case", sorted(_bad_cases(Path("/unused"))))
def test_bad_bench_input_is_one_error_line_and_exit_2(results, case):
    assert_one_error_line(*results[2][case])
    if case.startswith("bench_checkpoint-") and case.endswith("-not-empty"):
        assert (results[0] / "used" / "ckpt" / "mine.txt").is_file()  # refused before anything was removed


def test_every_bench_train_variant_is_a_config_the_trainer_takes():
    """A variant that names a deleted or misspelt key would fail only on the GPU, minutes into a run."""
    from apps.gla.bench.bench_train import VARIANTS
    from apps.gla.bench.common import trainer_args

    for name, overrides in VARIANTS.items():
        if overrides is not None:  # None: fla's own model
            assert trainer_args(["config=gla_1b_dp.yaml", *overrides]).model.n_layers > 0, name
