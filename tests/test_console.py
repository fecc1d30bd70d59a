"""What the trainer prints (README's quickstart promises it): step 1's loss, every logging.freq-th step,
each evaluation's val_loss, and a closing line with how far the run got, its losses, tokens/s, time and
where its outputs are."""
from __future__ import annotations

import re

import torch

from apps.gla.train import TrainArgs, train
from lingua_zeco.args import parse_args
from lingua_zeco.metrics import read_metrics

TINY = ["config=debug.yaml", "model.dim=32", "model.n_layers=2", "model.n_heads=2", "model.ffn_hidden=64",
        "data.batch_size=2", "data.seq_len=64", "optim.warmup=2", "data.prefetch=0"]


def test_console_tells_the_story(tmp_path, caplog):
    torch.set_num_threads(2)
    dump = tmp_path / "run"
    with caplog.at_level("INFO", logger="train"):
        out = train(parse_args(TrainArgs, [*TINY, f"dump_dir={dump}", "steps=7", "logging.freq=5", "eval.every=4",
                                           "eval.steps=1", "checkpoint.dump.every=0"]))
    lines = [r.getMessage() for r in caplog.records if r.name == "train"]
    logged = [int(m.group(1)) for m in map(re.compile(r"^step (\d+)/7 loss ").match, lines) if m]
    assert logged == [1, 5, 7], lines  # step 1 shows where the loss starts
    assert [r["step"] for r in read_metrics(dump / "metrics.jsonl") if "loss" in r] == [1, 5, 7]
    evals = [m for m in map(re.compile(r"^step (\d+)/7 val_loss (\d+\.\d+) val_ppl ").match, lines) if m]
    assert [int(m.group(1)) for m in evals] == [4, 7], lines
    val = [r["val_loss"] for r in read_metrics(dump / "metrics.jsonl") if "val_loss" in r]
    assert [float(m.group(2)) for m in evals] == [round(v, 4) for v in val]
    last = lines[-1]
    assert last.startswith("done at step 7/7 after "), last
    assert f"loss {out['losses'][7]:.4f}" in last and f"val_loss {val[-1]:.4f}" in last, last
    tok_s = float(re.search(r", (\d+) tok/s/gpu", last).group(1))
    seconds = float(re.search(r"after (\d+\.\d+) s", last).group(1))
    assert tok_s > 0 and abs(tok_s * seconds - 7 * 2 * 64) <= 0.01 * 7 * 2 * 64 + tok_s * 0.05, last
    for path in (dump / "config.yaml", dump / "metrics.jsonl", dump / "checkpoints"):
        assert str(path) in last and path.exists(), last
