"""Validation loss: held-out splits that never overlap training, eval.every in the trainer, apps/gla/eval.py."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from apps.gla import eval as gla_eval
from apps.gla.model import GLAForCausalLM
from apps.gla.train import TrainArgs, train
from lingua_zeco.args import parse_args
from lingua_zeco.data import DataArgs
from lingua_zeco.data.sources import builtin_documents
from lingua_zeco.evaluation import EvalArgs, evaluate, training_data_args, validation_data_args
from lingua_zeco.metrics import read_metrics

TINY = ["config=debug.yaml", "model.dim=32", "model.n_layers=2", "model.n_heads=2", "model.ffn_hidden=64",
        "data.batch_size=2", "data.seq_len=64", "logging.freq=1", "optim.warmup=2", "optim.lr=1e-2",
        "data.prefetch=0", "steps=4", "eval.every=2", "eval.steps=2"]


def test_builtin_split_is_disjoint_and_complete():
    train_docs, valid_docs, every = builtin_documents("train"), builtin_documents("valid"), builtin_documents()
    assert not set(train_docs) & set(valid_docs)
    assert sorted(train_docs + valid_docs) == sorted(every) and 0.03 < len(valid_docs) / len(every) < 0.07
    ev = EvalArgs(every=10)
    assert training_data_args(DataArgs(), ev).sources == {"builtin:train": 1.0}
    assert training_data_args(DataArgs(), EvalArgs(every=0)).sources == {}  # eval off: unchanged stream
    assert validation_data_args(DataArgs(), ev).sources == {"builtin:valid": 1.0}
    with pytest.raises(ValueError, match="builtin:train"):
        validation_data_args(DataArgs(sources={"builtin": 1.0}), ev)


def test_validation_folder_rules(tmp_path):
    (tmp_path / "train").mkdir()
    (tmp_path / "train" / "a.jsonl").write_text('{"text": "hello"}\n')
    ev = EvalArgs(every=1)
    with pytest.raises(FileNotFoundError, match="valid"):
        validation_data_args(DataArgs(root_dir=str(tmp_path), sources={"train": 1.0}), ev)
    (tmp_path / "valid").mkdir()
    (tmp_path / "valid" / "b.jsonl").write_text('{"text": "held out"}\n')
    with pytest.raises(ValueError, match="overlap"):  # every file under root_dir would include valid/
        validation_data_args(DataArgs(root_dir=str(tmp_path)), ev)
    got = validation_data_args(DataArgs(root_dir=str(tmp_path), sources={"train": 1.0}, prefetch=2), ev)
    assert got.root_dir == str(tmp_path / "valid") and got.sources == {} and got.prefetch == 0


def test_eval_every_and_checkpoint_eval(tmp_path, capsys):
    torch.set_num_threads(2)
    train(parse_args(TrainArgs, [*TINY, f"dump_dir={tmp_path}"]))
    rows = read_metrics(tmp_path / "metrics.jsonl")
    val = [r for r in rows if "val_loss" in r]
    assert [r["step"] for r in val] == [2, 4]
    assert all(r["val_tokens"] == 2 * 2 * 64 for r in val)
    assert val[1]["val_ppl"] == pytest.approx(math.exp(val[1]["val_loss"]))
    assert val[1]["val_loss"] < val[0]["val_loss"] < math.log(258) + 0.5  # learning shows on held-out text
    # The checkpoint of step 4 evaluated afresh gives the loss the trainer logged at step 4.
    res = gla_eval.run(gla_eval.EvalCLIArgs(dump_dir=str(tmp_path), eval=EvalArgs(every=1, steps=2),
                                            out=str(tmp_path / "eval.jsonl")))
    assert res["step"] == 4 and res["val_loss"] == pytest.approx(val[1]["val_loss"], rel=1e-5)
    assert (tmp_path / "eval.jsonl").read_text().count("val_loss") == 1
    # Sensitivity: the untrained model scores differently on the same tokens.
    cfg = gla_eval.load_run_config(str(tmp_path))
    fresh = GLAForCausalLM(cfg.model)
    fresh.init_weights(0)
    base = evaluate(fresh, cfg.data, EvalArgs(every=1, steps=2), device=torch.device("cpu"))
    assert base["val_loss"] > val[1]["val_loss"] + 0.1
    # The same checkpoint drives generation from the command line (recurrent state; tests/test_generate.py).
    from apps.gla import generate as gla_generate

    capsys.readouterr()
    gla_generate.main([f"dump_dir={tmp_path}", "prompt=def f", "max_tokens=8", "temperature=0.8", "top_k=20"])
    assert capsys.readouterr().out.startswith("def f")
