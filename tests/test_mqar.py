"""MQAR data (labels only at answers, pairs and queries on different ranks) and the recall proof in
small: trained with SP = 2, the answers on rank 1 are learned only when the state crosses from rank 0."""
from __future__ import annotations

import math

import pytest
import torch

from apps.gla.train import TrainArgs, train
from lingua_zeco.args import parse_args
from lingua_zeco.data import DataArgs, build_data_loader
from lingua_zeco.data.mqar import IGNORE_INDEX, MQARArgs
from lingua_zeco.metrics import read_metrics
from lingua_zeco.testing import run_on_ranks


def _batches(args: DataArgs, sp_size: int, n: int = 3):
    loaders = [build_data_loader(args, dp_rank=0, dp_size=1, sp_rank=p, sp_size=sp_size, seed=7) for p in range(sp_size)]
    return [[next(ld) for ld in loaders] for _ in range(n)]


@pytest.mark.parametrize("gap", [-1, 0])
def test_mqar_layout_crosses_the_rank_boundary(gap):
    m = MQARArgs(n_keys=8, n_values=8, n_pairs=4, gap=gap)
    args = DataArgs(synthetic="mqar", seq_len=32, batch_size=4, mqar=m)
    for rank0, rank1 in _batches(args, 2):
        x0, y0, x1, y1 = rank0["input_ids"], rank0["labels"], rank1["input_ids"], rank1["labels"]
        assert (y0 == IGNORE_INDEX).all()  # no answer on the rank holding the pairs
        assert ((y1 != IGNORE_INDEX).sum(1) == 4).all()  # 4 answers per sequence, all on rank 1
        assert ((x1 >= 1) & (x1 <= 8)).sum() == 4 * 4 and not (x1 > 8).any()  # rank 1: only query keys
        for b in range(4):
            keys, vals = x0[b][(x0[b] >= 1) & (x0[b] <= 8)], x0[b][x0[b] > 8]
            pairs = dict(zip(keys.tolist(), vals.tolist()))
            asked = y1[b] != IGNORE_INDEX
            assert [pairs[k] for k in x1[b][asked].tolist()] == y1[b][asked].tolist()  # answer = the key's value
    sp1 = _batches(DataArgs(synthetic="mqar", seq_len=64, batch_size=4, mqar=m), 1)
    for (a,), (r0, r1) in zip(sp1, _batches(args, 2)):  # SP-invariant stream: the same global sequences
        assert torch.equal(a["input_ids"], torch.cat([r0["input_ids"], r1["input_ids"]], 1))
        assert torch.equal(a["labels"], torch.cat([r0["labels"], r1["labels"]], 1))


def test_mqar_resume_and_errors():
    args = DataArgs(synthetic="mqar", seq_len=32, batch_size=2, mqar=MQARArgs(n_pairs=4, n_keys=8, n_values=8))
    a = build_data_loader(args, dp_rank=0, dp_size=1, sp_rank=0, sp_size=2, seed=1)
    next(a)
    sd = a.state_dict()
    want = next(a)
    b = build_data_loader(args, dp_rank=0, dp_size=1, sp_rank=0, sp_size=2, seed=1)
    b.load_state_dict(sd)
    assert torch.equal(next(b)["input_ids"], want["input_ids"])
    with pytest.raises(ValueError, match="do not fit"):
        build_data_loader(DataArgs(synthetic="mqar", seq_len=4, mqar=MQARArgs(n_pairs=4)), dp_rank=0, dp_size=1,
                          sp_rank=0, sp_size=2, seed=0)
    with pytest.raises(ValueError, match="synthetic"):
        build_data_loader(DataArgs(synthetic="copy"), dp_rank=0, dp_size=1, sp_rank=0, sp_size=1, seed=0)


STEPS = 150


def _train_on_rank(rank, world, argv):
    torch.set_num_threads(1)
    train(parse_args(TrainArgs, argv))


@pytest.mark.long  # ~1 min of training; its margin depends on the run (docs/long_context.md)
def test_recall_needs_the_state_from_the_other_rank(tmp_path):
    """The first 150 steps of configs/mqar_sp2.yaml's 1000-step run (same lr schedule; docs/long_context.md).
    Chance is 1/8; zeco's accuracy over steps 101-150 is clearly above it, local's (no state
    passing: rank 1 never sees a pair) stays at chance, and the loss on answers stays >= ln 8."""
    acc = {}
    for method in ("zeco", "local"):
        argv = ["config=mqar_sp2.yaml", f"dump_dir={tmp_path / method}", f"steps={STEPS}",
                f"distributed.sp_method={method}", "optim.decay_steps=1000"]  # the 1000-step run's lr schedule
        run_on_ranks(_train_on_rank, 2, argv, timeout_s=600)
        rows = read_metrics(tmp_path / method / "metrics.jsonl")
        late = [r for r in rows if r["step"] > STEPS - 50]
        assert all(r["recall_answers"] == 10 * 32 * 4 for r in late)  # 10 steps x 32 sequences x 4 answers
        acc[method] = sum(r["recall_acc"] for r in late) / len(late)
        acc[method + "_loss"] = sum(r["loss"] for r in late) / len(late)
    assert abs(acc["local"] - 1 / 8) < 0.03, acc  # 6400 answers: chance +- 3 sd is +- 0.012
    assert acc["local_loss"] > math.log(8) - 0.02, acc
    assert acc["zeco"] > acc["local"] + 0.04 and acc["zeco_loss"] < math.log(8) - 0.05, acc
