"""End-to-end training: the CLI, SP=2 vs SP=1 loss curves, gradient accumulation, exact resume."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from apps.gla.train import TrainArgs, train
from apps.gla.train_state import compute_changes
from lingua_zeco.args import parse_args
from lingua_zeco.data import build_data_loader
from lingua_zeco.metrics import read_metrics
from lingua_zeco.optim import OptimArgs, lr_factor
from local_ranks import run_on_ranks

ROOT = Path(__file__).resolve().parent.parent
SP_RTOL = 2e-5  # SP=2 vs SP=1 loss curves, fp32 on CPU (observed differences are ~1e-7)

# A very small GLA (fp32 on CPU); "global" = the whole sequence of an SP group.
TINY = ["config=debug.yaml", "model.dim=32", "model.n_layers=2", "model.n_heads=2", "model.ffn_hidden=64",
        "data.batch_size=2", "logging.freq=1", "optim.warmup=2", "optim.lr=1e-2", "data.prefetch=0"]


def _args(dump_dir, *extra) -> TrainArgs:
    return parse_args(TrainArgs, [*TINY, f"dump_dir={dump_dir}", *extra])


def _train_on_rank(rank, world, argv):
    torch.set_num_threads(1)
    return train(parse_args(TrainArgs, argv))["losses"]


def _short_docs(folder: Path) -> str:
    """A jsonl of short documents, so packed sequences hold many boundaries (the built-in
    documents are longer than a test sequence)."""
    folder.mkdir(parents=True, exist_ok=True)
    words = "state scan rank chunk gate token decay sequence parallel linear attention".split()
    with open(folder / "docs.jsonl", "w") as f:
        for i in range(400):
            text = " ".join(words[(i * 7 + j * 3) % len(words)] for j in range(2 + i % 9))
            f.write(json.dumps({"text": text}) + "\n")
    return str(folder)


def _curve(losses: dict) -> list[float]:
    return [losses[s] for s in sorted(losses)]


def test_cli_debug_run(tmp_path):
    """The README command, shortened to 3 steps: config dump, metrics file, final checkpoint."""
    cmd = [sys.executable, "-m", "apps.gla.train", *TINY, f"dump_dir={tmp_path}", "steps=3", "data.seq_len=64",
           "profiling.enabled=true", "profiling.start_step=1", "profiling.warmup=1", "profiling.active=1"]
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 0, f"exit {res.returncode}\nstderr:\n{res.stderr[-3000:]}\nstdout:\n{res.stdout[-1000:]}"
    assert (tmp_path / "config.yaml").is_file()
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert 0 < r["loss"] < 10 and r["tok_per_s_per_gpu"] > 0 and r["mem_gib"] > 0 and 0 <= r["data_wait_share"] <= 1
        assert r["tokens_global"] == 2 * 64
    assert any(p.name.startswith("step_") for p in (tmp_path / "checkpoints").iterdir())
    assert list((tmp_path / "profile").glob("rank0_step*.json"))  # the profiler window was recorded


def test_lr_schedule():
    args = OptimArgs(lr=1.0, warmup=4, scheduler="cosine", lr_min_ratio=0.1)
    f = [lr_factor(s, args, total=14) for s in range(16)]
    assert f[:4] == [0.25, 0.5, 0.75, 1.0] and f[4] == 1.0
    assert f[9] == pytest.approx(0.55) and f[14] == pytest.approx(0.1) and f[15] == pytest.approx(0.1)
    lin = OptimArgs(lr=1.0, warmup=0, scheduler="linear", lr_min_ratio=0.0)
    assert [lr_factor(s, lin, total=4) for s in range(5)] == [1.0, 0.75, 0.5, 0.25, 0.0]
    with pytest.raises(ValueError, match="cosine, linear, constant"):
        lr_factor(0, OptimArgs(scheduler="step"), total=4)


@pytest.mark.slow
@pytest.mark.parametrize("method, varlen", [("zeco", False), ("lasp1", False), ("lasp2", False), ("zeco", True)])
def test_sp2_matches_sp1(tmp_path, method, varlen):
    """Same seed, same global sequences (2 x 64 tokens split over 2 ranks vs 128 on one): the loss
    curves agree, which needs the SP exchange, FSDP's reduction over SP and the loss scaling right.
    varlen: packed documents (cu_seqlens of the global sequence), whose boundaries reset the state."""
    steps = ["steps=5", "checkpoint.dump.every=100"]
    if varlen:
        steps += ["data.varlen=true", "data.batch_size=1", f"data.root_dir={_short_docs(tmp_path / 'docs')}"]
    ref_args = _args(tmp_path / "sp1", *steps, "data.seq_len=128")
    if varlen:  # the packed sequences really hold document boundaries, on both sides of the rank split
        cu = next(build_data_loader(ref_args.data, dp_rank=0, dp_size=1, sp_rank=0, sp_size=1, seed=0))["cu_seqlens"]
        assert ((cu > 0) & (cu < 64)).any() and ((cu > 64) & (cu < 128)).any(), cu
    ref = _curve(train(ref_args)["losses"])
    argv = [*TINY, f"dump_dir={tmp_path / 'sp2'}", *steps, "data.seq_len=64", "distributed.sp_size=2",
            f"distributed.sp_method={method}"]
    got = run_on_ranks(_train_on_rank, 2, argv)
    assert _curve(got[0]) == _curve(got[1])  # every rank reports the global loss
    assert ref[-1] < ref[0] - 0.2, ref  # it learns
    torch.testing.assert_close(torch.tensor(_curve(got[0])), torch.tensor(ref), rtol=SP_RTOL, atol=0)
    # Adam hardly sees a constant gradient factor, so check the gradient itself: its global norm
    # (a wrong loss scaling or a missing reduction over SP would move it by 2x).
    gn = [[r["grad_norm"] for r in read_metrics(tmp_path / d / "metrics.jsonl")] for d in ("sp1", "sp2")]
    torch.testing.assert_close(torch.tensor(gn[1]), torch.tensor(gn[0]), rtol=1e-4, atol=0)


@pytest.mark.slow
def test_sp2_without_state_passing_differs(tmp_path):
    """Sensitivity of the test above: dropping the state from the previous rank must be visible."""
    steps = ["steps=3", "checkpoint.dump.every=100"]
    ref = _curve(train(_args(tmp_path / "sp1", *steps, "data.seq_len=128"))["losses"])
    argv = [*TINY, f"dump_dir={tmp_path / 'sp2'}", *steps, "data.seq_len=64", "distributed.sp_size=2",
            "distributed.sp_method=local"]
    got = _curve(run_on_ranks(_train_on_rank, 2, argv)[0])
    # Small at init (the attention is a small part of a fresh model), yet far outside SP_RTOL.
    assert max(abs(a - b) / b for a, b in zip(got, ref)) > 10 * SP_RTOL


def test_grad_accumulation_matches_bigger_batch(tmp_path):
    common = ["steps=3", "data.seq_len=64", "checkpoint.dump.every=100"]
    big = _curve(train(_args(tmp_path / "b", *common))["losses"])
    acc = _curve(train(_args(tmp_path / "a", *common, "data.batch_size=1", "grad_acc_steps=2"))["losses"])
    torch.testing.assert_close(torch.tensor(acc), torch.tensor(big), rtol=1e-5, atol=0)


@pytest.mark.parametrize("async_save", [False, True])
def test_resume_continues_exactly(tmp_path, async_save):
    """6 steps in one go vs 3 steps, stop, rerun to 6: the rerun resumes at 3 and the losses of
    steps 4-6 are the same (model, optimizer, scheduler, data position and RNG all restored).
    async_save: the checkpoints are written in the background (gloo groups of one process)."""
    common = ["data.seq_len=64", "checkpoint.dump.every=3", "optim.decay_steps=6",
              f"checkpoint.async_save={async_save}"]
    full = train(_args(tmp_path / "full", *common, "steps=6"))["losses"]
    first = train(_args(tmp_path / "cut", *common, "steps=3"))["losses"]
    second = train(_args(tmp_path / "cut", *common, "steps=6"))["losses"]
    assert sorted(first) == [1, 2, 3] and sorted(second) == [4, 5, 6]  # resumed at step 3
    for s in (4, 5, 6):
        assert second[s] == pytest.approx(full[s], rel=1e-6)
    rows = read_metrics(tmp_path / "cut" / "metrics.jsonl")  # appended across the two runs
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    done = train(_args(tmp_path / "cut", *common, "steps=6"))  # nothing left to do
    assert done == {"losses": {}, "step": 6}


def test_changed_optimizer_settings_apply_from_the_resumed_step(tmp_path, caplog):
    """optim.lr / optim.weight_decay changed on resume: applied from the resumed step
    on (the saved values used to win silently while config.yaml showed the new ones), and said so."""
    from test_reliability import _state

    common = ["data.seq_len=32", "checkpoint.dump.every=3", "optim.decay_steps=6"]
    train(_args(tmp_path, *common, "steps=3"))
    with caplog.at_level("WARNING"):
        train(_args(tmp_path, *common, "steps=6", "optim.lr=1e-3", "optim.weight_decay=0.05"))
    assert "optim.lr: saved 0.01, now 0.001" in caplog.text and "optim.weight_decay" in caplog.text
    now = OptimArgs(lr=1e-3, warmup=2, decay_steps=6)
    lrs = {r["step"]: r["lr"] for r in read_metrics(tmp_path / "metrics.jsonl")}
    for s in (4, 5, 6):
        assert lrs[s] == pytest.approx(1e-3 * lr_factor(s, now, 6), rel=1e-12)
    groups = _state(tmp_path / "checkpoints" / "step_0000000006", tmp_path)["optim"]["param_groups"]
    assert {g["initial_lr"] for g in groups} == {1e-3} and max(g["weight_decay"] for g in groups) == 0.05
    assert "lr: 0.001" in (tmp_path / "config.yaml").read_text()


def test_changed_compute_on_resume_is_one_warning_line(tmp_path, caplog):
    """A resume with other numerics (here segments; float8 on or off alike) says so; an unchanged one does not."""
    common = ["data.seq_len=32", "checkpoint.dump.every=2"]
    train(_args(tmp_path, *common, "steps=2"))
    with caplog.at_level("WARNING"):
        train(_args(tmp_path, *common, "steps=3"))
    assert "compute changed" not in caplog.text
    with caplog.at_level("WARNING"):
        train(_args(tmp_path, *common, "steps=5", "model.segment_len=16"))
    lines = [r.getMessage() for r in caplog.records if "compute changed" in r.getMessage()]
    assert len(lines) == 1 and "model.segment_len: saved 0, now 16" in lines[0] and "\n" not in lines[0], lines
    assert compute_changes({"model.float8": "rowwise"}, {"model.float8": "none"}) == [
        "model.float8: saved 'rowwise', now 'none'"]
    assert compute_changes(None, {"model.float8": "none"}) == []  # a checkpoint that recorded nothing


@pytest.mark.parametrize("steps", [4, 2])
def test_nothing_to_do_leaves_the_run_record_alone(tmp_path, caplog, steps):
    """A rerun with steps at (a finished run) or below the checkpoint's step: one line
    saying there is nothing to do and where the outputs are; config.yaml, metrics.jsonl and the
    checkpoints stay exactly as they were."""
    common = ["data.seq_len=32", "checkpoint.dump.every=2"]
    train(_args(tmp_path, *common, "steps=4"))
    files = [tmp_path / "config.yaml", tmp_path / "metrics.jsonl"]
    before = [f.read_bytes() for f in files]
    ckpts = sorted(os.listdir(tmp_path / "checkpoints"))
    with caplog.at_level("INFO", logger="train"):
        res = train(_args(tmp_path, *common, f"steps={steps}", "optim.lr=1e-3"))
    assert res == {"losses": {}, "step": 4}
    said = [r.getMessage() for r in caplog.records if "nothing to do" in r.getMessage()]
    assert len(said) == 1 and str(tmp_path / "metrics.jsonl") in said[0], said
    assert ("already finished at step 4" if steps == 4 else "past steps=2") in said[0]
    assert [f.read_bytes() for f in files] == before and sorted(os.listdir(tmp_path / "checkpoints")) == ckpts


# -- resume and checkpoints --------------------------------------------------------------------
def _main_error(capsys, argv) -> str:
    """Run the CLI in-process; it must stop with exit 2 and exactly one `error:` line: return it."""
    from apps.gla.train import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith("error: "), (e.value.code, err)
    return err[0]


@pytest.mark.slow
def test_resume_on_another_world_size_reshards_sp_or_refuses(tmp_path, capsys):
    """A checkpoint of 2 ranks (SP=2, 2 x 32 tokens) resumed by one process: with the same global
    sequence (seq_len 64) the data position and RNG come from SP rank 0 of the same DP rank and the run
    continues as an uninterrupted SP=1 run would (SP=2 and SP=1 agree to ~1e-7); with another sequence
    length the data position has no equivalent: one error line naming both layouts, exit 2."""
    common = ["checkpoint.dump.every=2", "optim.decay_steps=4", "data.batch_size=1"]
    ref = train(_args(tmp_path / "ref", *common, "steps=4", "data.seq_len=64"))["losses"]
    argv = [*TINY, f"dump_dir={tmp_path / 'cut'}", *common, "steps=2", "data.seq_len=32", "distributed.sp_size=2"]
    run_on_ranks(_train_on_rank, 2, argv)
    refused = _main_error(capsys, [*TINY, f"dump_dir={tmp_path / 'cut'}", *common, "steps=4", "data.seq_len=32"])
    assert "world size 2" in refused and "dp 1, sp 2" in refused and "world size 1" in refused \
        and "dp 1, sp 1" in refused, refused
    got = train(_args(tmp_path / "cut", *common, "steps=4", "data.seq_len=64"))["losses"]
    assert sorted(got) == [3, 4]
    torch.testing.assert_close(torch.tensor([got[3], got[4]]), torch.tensor([ref[3], ref[4]]), rtol=SP_RTOL, atol=0)


def test_changed_model_shape_names_the_config_keys(tmp_path, capsys, caplog):
    """model.dim changed on an existing dump_dir: not "corrupt checkpoints" and fallbacks, but one line
    naming the key with its saved and new values."""
    train(_args(tmp_path, "steps=2", "data.seq_len=32", "checkpoint.dump.every=1"))
    with caplog.at_level("WARNING"):
        line = _main_error(capsys, [*TINY, f"dump_dir={tmp_path}", "steps=4", "data.seq_len=32", "model.dim=48"])
    assert "model.dim" in line and "32" in line and "48" in line and "config.yaml" in line, line
    assert "falling back" not in caplog.text and "could be loaded" not in line


def test_failed_start_keeps_config_yaml_and_eval_works(tmp_path, capsys):
    """A rerun that cannot start (here: 3 layers on a 2-layer run's checkpoints) must leave the run's
    config.yaml as it was, so apps.gla.eval still evaluates the intact checkpoints."""
    from apps.gla.eval import EvalCLIArgs, run
    from apps.gla.train import main
    from lingua_zeco.evaluation import EvalArgs

    held_out = ["eval.every=100", "eval.steps=1"]  # training reads builtin:train, eval the held-out split
    train(_args(tmp_path, "steps=2", "data.seq_len=32", "checkpoint.dump.every=2", *held_out))
    saved = (tmp_path / "config.yaml").read_text()
    with pytest.raises((SystemExit, RuntimeError)):  # how it fails is the previous test's business
        main([*TINY, f"dump_dir={tmp_path}", "steps=4", "data.seq_len=32", "model.n_layers=3", *held_out])
    assert (tmp_path / "config.yaml").read_text() == saved
    res = run(EvalCLIArgs(dump_dir=str(tmp_path), eval=EvalArgs(every=1, steps=1), device="cpu"))
    assert res["step"] == 2 and res["val_loss"] > 0



@pytest.mark.parametrize("max_norm", [0.05, 1e6, 0.0])  # clipped, not reached, disabled
def test_clipping_inside_fused_adamw_equals_clip_then_step(max_norm):
    """clip_grad_norm hands the clip factor to a fused AdamW as its grad_scale instead of rescaling the
    gradients; the update must be clip_grad_norm_ followed by an unfused AdamW step (and, when the
    clip bites, differ from the unclipped step)."""
    from lingua_zeco.optim import build_optimizer, clip_grad_norm

    torch.manual_seed(0)
    models = [torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)) for _ in range(3)]
    for m in models[1:]:
        m.load_state_dict(models[0].state_dict())
    x = torch.randn(32, 8)
    # fused with the factor inside, unfused after clip_grad_norm_, unfused without clipping; a large eps
    # makes Adam's step depend on the gradient's size, so a missing or wrong factor shows
    setups = [(True, max_norm), (False, max_norm), (False, 0.0)]
    norms = []
    for m, (fused, clip) in zip(models, setups):
        opt = build_optimizer(m, OptimArgs(lr=1e-2, eps=0.1, warmup=0, fused=fused, clip=clip), 10)[0]
        (m(x) ** 2).sum().backward()
        norms.append(clip_grad_norm(m, clip, opt))
        assert fused or getattr(opt, "grad_scale", None) is None
        opt.step()
    torch.testing.assert_close(norms[0], norms[1])
    assert norms[0] > 1.0  # so max_norm = 0.05 clips and 1e6 does not
    for p, q, r in zip(*(m.parameters() for m in models)):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
        assert torch.allclose(q, r, rtol=1e-3, atol=1e-6) == (max_norm != 0.05)


def test_resume_from_a_checkpoint_written_before_the_house_change(tmp_path):
    """tests/data/run_before_house: 2 steps of a tiny model trained and checkpointed by commit 88d1a00 (before
    the checkpoint package, the TrainState, the SP context and the config checks moved). The current code
    resumes it at step 2 and continues exactly as a 4-step run of the current code does."""
    import shutil

    common = ["config=debug.yaml", "model.dim=16", "model.n_layers=1", "model.n_heads=2", "model.ffn_hidden=32",
              "data.seq_len=64", "data.batch_size=2", "data.prefetch=0", "optim.decay_steps=4",
              "checkpoint.dump.every=2", "logging.freq=1", "steps=4"]
    old = tmp_path / "old"
    shutil.copytree(ROOT / "tests" / "data" / "run_before_house", old)
    resumed = train(parse_args(TrainArgs, [*common, f"dump_dir={old}"]))["losses"]
    fresh = train(parse_args(TrainArgs, [*common, f"dump_dir={tmp_path / 'fresh'}"]))["losses"]
    assert sorted(resumed) == [3, 4] and sorted(fresh) == [1, 2, 3, 4]
    for s in (3, 4):
        assert resumed[s] == pytest.approx(fresh[s], rel=1e-6)
