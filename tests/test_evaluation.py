"""Validation loss: held-out splits that never overlap training, eval.every in the trainer, apps/gla/eval.py."""
from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil

import pytest
import torch

from apps.gla import eval as gla_eval
from apps.gla.model import GLAArgs, GLAForCausalLM
from apps.gla.train import TrainArgs, train
from lingua_zeco.args import parse_args
from lingua_zeco.data import DataArgs, build_data_loader
from lingua_zeco.data.mqar import MQARArgs
from lingua_zeco.data.sources import builtin_documents
from lingua_zeco.evaluation import EvalArgs, evaluate, training_data_args, validation_data_args
from lingua_zeco.metrics import read_metrics
from lingua_zeco.position_loss import PositionLoss, bucket_bounds, bucket_of, n_buckets
from local_ranks import run_on_ranks

TINY = ["config=debug.yaml", "model.dim=32", "model.n_layers=2", "model.n_heads=2", "model.ffn_hidden=64",
        "data.batch_size=2", "data.seq_len=64", "logging.freq=1", "optim.warmup=2", "optim.lr=1e-2",
        "data.prefetch=0", "steps=4", "eval.every=2", "eval.steps=2"]


def test_builtin_split_is_disjoint_and_complete():
    train_docs, valid_docs, every = builtin_documents("train"), builtin_documents("valid"), builtin_documents()
    assert not set(train_docs) & set(valid_docs)
    assert sorted(train_docs + valid_docs) == sorted(every) and 0.07 < len(valid_docs) / len(every) < 0.13
    ev = EvalArgs(every=10)
    assert training_data_args(DataArgs(), ev).sources == {"builtin:train": 1.0}
    # eval off: still the train split, so that apps.gla.eval can evaluate the checkpoints on unseen documents
    assert training_data_args(DataArgs(), EvalArgs(every=0)).sources == {"builtin:train": 1.0}
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


def _jsonl(folder, texts):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "part.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return folder


def test_validation_data_that_was_trained_on_is_refused(tmp_path, caplog):
    """Same file under another path (eval.root_dir = a training folder, a symlink, a hard link) or a
    byte-identical copy: refused with one line, unless eval.allow_train_overlap."""
    _jsonl(tmp_path / "train", [f"training document {i}" for i in range(5)])
    _jsonl(tmp_path / "valid", [f"held-out document {i}" for i in range(5)])
    data = DataArgs(root_dir=str(tmp_path), sources={"train": 1.0})
    (tmp_path / "link").symlink_to(tmp_path / "train")
    (tmp_path / "hard").mkdir()
    os.link(tmp_path / "train" / "part.jsonl", tmp_path / "hard" / "x.jsonl")
    (tmp_path / "copy").mkdir()
    shutil.copy(tmp_path / "train" / "part.jsonl", tmp_path / "copy" / "y.jsonl")
    for where in ("train", "link", "hard", "copy"):
        with pytest.raises(ValueError, match="overlaps the training data") as e:
            validation_data_args(data, EvalArgs(every=1, root_dir=str(tmp_path / where)))
        assert "\n" not in str(e.value) and "eval.allow_train_overlap=true" in str(e.value)
        allowed = EvalArgs(every=1, root_dir=str(tmp_path / where), allow_train_overlap=True)
        assert validation_data_args(data, allowed).root_dir == str(tmp_path / where)
    # held-out data passes, by default folder and by eval.root_dir
    assert validation_data_args(data, EvalArgs(every=1)).root_dir == str(tmp_path / "valid")
    assert validation_data_args(data, EvalArgs(every=1, root_dir=str(tmp_path / "valid"))).sources == {}
    # a training source given as a path that reaches valid/ from elsewhere is caught too
    with pytest.raises(ValueError, match="overlaps the training data"):
        validation_data_args(DataArgs(root_dir=str(tmp_path / "train"), sources={"../valid": 1.0}),
                             EvalArgs(every=1, root_dir=str(tmp_path / "valid")))
    # a checkpoint evaluated where its run's training data is absent: nothing to compare, said so
    with caplog.at_level("WARNING"):
        gone = DataArgs(root_dir=str(tmp_path / "elsewhere"), sources={"train": 1.0})
        assert validation_data_args(data, EvalArgs(every=1), trained_on=gone).root_dir == str(tmp_path / "valid")
    assert "cannot check" in caplog.text


def test_eval_cli_refuses_a_run_that_trained_on_the_validation_split(tmp_path, capsys):
    """A run with data.sources={builtin: 1.0} trained on the whole built-in corpus, held-out split included: the
    checkpoint's 'validation loss' on that split is refused (one error line, exit 2); with the opt-in
    flag the number is reported, labelled train_set_loss."""
    torch.set_num_threads(2)
    train(parse_args(TrainArgs, [*TINY, f"dump_dir={tmp_path}", "eval.every=0", "steps=1",
                                 "data.sources={builtin: 1.0}"]))
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        gla_eval.main([f"dump_dir={tmp_path}", "eval.steps=1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith("error: ") and "overlaps" in err[0], err
    gla_eval.main([f"dump_dir={tmp_path}", "eval.steps=1", "eval.allow_train_overlap=true"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert "val_loss" not in out and out["train_set_tokens"] == 2 * 64 and 0 < out["train_set_loss"] < 10


def test_eval_steps_beyond_the_validation_set_warn(tmp_path, caplog):
    """3 short documents hold ~1.5 batches of 2 x 64 byte tokens: eval.steps=3 repeats them, which is
    said (with the number of batches there are); eval.steps=1 does not."""
    _jsonl(tmp_path / "train", ["a training document"])
    _jsonl(tmp_path / "valid", ["held out " * 5, "more held-out text " * 4, "the last one " * 4])
    data = DataArgs(root_dir=str(tmp_path), sources={"train": 1.0}, seq_len=64, batch_size=2, prefetch=0)
    model = GLAForCausalLM(GLAArgs(dim=32, n_layers=1, n_heads=2, ffn_hidden=64, vocab_size=258))
    model.init_weights(0)
    with caplog.at_level("WARNING"):
        evaluate(model, data, EvalArgs(every=1, steps=1), device=torch.device("cpu"))
    assert "repeat" not in caplog.text
    with caplog.at_level("WARNING"):
        evaluate(model, data, EvalArgs(every=1, steps=3), device=torch.device("cpu"))
    assert "eval.steps=3" in caplog.text and "repeat" in caplog.text and "only 1 batch" in caplog.text


# -- evaluation on the training mesh, loss by token position --------------------------------------
CONTEXT = 64  # tokens per sequence, whatever the SP size
POS_MODEL = GLAArgs(dim=32, n_layers=2, n_heads=2, ffn_hidden=64, vocab_size=258, dtype="fp64")
MQAR = MQARArgs(n_keys=8, n_values=8, n_pairs=4, n_queries=8, pair_tokens=True)


def _pos_eval(rank, world, sp, variants=("zeco",)):
    """Evaluate one fp64 model on this rank's (dp, sp) place: built-in text, and MQAR with the queries on
    the last of 2 ranks' halves. Variants: zeco | local (no state passed) | offset0 (positions wrong)."""
    from lingua_zeco import distributed
    from lingua_zeco import evaluation

    torch.set_num_threads(1)
    env = distributed.setup(distributed.DistributedArgs(sp_size=sp, sp_method="zeco", fsdp=False))
    right_offset = evaluation.position_offset
    out = {}
    try:
        for variant in variants:
            # offset0: every SP rank counts its tokens from position 0
            evaluation.position_offset = (lambda sp_rank, seq_len: 0) if variant == "offset0" else right_offset
            method = "local" if variant == "local" else env.sp_method
            out[variant] = {}
            for name, data, vocab, ev in (
                    ("text", DataArgs(seq_len=CONTEXT // sp, batch_size=2, prefetch=0), 258,
                     EvalArgs(every=1, steps=2)),
                    ("mqar", DataArgs(synthetic="mqar", seq_len=CONTEXT // sp, batch_size=4, mqar=MQAR),
                     MQAR.vocab_size, EvalArgs(every=1, steps=2, recall_span=2))):
                model = GLAForCausalLM(dataclasses.replace(POS_MODEL, vocab_size=vocab),
                                       sp=dataclasses.replace(env.sp, method=method))
                model.init_weights(0)
                out[variant][name] = evaluation.evaluate(
                    model, data, ev, device=torch.device("cpu"), dp_rank=env.dp_rank, dp_size=env.dims.dp,
                    sp_rank=env.sp_rank, sp_size=env.dims.sp)
        return out
    finally:
        evaluation.position_offset = right_offset
        distributed.teardown(env)


def _merge(parts: list[dict]) -> dict:
    """Results of separate single-process evaluations of DP ranks 0..D-1 as one: token-weighted means."""
    out = {"val_context": parts[0]["val_context"]}
    for key in {k for p in parts for k in p if k.endswith("_tokens") or k == "val_recall_answers"}:
        mean = key.replace("_tokens", "_loss") if key.endswith("_tokens") else "val_recall_acc"
        n = sum(p.get(key, 0) for p in parts)
        out[key], out[mean] = n, sum(p[mean] * p[key] for p in parts if key in p) / n
    out["val_ppl"] = math.exp(out["val_loss"])
    return out


def _sp1_reference(dp: int) -> dict:
    """The same global sequences on one process: sp = 1, each DP rank's stream in turn."""
    return {name: _merge([_pos_eval_dp(name, dp_rank, dp) for dp_rank in range(dp)]) for name in ("text", "mqar")}


def _pos_eval_dp(name, dp_rank, dp):
    torch.set_num_threads(2)
    text = name == "text"
    data = DataArgs(seq_len=CONTEXT, batch_size=2, prefetch=0) if text else \
        DataArgs(synthetic="mqar", seq_len=CONTEXT, batch_size=4, mqar=MQAR)
    model = GLAForCausalLM(dataclasses.replace(POS_MODEL, vocab_size=258 if text else MQAR.vocab_size))
    model.init_weights(0)
    return evaluate(model, data, EvalArgs(every=1, steps=2, recall_span=0 if text else 2),
                    device=torch.device("cpu"), dp_rank=dp_rank, dp_size=dp)


def _same(a: dict, b: dict, rel: float = 1e-10) -> bool:
    keys = sorted(k for k in a if k.startswith("val_"))
    return keys == sorted(k for k in b if k.startswith("val_")) and all(
        b[k] == pytest.approx(a[k], rel=rel, abs=1e-12) for k in keys)


def _pos_keys(r: dict) -> list[int]:
    return sorted(int(k[len("val_pos"):-len("_loss")]) for k in r if k.startswith("val_pos") and k.endswith("_loss"))


def test_position_buckets():
    assert bucket_bounds(64) == [(0, 1), (1, 2), (2, 4), (4, 8), (8, 16), (16, 32), (32, 64)]
    assert bucket_bounds(48)[-1] == (32, 48) and bucket_bounds(1) == [(0, 1)] and n_buckets(65) == 8
    pos = torch.arange(200)
    assert [(int(p), int(b)) for p, b in zip(pos, bucket_of(pos))][:9] == \
        [(0, 0), (1, 1), (2, 2), (3, 2), (4, 3), (5, 3), (6, 3), (7, 3), (8, 4)]
    for b, (lo, hi) in enumerate(bucket_bounds(200)):
        assert ((bucket_of(pos) == b) == ((pos >= lo) & (pos < hi))).all()
    acc = PositionLoss(16, "cpu")
    mask = torch.tensor([[True, False, True, True, True, True, True, True]])
    acc.add(torch.arange(7.0), torch.ones(7, dtype=torch.bool), mask, offset=8)  # positions 8, 10..15
    assert acc.metrics() == {"val_context": 16, "val_pos8_loss": 3.0, "val_pos8_tokens": 7}
    with pytest.raises(ValueError, match="past the context"):
        acc.add(torch.zeros(8), torch.ones(8, dtype=torch.bool), torch.ones(1, 8, dtype=torch.bool), offset=12)
    # packed documents [0, 3), [3, 3), [3, 11), [11, 16): positions 8..15 are 5, 6, 7, 0, 1, 2, 3, 4 in their documents
    docs = PositionLoss(16, "cpu")
    docs.add(torch.arange(8.0), torch.ones(8, dtype=torch.bool), torch.ones(1, 8, dtype=torch.bool), offset=8,
             cu_seqlens=torch.tensor([0, 3, 3, 11, 16]))
    assert docs.metrics() == {"val_context": 16, "val_pos0_loss": 3.0, "val_pos0_tokens": 1, "val_pos1_loss": 4.0,
                              "val_pos1_tokens": 1, "val_pos2_loss": 5.5, "val_pos2_tokens": 2, "val_pos4_loss": 2.5,
                              "val_pos4_tokens": 4}


@pytest.fixture(scope="module")
def sp1_dp1():
    return _sp1_reference(1)


def test_eval_sp2_equals_sp1_by_position(sp1_dp1):
    """One fp64 model, the same 64-token sequences: evaluated over 2 SP ranks (32 tokens each, the
    state passed by zeco) it gives the sp = 1 loss and the same loss in every position bucket; the
    buckets' token-weighted mean is the loss. Wrong per-rank offsets or a dropped state are caught."""
    ref = sp1_dp1
    assert _pos_keys(ref["text"]) == [0, 1, 2, 4, 8, 16, 32]
    text = ref["text"]
    assert sum(text[f"val_pos{lo}_tokens"] for lo in _pos_keys(text)) == text["val_tokens"] == 2 * 2 * 64
    assert sum(text[f"val_pos{lo}_loss"] * text[f"val_pos{lo}_tokens"] for lo in _pos_keys(text)) / \
        text["val_tokens"] == pytest.approx(text["val_loss"], rel=1e-13)
    # MQAR, recall_span=2: every answer in [32, 64), on the last of 2 ranks (pairs on the first)
    assert _pos_keys(ref["mqar"]) == [32] and ref["mqar"]["val_pos32_tokens"] == ref["mqar"]["val_recall_answers"]
    assert ref["mqar"]["val_recall_answers"] == 2 * 4 * 8 and 0 <= ref["mqar"]["val_recall_acc"] <= 1
    per_rank = run_on_ranks(_pos_eval, 2, 2, ("zeco", "offset0", "local"), timeout_s=180)
    for got in per_rank:  # every rank returns the reduced result
        for name in ("text", "mqar"):
            assert _same(ref[name], got["zeco"][name]), (name, ref[name], got["zeco"][name])
    offset0, local = per_rank[0]["offset0"], per_rank[0]["local"]
    assert not _same(ref["text"], offset0["text"])  # rank 1's tokens counted at positions 0..31
    assert not _same(ref["text"], local["text"])
    # without the state from rank 0, only the positions on rank 1 ([32, 64)) lose; rank 0's are unchanged
    assert all(local["text"][f"val_pos{lo}_loss"] == pytest.approx(ref["text"][f"val_pos{lo}_loss"], rel=1e-10)
               for lo in (0, 1, 2, 4, 8, 16))
    assert abs(local["text"]["val_pos32_loss"] - ref["text"]["val_pos32_loss"]) > 1e-6
    assert local["mqar"]["val_pos32_loss"] != pytest.approx(ref["mqar"]["val_pos32_loss"], rel=1e-6)


@pytest.mark.slow  # 4 spawned ranks: their start-up is most of its 8-25 s on 2 shared cores
def test_eval_dp2_sp2_equals_sp1():
    """4 ranks = 2 DP x 2 SP: the same as each DP rank's sequences evaluated whole on one process."""
    ref = _sp1_reference(2)
    got = run_on_ranks(_pos_eval, 4, 2, timeout_s=180)
    for r in got:
        for name in ("text", "mqar"):
            assert _same(ref[name], r["zeco"][name]), (name, ref[name], r["zeco"][name])
    assert got[0]["zeco"]["text"]["val_tokens"] == 2 * 2 * 2 * CONTEXT


def _train_then_eval(rank, world, dump_dir):
    """Train 2 steps at sp = 2 (validating at step 2), then the eval CLI on the same 2 ranks."""
    torch.set_num_threads(1)
    train(parse_args(TrainArgs, [*TINY, f"dump_dir={dump_dir}", "steps=2", "distributed.sp_size=2", "eval.steps=1"]))
    return gla_eval.run(gla_eval.EvalCLIArgs(dump_dir=dump_dir, eval=EvalArgs(every=1, steps=1), device="cpu",
                                             out=os.path.join(dump_dir, "eval.jsonl")))


def test_eval_cli_on_the_sp_mesh_writes_loss_by_position(tmp_path, caplog, capsys):
    """A run trained at sp = 2 (2 x 64 tokens per sequence): its in-training validation and the eval
    CLI on 2 ranks (the run's sp_size by default) write the per-position losses at the 128-token
    context; the CLI at sp_size=1 (one process, 128 tokens per rank) gives the same numbers."""
    from apps.gla import plot_positions

    sp2 = run_on_ranks(_train_then_eval, 2, str(tmp_path), timeout_s=240)[0]
    buckets = [0, 1, 2, 4, 8, 16, 32, 64]
    assert sp2["sp_size"] == 2 and sp2["val_context"] == 128 and _pos_keys(sp2) == buckets
    assert sum(sp2[f"val_pos{lo}_tokens"] for lo in buckets) == sp2["val_tokens"] == 2 * 128
    logged = [json.loads(line) for line in (tmp_path / "eval.jsonl").read_text().splitlines()]
    assert len(logged) == 1 and logged[0]["val_pos64_loss"] == sp2["val_pos64_loss"] and "time" in logged[0]
    trained = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "val_loss" in r]
    assert [r["step"] for r in trained] == [2] and _pos_keys(trained[0]) == buckets
    with caplog.at_level("INFO", logger="lingua_zeco.evaluation"):
        sp1 = gla_eval.run(gla_eval.EvalCLIArgs(dump_dir=str(tmp_path), eval=EvalArgs(every=1, steps=1), sp_size=1,
                                                device="cpu"))
    assert sp1["sp_size"] == 1 and sp1["val_context"] == 128
    assert "val loss by token position (context 128)" in caplog.text
    for r in (trained[0], sp1):
        assert _pos_keys(r) == buckets and all(
            r[k] == pytest.approx(sp2[k], rel=1e-5) for k in sp2 if k.startswith("val_")), (r, sp2)
    # a mesh that cannot hold the run's SP size: one error line naming the eval key
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        gla_eval.main([f"dump_dir={tmp_path}", "eval.steps=1", "device=cpu"])  # 1 process, sp_size 2
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and "for evaluation set sp_size=" in err[0], err
    png = plot_positions.main([f"dump_dir={tmp_path}", f"compare={tmp_path / 'eval.jsonl'}",
                               f"out={tmp_path / 'pos.png'}"])
    assert os.path.getsize(png) > 1000


def test_builtin_validation_split_holds_the_default_eval_steps():
    """At debug.yaml's layout (the quickstart), the held-out split holds at least the default eval.steps
    batches: evaluating the quickstart's run with the defaults repeats no document (and warns of nothing)."""
    data = parse_args(TrainArgs, ["config=debug.yaml"]).data
    loader = build_data_loader(validation_data_args(data, EvalArgs(every=1)), dp_rank=0, dp_size=1, sp_rank=0,
                               sp_size=1, seed=0)
    try:
        batches = 0
        while getattr(loader, "epoch", 0) == 0:
            next(loader)
            batches += 1
    finally:
        loader.close()
    assert batches - 1 >= EvalArgs().steps, batches  # the batch that wrapped round holds repeated documents


def test_eval_help_examples_run_after_the_quickstart(tmp_path, monkeypatch, caplog, capsys):
    """The commands of `python -m apps.gla.eval --help` without torchrun or '...', run as written (in the
    folder where the quickstart ran, here made tiny) after the quickstart: each prints its result line and
    no warning (no overlap refusal, no repeated documents)."""
    torch.set_num_threads(2)
    monkeypatch.chdir(tmp_path)
    train(parse_args(TrainArgs, [*TINY[:-2], "steps=50", "logging.freq=50"]))  # dump_dir: debug.yaml's
    examples = [line.split("#")[0].split()[3:] for line in gla_eval.__doc__.splitlines()
                if line.strip().startswith("python -m apps.gla.eval ") and "..." not in line]
    assert len(examples) >= 2, gla_eval.__doc__
    for argv in examples:
        capsys.readouterr()
        with caplog.at_level("WARNING"):
            gla_eval.main(argv)
        assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["val_loss"] > 0, argv
        assert not [r for r in caplog.records if r.levelno >= 30], (argv, caplog.text)
